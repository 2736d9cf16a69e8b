"""One run per out_dir: an exclusive lock on `<out_dir>/.lock` for the whole run.

    with RunLock(out_dir):          # RunLockedError if a live process holds it
        ...                         # the run: nobody else writes into out_dir meanwhile

The lock is `fcntl.flock` on the file, which holds the owner's pid for the message. The kernel
releases a flock when its process ends, however it ends (exit, exception, kill -9), so the lock
of a dead process is stale by construction: the file stays, but the next run locks it at once
(and says whose pid it replaces). A refused run opens the file without truncating it and writes
nothing. Where fcntl does not exist (Windows) runs are not locked.

The file is opened with O_NOFOLLOW and must be a regular file with one link: a symbolic or
hard link at `.lock` (in a shared folder, planted by someone else) is refused with a
RunLockedError, since taking the lock truncates the file.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from torch_mhc.lm.train.errors import RunLockedError
from torch_mhc.runtime.files import NOFOLLOW

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["LOCK_FILE", "RunLock"]

LOCK_FILE = ".lock"


class RunLock:
    """Exclusive, non-blocking lock of a run folder; a context manager, or acquire/release."""

    def __init__(self, out_dir: str | os.PathLike):
        self.path = Path(out_dir) / LOCK_FILE
        self.fd: int | None = None
        self.stale_pid: int | None = None  # the pid a previous, dead owner left in the file

    def acquire(self) -> RunLock:
        if fcntl is None or self.fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_pid(fd)
            os.close(fd)
            who = f"process {owner}" if owner else "another process"
            raise RunLockedError(
                f"{self.path.parent} is in use by {who} (lock {self.path}): one run per "
                "out_dir; wait for it to finish or choose another out_dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        old = _read_pid(fd)
        self.stale_pid = old if old and old != os.getpid() else None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def _open(self) -> int:
        """The lock file's descriptor: never through a link, never anything but a plain file
        (O_NONBLOCK: a FIFO planted there must not hang the open)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | NOFOLLOW | os.O_NONBLOCK, 0o666)
        except OSError as e:
            if e.errno == errno.ELOOP or self.path.is_symlink():
                raise RunLockedError(self._refusal("is a symbolic link")) from None
            raise
        st = os.fstat(fd)
        problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode) else
                   f"has {st.st_nlink} hard links" if st.st_nlink != 1 else None)
        if problem:
            os.close(fd)
            raise RunLockedError(self._refusal(problem))
        return fd

    def _refusal(self, problem: str) -> str:
        return (f"the lock {self.path} {problem}: refusing to use it (taking the lock rewrites "
                "the file); remove it or choose another out_dir")

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            os.ftruncate(fd, 0)  # the pid is no one's any more
        finally:
            os.close(fd)  # closing the only descriptor releases the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
