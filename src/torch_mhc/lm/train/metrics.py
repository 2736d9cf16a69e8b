"""What a run reports: metrics.jsonl (and TensorBoard), log lines, the progress bar, peak memory.

metrics.jsonl holds one JSON object per line ({"kind": "train" | "eval" | "gain" | "stopped",
"step": ..., ...}). Each line goes to the file in one write of the whole line (O_APPEND), so a
killed run leaves at most a torn last line; a resumed run keeps the lines up to the step it
resumes from and drops the rest, a torn line included, so the file reads as one run.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import re
import resource
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from torch_mhc.lm.config import ConfigError, TrainConfig
from torch_mhc.lm.parallel import is_rank0
from torch_mhc.lm.train.errors import DiskFullError, storage_errno, storage_problem
from torch_mhc.runtime.files import NOFOLLOW, atomic_write

__all__ = ["METRICS_FILE", "MetricsLog", "PeakMemory", "Printer", "progress_bar"]

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """JSONL lines in out_dir/metrics.jsonl and, when available, TensorBoard scalars (rank 0)."""

    def __init__(self, cfg: TrainConfig, start_step: int):
        self.fd: int | None = None
        self.tb = None
        self.dropped = 0  # lines of the previous run dropped on resume (torn or after the step)
        if cfg.out_dir is None or not is_rank0():
            return
        self.path = Path(cfg.out_dir) / METRICS_FILE
        if self.path.is_dir():
            raise ConfigError(f"{self.path} is a folder; the run writes its metrics to a file "
                              "of that name (move the folder away or choose another out_dir)")
        self._rewrite(start_step)
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW,
                              0o666)
        except OSError as e:
            raise ConfigError(f"cannot open {self.path} for writing: {e.strerror}") from None
        if cfg.tensorboard:
            self.tb = _tensorboard(Path(cfg.out_dir) / "tb", start_step)

    def _rewrite(self, start_step: int) -> None:
        """Keep the lines up to start_step of a resumed run; empty the file of a fresh one."""
        if not self.path.exists():
            return
        kept = []
        if start_step > 0:
            for line in self.path.read_bytes().decode("utf-8", "replace").splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a torn line of a killed run, or an empty one
                    self.dropped += bool(line.strip())
                    continue
                if isinstance(record, dict) and record.get("step", 0) <= start_step:
                    kept.append(json.dumps(record) + "\n")
                else:
                    self.dropped += 1
        _write_or_disk_full(lambda: atomic_write(self.path, "".join(kept).encode()), self.path)

    def write(self, record: dict) -> None:
        if self.fd is not None:
            line = (json.dumps(record) + "\n").encode()
            _write_or_disk_full(lambda: _write_all(self.fd, line), self.path)
        if self.tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key not in ("step", "kind") and isinstance(value, int | float):
                    self.tb.add_scalar(f"{record.get('kind', 'train')}/{key}", value, step)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _write_or_disk_full(write, path: Path) -> None:
    try:
        write()
    except OSError as e:
        code = storage_errno(e)
        if code is not None:
            raise DiskFullError(code, f"{storage_problem(code)} writing {path}") from None
        raise


def _tensorboard(log_dir: Path, start_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard not installed: JSONL only
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=start_step if start_step else None)


class Printer:
    """Log lines on rank 0 only; through tqdm.write while a bar is shown."""

    def __init__(self, cfg: TrainConfig):
        self.enabled = is_rank0() and not cfg.quiet
        self.bar = None

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None and not self.bar.disable:
            self.bar.write(message)
        else:
            print(message, flush=True)


def progress_bar(cfg: TrainConfig, start_step: int) -> tqdm:
    """The step bar: shown on rank 0 on a terminal when cfg.progress (disable=None)."""
    return tqdm(total=cfg.steps, initial=start_step, desc=cfg.model.connection, unit="step",
                disable=None if (cfg.progress and is_rank0()) else True,
                dynamic_ncols=True, leave=False)


# ---------------------------------------------------------------------------------------------
# Peak memory
# ---------------------------------------------------------------------------------------------


class PeakMemory:
    """Peak memory of a run, in bytes, and what the number means.

    CUDA: torch.cuda.max_memory_allocated (tensors only), its counter reset at the start.
    CPU on Linux: the peak resident set size of the process (VmHWM), reset at the start by
    writing 5 to /proc/self/clear_refs, minus the RSS at the start: everything the run
    added to the process (tensors, allocator caches, corpus pages read through the memmap).
    Before the reset, free heap memory is returned to the OS (see _release_free_memory).
    Elsewhere: the growth of getrusage's ru_maxrss, which cannot be reset, so a second run in
    one process reports only what exceeds the first one's peak.
    """

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.base, self.kind = 0, "cuda max_memory_allocated"
            return
        _release_free_memory()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base, self.kind = _proc_status_kb("VmRSS") * 1024, "peak RSS increase (VmHWM)"
        except OSError:
            self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _RUSAGE_UNIT
            self.kind = "ru_maxrss increase"

    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.kind.startswith("peak RSS"):
            return max(0, _proc_status_kb("VmHWM") * 1024 - self.base)
        return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _RUSAGE_UNIT
                   - self.base)


def _release_free_memory() -> None:
    """Collect garbage and hand glibc's free heap back to the OS (malloc_trim), so that the
    next run's allocations raise the RSS again instead of silently reusing memory an earlier
    run in this process freed (which would make a second run look almost free)."""
    gc.collect()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


_RUSAGE_UNIT = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, else KiB


def _proc_status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{key}:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
    if match is None:
        raise OSError(f"/proc/self/status has no {key}")
    return int(match.group(1))
