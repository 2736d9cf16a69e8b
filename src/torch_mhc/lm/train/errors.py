"""What can stop a run, each a message for the user (not a bug), and the exit status of `mhc`.

    EXIT_DONE 0         the run finished
    EXIT_STOPPED 1      the spike policy stopped it (TrainingDiverged)
    EXIT_BAD_INPUT 2    bad configuration, data or checkpoint; the out_dir is in use
                        (ConfigError, CheckpointError, RunLockedError)
    EXIT_NO_SPACE 3     the disk filled up while writing (DiskFullError)
    EXIT_INTERRUPTED 130  Ctrl-C / SIGTERM (RunInterrupted): a checkpoint was written first

No numpy: the command line names these without importing the trainer.
"""

from __future__ import annotations

import errno

from torch_mhc.lm.config import ConfigError
from torch_mhc.lm.parallel.checkpoint import (
    CheckpointError,  # raised by the checkpoint reader itself
)

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_DONE",
    "EXIT_INTERRUPTED",
    "EXIT_NO_SPACE",
    "EXIT_STOPPED",
    "CheckpointError",
    "ConfigError",
    "DiskFullError",
    "RunInterrupted",
    "RunLockedError",
    "TrainingDiverged",
    "is_disk_full",
]

EXIT_DONE, EXIT_STOPPED, EXIT_BAD_INPUT, EXIT_NO_SPACE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

# the errno values of a full disk or an exhausted quota
_NO_SPACE = {errno.ENOSPC} | ({errno.EDQUOT} if hasattr(errno, "EDQUOT") else set())


class RunLockedError(ConfigError):
    """Another live process holds the out_dir's lock."""


class DiskFullError(OSError):
    """No space left while writing a checkpoint or the metrics; what was there is intact."""


class TrainingDiverged(RuntimeError):
    """The spike policy stopped the run. `step` is the step that failed (1-based), `result`
    the TrainResult up to the last good step."""

    def __init__(self, message: str, step: int, result=None):
        super().__init__(message)
        self.step, self.result = step, result


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM stopped the run at a step boundary; `checkpoint` is the
    checkpoint written on the way out (None without out_dir), `result` the TrainResult."""

    def __init__(self, message: str, step: int, checkpoint: str | None = None, result=None):
        super().__init__(message)
        self.step, self.checkpoint, self.result = step, checkpoint, result


def is_disk_full(error: BaseException) -> bool:
    """True when `error`, or an error it wraps (DCP's CheckpointException keeps each rank's
    failure), is a full disk. torch's zip writer reports one as "unexpected pos"."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return True
        if isinstance(e, DiskFullError):
            return True
        if isinstance(e, RuntimeError) and "unexpected pos" in str(e):
            return True
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's wrapper
        if isinstance(failures, dict):
            for v in failures.values():  # rank -> (exception, traceback summary)
                stack.append(v[0] if isinstance(v, tuple) and v else v)
        stack.extend([e.__cause__, e.__context__])
    return False
