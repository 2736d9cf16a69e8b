"""Writing files so that a crash never leaves half of one: the one atomic write of the package.

    atomic_write("report.json", json.dumps(report).encode())
    atomic_write("big.bin", lambda f: f.write(chunk))     # or a function writing to a file

The new content goes to a temporary file `.<name>.<random>.tmp` in the same folder (a rename is
atomic only within one file system), is fsynced, then renamed over the target; on any error
the temporary file is removed and the target keeps its old content. `remove_stale_temp_files`
deletes such temporary files left behind by a process that was killed mid-write (call it only
while no other process may be writing into the folder, e.g. under a run's lock).

Nothing here follows a symbolic link at the name it writes or removes: `refuse_symlink` raises
`SymlinkRefused` (an OSError, ELOOP) for one, `remove_tree` deletes a folder or file but never
through a link, `NOFOLLOW` is the open flag. A link planted in a shared run folder would
otherwise redirect a truncation or a deletion to any file its target names.

Standard library only: importing it costs nothing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["NOFOLLOW", "TEMP_SUFFIX", "SymlinkRefused", "atomic_write", "fsync_dir",
           "refuse_symlink", "remove_stale_temp_files", "remove_tree", "temp_file"]

TEMP_SUFFIX = ".tmp"
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # 0 where the platform has no such flag (Windows)


class SymlinkRefused(OSError):
    """A name the caller writes or removes is a symbolic link: refused, never followed."""


def refuse_symlink(path: str | os.PathLike, what: str = "") -> None:
    """SymlinkRefused when `path` is a symbolic link (a missing path is fine)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise SymlinkRefused(
            errno.ELOOP, f"{path} is a symbolic link{' (' + what + ')' if what else ''}: "
            "refusing to follow it; replace it with a plain file or folder, or choose another "
            "out_dir", str(path))


def remove_tree(path: str | os.PathLike) -> bool:
    """Delete the folder (or file) `path`, never through a symbolic link; False if missing."""
    refuse_symlink(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)  # links inside are removed, not followed
    else:
        os.unlink(path)
    return True


def temp_file(path: str | os.PathLike) -> tuple[int, Path]:
    """(fd, path) of a new temporary file beside `path`, with a plain open()'s permissions."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    _usual_permissions(fd)
    return fd, Path(tmp)


def atomic_write(path: str | os.PathLike, data: bytes | Callable[[BinaryIO], object]) -> Path:
    """Write `path` so that it holds either its old content or the complete new one.

    data: the bytes, or a function that writes them to the binary file object it is given.
    The parent folder is created if missing. Returns the path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file(path)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def fsync_dir(path: str | os.PathLike) -> None:
    """Make renames inside the folder `path` durable, where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_stale_temp_files(folder: str | os.PathLike) -> list[Path]:
    """Delete the `.<name>.*.tmp` files atomic_write left in `folder` when its writer died;
    return what was removed. Only safe while nobody else writes into the folder."""
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for p in folder.glob(f".*{TEMP_SUFFIX}"):
        if p.is_file() or p.is_symlink():  # a link is removed itself, never its target
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append(p)
    return removed


def _usual_permissions(fd: int) -> None:
    """mkstemp creates files readable by their owner only; give the file the permissions a
    plain open() would (0o666 minus the umask), since it replaces an ordinary file."""
    umask = os.umask(0)
    os.umask(umask)
    with contextlib.suppress(OSError, AttributeError):  # fchmod: not on every platform
        os.fchmod(fd, 0o666 & ~umask)
