"""What can stop a run, each a message for the user (not a bug), and the exit status of `mhc`.

    EXIT_DONE 0         the run finished
    EXIT_STOPPED 1      the spike policy stopped it (TrainingDiverged)
    EXIT_BAD_INPUT 2    bad configuration, data or checkpoint; the out_dir is in use
                        (ConfigError, CheckpointError, RunLockedError)
    EXIT_NO_SPACE 3     the storage refused a write: no space left, quota exceeded, file-size
                        limit (DiskFullError, its errno ENOSPC / EDQUOT / EFBIG)
    EXIT_INTERRUPTED 130  Ctrl-C, SIGINT (RunInterrupted): a checkpoint was written first
    EXIT_TERMINATED 143   SIGTERM (RunInterrupted with signum SIGTERM), alike

No numpy: the command line names these without importing the trainer.
"""

from __future__ import annotations

import errno
import signal

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
    "EXIT_TERMINATED",
    "CheckpointError",
    "ConfigError",
    "DiskFullError",
    "RunInterrupted",
    "RunLockedError",
    "TrainingDiverged",
    "is_disk_full",
    "storage_errno",
    "storage_problem",
]

EXIT_DONE, EXIT_STOPPED, EXIT_BAD_INPUT, EXIT_NO_SPACE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_TERMINATED = 128 + signal.SIGTERM

# the errno values of a write the storage refused: a full disk, an exhausted quota, a file
# larger than the process may write (RLIMIT_FSIZE)
_NO_SPACE = ({errno.ENOSPC, errno.EFBIG}
             | ({errno.EDQUOT} if hasattr(errno, "EDQUOT") else set()))
_PROBLEMS = {errno.ENOSPC: "no space left on the device",
             errno.EFBIG: "file too large (over the file-size limit, ulimit -f)"}
if hasattr(errno, "EDQUOT"):
    _PROBLEMS[errno.EDQUOT] = "disk quota exceeded"


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
    checkpoint written on the way out (None without out_dir), `result` the TrainResult,
    `signum` the signal (the exit status is 128 + signum)."""

    def __init__(self, message: str, step: int, checkpoint: str | None = None, result=None,
                 signum: int = signal.SIGINT):
        super().__init__(message)
        self.step, self.checkpoint, self.result = step, checkpoint, result
        self.signum = int(signum)

    def saying(self, message: str) -> RunInterrupted:
        """The same interruption with another message (a command that runs many trainings
        says how to go on with all of them, not with this one's checkpoint)."""
        return RunInterrupted(message, self.step, self.checkpoint, self.result, self.signum)


def is_disk_full(error: BaseException) -> bool:
    """True when `error`, or an error it wraps, is a write the storage refused (see
    storage_errno)."""
    return storage_errno(error) is not None


def storage_errno(error: BaseException) -> int | None:
    """ENOSPC, EDQUOT or EFBIG when `error`, or an error it wraps (DCP's CheckpointException
    keeps each rank's failure), is a write the storage refused; None otherwise. torch's zip
    writer reports one as "unexpected pos", without the errno: EFBIG when the process has a
    file-size limit, else ENOSPC."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return e.errno
        if isinstance(e, DiskFullError):
            return errno.ENOSPC
        if isinstance(e, RuntimeError) and "unexpected pos" in str(e):
            return errno.EFBIG if _file_size_limited() else errno.ENOSPC
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's wrapper
        if isinstance(failures, dict):
            for v in failures.values():  # rank -> (exception, traceback summary)
                stack.append(v[0] if isinstance(v, tuple) and v else v)
        stack.extend([e.__cause__, e.__context__])
    return None


def storage_problem(code: int | None) -> str:
    """The words for a refused write's errno: "no space left on the device", ..."""
    return _PROBLEMS.get(code, _PROBLEMS[errno.ENOSPC])


def _file_size_limited() -> bool:
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return False
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return soft != resource.RLIM_INFINITY
