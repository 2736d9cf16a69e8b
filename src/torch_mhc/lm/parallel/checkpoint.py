"""Checkpoints through torch.distributed.checkpoint (DCP): one format for one process and many.

    save_checkpoint("ckpt/", model, optimizer, extra={"step": 100})   # every rank calls it
    extra = load_checkpoint("ckpt/", model, optimizer)                # every rank calls it
    state = read_state_dict("ckpt/")     # {"model": {...}, "optim": {...}} without a model

What is saved. `get_state_dict` gives the model and optimizer state keyed by the parameter
names of the plain model (`blocks.3.attn.phi`, ...), whatever wraps it: a DDP prefix is
stripped, FSDP2 shards stay DTensors, pipeline stages already use the plain model's names. The
optimizer state is flattened to the same names (`state.blocks.3.attn.phi.exp_avg`), which is
what lets DCP reshard it. Each rank writes the pieces it owns; on load each rank reads the
pieces its layout needs, so a checkpoint saved by FSDP2 on 2 ranks loads into DDP on 4, into a
pipeline, or into one process without any process group (and a single process saves the same
format). `extra` is the caller's own small state, plain values and tensors, written by rank 0
to `extra.pt`. `meta.json`, written last, says the directory is complete and holds the CRC-32
and size of every other file, checked before anything is read.

Loading runs no code from the files. The tensors and `extra.pt` are read with
`torch.load(weights_only=True)` (DCP's own loader unpickles the non-tensor values in full:
`_SafeLoadPlanner` replaces it), and DCP's `.metadata`, a pickle, is read by `_SafeUnpickler`,
which builds only the types DCP metadata consists of and refuses anything else. Every problem
with the files (missing, truncated, flipped bytes, foreign, another model) is a
`CheckpointError` with a one-line message; none is a traceback.

Crash safety. The checkpoint is written to `<path>.partial`, and only when every rank has
finished writing is it renamed into place by rank 0: the previous checkpoint at `<path>` moves to
`<path>.old`, the new one to `<path>`, then `.old` becomes `previous` (when given; the
`previous` it replaces is first renamed to `<path>.deleting`, then deleted) or is deleted. Each
step is one rename, so a stop at any instruction leaves `<path>`, `<path>.old` or `previous`
complete: the readers try them in that order (newest first), and the next save settles what a
stopped one left (`_settle`: a complete `.old` takes its place again, `.partial` and `.deleting`
are removed). A save told which checkpoint the run last verified (`verified`, e.g. the
`previous` it resumed from because `<path>` was corrupt) first moves every newer one aside to
`<name>.corrupt-<n>`, so that the rotation never deletes the last good checkpoint. No rename or
deletion goes through a symbolic link (`SymlinkRefused`). A failure in rank 0's file operations
is sent to every rank and raised there, so no rank is left waiting in a collective. On several
machines `path` must be on a file system every rank sees.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import stat
import sys
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from torch_mhc.lm.parallel.env import is_rank0
from torch_mhc.runtime.files import atomic_write, fsync_dir, refuse_symlink, remove_tree

__all__ = [
    "CheckpointError",
    "is_complete",
    "load_checkpoint",
    "read_extra",
    "read_state_dict",
    "resolve_checkpoint",
    "save_checkpoint",
]

_FORMAT = "torch_mhc.dcp.v2"  # v2: meta.json lists every file's CRC-32 and size
_META = "meta.json"  # written last: its presence marks a complete checkpoint
_EXTRA = "extra.pt"
# Flattened optimizer state keys are parameter names, so the state can be resharded across
# layouts (the DCP documentation's recipe for pipeline parallelism).
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, corrupt, not ours, or does not fit."""


def _siblings(path: Path) -> tuple[Path, Path]:
    return path.with_name(path.name + ".partial"), path.with_name(path.name + ".old")


def _doomed(path: Path) -> Path:
    """Where a checkpoint goes to be deleted: renamed there first, so that a deletion cut
    short never leaves a half-deleted folder under a name a reader tries."""
    return path.with_name(path.name + ".deleting")


def _exists(path: Path) -> bool:
    return os.path.lexists(path)


def is_complete(path: str | os.PathLike) -> bool:
    """A checkpoint folder (not a link) holding its meta.json (written last by a save)."""
    try:
        folder, meta = os.lstat(path), os.lstat(Path(path) / _META)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return stat.S_ISDIR(folder.st_mode) and stat.S_ISREG(meta.st_mode)


def _rename(src: Path, dst: Path) -> None:
    """One step of a rotation (never through a link; `dst` must not exist)."""
    refuse_symlink(src)
    refuse_symlink(dst)
    os.rename(src, dst)


def _discard(path: Path) -> None:
    """Delete a checkpoint folder: renamed to `.deleting`, then removed."""
    doomed = _doomed(path)
    remove_tree(doomed)
    _rename(path, doomed)
    remove_tree(doomed)


def _replace(src: Path, dst: Path) -> None:
    """`src` takes the name `dst`; what `dst` held is deleted once it is no longer named."""
    doomed = _doomed(dst)
    remove_tree(doomed)
    if _exists(dst):
        _rename(dst, doomed)
    _rename(src, dst)
    remove_tree(doomed)


def remove_unfinished_save(path: str | os.PathLike,
                           previous: str | os.PathLike | None = None) -> Path | None:
    """Remove `<path>.partial`, left by a save of `path` that died (never a good
    checkpoint), and any `.deleting` folder; return the partial one if there was one. Rank 0's
    business, like the renames."""
    path = Path(path)
    tmp, old = _siblings(path)
    for doomed in (_doomed(path), _doomed(old)) + ((_doomed(Path(previous)),) if previous
                                                   else ()):
        remove_tree(doomed)
    return tmp if remove_tree(tmp) else None


def _set_aside(path: Path, say: Callable[[str], None], why: str) -> None:
    n = 1
    while _exists(path.with_name(f"{path.name}.corrupt-{n}")):
        n += 1
    aside = path.with_name(f"{path.name}.corrupt-{n}")
    _rename(path, aside)
    say(f"warning: moved {path} aside to {aside.name}: {why}")


def _settle(path: Path, previous: Path | None, verified: Path | None,
            say: Callable[[str], None]) -> None:
    """Rank 0, before a save: the checkpoints newer than `verified` are set aside, and what a
    stopped rotation left is put back in order (a complete `.old` is newer than `previous`)."""
    _, old = _siblings(path)
    order = [path, old] + ([previous] if previous is not None else [])
    absolute = [Path(os.path.abspath(p)) for p in order]
    verified = Path(os.path.abspath(verified)) if verified is not None else None
    if verified is not None and verified in absolute:
        for newer in order[:absolute.index(verified)]:
            if _exists(newer):
                _set_aside(newer, say, f"it failed to load and this run resumed from {verified}")
    if _exists(path) and not is_complete(path):
        _set_aside(path, say, "it is not a complete checkpoint")
    if not _exists(old):
        return
    if not is_complete(old):
        _discard(old)
    elif not _exists(path):
        _rename(old, path)
    elif previous is not None:
        _replace(old, previous)
    else:
        _discard(old)
    fsync_dir(path.parent)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _on_rank0(fn: Callable[[], None]) -> None:
    """Run fn on rank 0 and raise its error on every rank (a plain call in one process).
    Other ranks get a RuntimeError naming rank 0's error (an OSError with its errno when the
    disk is full)."""
    if not _distributed():
        fn()
        return
    error: list = [None]
    caught: Exception | None = None
    if dist.get_rank() == 0:
        try:
            fn()
        except Exception as e:  # sent to every rank below, then raised here as it was
            caught = e
            error = [(f"{type(e).__name__}: {e}", getattr(e, "errno", None))]
    dist.broadcast_object_list(error, src=0)
    if caught is not None:
        raise caught
    if error[0] is not None:
        message, code = error[0]
        if code in _NO_SPACE:  # a full disk stays recognisable as one on every rank
            raise OSError(code, f"checkpoint I/O failed on rank 0: {message}")
        raise RuntimeError(f"checkpoint I/O failed on rank 0: {message}")


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP warns that it assumes a single process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*in a single process.*")
        yield


def _serialise_extra(extra: dict | None) -> bytes:
    """extra as torch.save bytes, checked to load back with weights_only=True."""
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise TypeError(f"save_checkpoint: extra must be a dict, got {type(extra).__name__}")
    buf = io.BytesIO()
    try:
        torch.save(extra, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:
        raise TypeError(
            "save_checkpoint: extra must hold only plain values (dict, list, tuple, str, int, "
            f"float, bool, None) and tensors, which load with weights_only=True: {e}"
        ) from None
    return buf.getvalue()


def _file_sums(folder: Path) -> dict[str, list[int]]:
    """{file name: [size, crc32]} of every file in the folder."""
    sums = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and not p.is_symlink():  # a link is no file of the checkpoint
            crc, size = 0, 0
            with open(p, "rb") as f:
                while chunk := f.read(1 << 22):
                    crc, size = zlib.crc32(chunk, crc), size + len(chunk)
            sums[p.name] = [size, crc]
    return sums


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict | None = None,
    previous: str | os.PathLike | None = None,
    verified: str | os.PathLike | None = None,
    say: Callable[[str], None] | None = None,
) -> Path:
    """Write model (and optimizer) state to the directory `path`; every rank must call it.

    model: the module the training step runs (DDP wrapper, FSDP2 module, a pipeline's
    `Pipeline.module`, or a plain module in a single process). extra: the caller's own state,
    plain values and tensors (see the module docstring); rank 0's copy is saved. previous: where
    the checkpoint this one replaces goes (deleted when None). verified: the checkpoint the
    caller last loaded or saved (`path`, its `.old` or `previous`): the ones newer than it are
    moved aside first (reported through `say`, by default on stderr). Returns the final path.
    Replaces an existing checkpoint at `path` only once the new one is complete; on any error
    the partial directory is removed and `path` (or `.old`) is as it was.
    """
    path = Path(path)
    previous = Path(previous) if previous is not None else None
    verified = Path(verified) if verified is not None else None
    say = say or (lambda message: print(message, file=sys.stderr, flush=True))
    tmp, _ = _siblings(path)
    extra_bytes = _serialise_extra(extra)  # every rank checks, so every rank fails alike
    world = dist.get_world_size() if _distributed() else 1

    def prepare() -> None:
        for name in (path, *_siblings(path), previous):
            if name is not None:
                refuse_symlink(name, "a checkpoint name")
        remove_unfinished_save(path, previous)
        _settle(path, previous, verified, say)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()

    _on_rank0(prepare)
    optimizers = [optimizer] if optimizer is not None else []
    model_sd, optim_sd = get_state_dict(model, optimizers, options=_OPTIONS)
    state = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    try:
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=tmp, no_dist=not _distributed())  # collective
        _on_rank0(lambda: _commit(path, extra_bytes, world, previous))
    except BaseException:
        if is_rank0():
            with contextlib.suppress(OSError):
                remove_tree(tmp)
        raise
    return path


def _commit(path: Path, extra_bytes: bytes, world: int, previous: Path | None) -> None:
    """Rank 0, once every rank has written: extra.pt, meta.json (with the sums), the renames
    (each one step a reader survives; see the module docstring)."""
    tmp, old = _siblings(path)
    atomic_write(tmp / _EXTRA, extra_bytes)
    meta = {"format": _FORMAT, "saved_by_world_size": world, "files": _file_sums(tmp)}
    atomic_write(tmp / _META, json.dumps(meta, indent=1).encode())
    fsync_dir(tmp)
    if _exists(path):
        _rename(path, old)
    _rename(tmp, path)
    fsync_dir(path.parent)
    if _exists(old):
        if previous is None:
            _discard(old)
        else:
            _replace(old, previous)
        fsync_dir(path.parent)


# ---------------------------------------------------------------------------------------------
# Finding, checking and reading
# ---------------------------------------------------------------------------------------------


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The complete checkpoint directory for `path`: `path` itself, or `<path>.old` when a save
    was interrupted between its two renames. FileNotFoundError if neither is complete."""
    path = Path(path)
    _, old = _siblings(path)
    if is_complete(path):
        return path
    if is_complete(old):
        warnings.warn(
            f"torch_mhc: {path} is missing or incomplete; loading the previous checkpoint "
            f"{old} (a save was interrupted)",
            stacklevel=2,
        )
        return old
    raise FileNotFoundError(
        f"no complete checkpoint at {path} (no {_META}; neither at {old})"
    )


def _verify(where: Path) -> dict:
    """meta.json's content, after checking every file it lists against its size and CRC-32."""
    try:
        meta = json.loads((where / _META).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {where}: unreadable {_META} ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else meta
        raise CheckpointError(f"checkpoint {where} has format {found!r}, this version reads "
                              f"{_FORMAT!r}")
    files = meta.get("files")
    if not isinstance(files, dict) or ".metadata" not in files or _EXTRA not in files:
        raise CheckpointError(f"checkpoint {where}: {_META} does not list its files")
    for name, expected in files.items():
        if not (_plain_name(name) and isinstance(expected, list) and len(expected) == 2
                and all(_count(x) for x in expected)):
            raise CheckpointError(f"checkpoint {where}: {_META} has a malformed entry "
                                  f"{name!r}: {expected!r} (expected a file name and [size, "
                                  "CRC-32], two integers >= 0)")
    actual = _file_sums(where)
    for name, expected in files.items():
        if name not in actual:
            raise CheckpointError(f"checkpoint {where} is incomplete: {name} is missing")
        if actual[name] != list(expected):
            raise CheckpointError(
                f"checkpoint {where} is corrupt: {name} has size {actual[name][0]} and CRC-32 "
                f"{actual[name][1]:08x}, {_META} says {expected[0]} and {expected[1]:08x}"
            )
    return meta


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _plain_name(name) -> bool:
    """A file name inside the checkpoint folder: no separator, no `..`, not absolute."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and os.sep not in name and "\0" not in name)


def _open(path: str | os.PathLike) -> Path:
    try:
        where = resolve_checkpoint(path)
    except FileNotFoundError as e:
        raise CheckpointError(str(e)) from None
    _verify(where)
    _SafeReader(where).read_metadata()  # refused here, before DCP (which logs tracebacks)
    return where


def read_extra(path: str | os.PathLike) -> dict:
    """The `extra` dict of the checkpoint at `path` (checked, tensors on the CPU), without
    reading any model state: enough to decide whether the checkpoint fits a run."""
    return _extra(_open(path))


def _extra(where: Path) -> dict:
    try:
        extra = torch.load(where / _EXTRA, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {where}: {_EXTRA} is unreadable "
                              f"({_first_line(e)})") from None
    if not isinstance(extra, dict):
        raise CheckpointError(f"checkpoint {where}: {_EXTRA} does not hold a dict")
    return extra


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict:
    """Load a save_checkpoint directory into model (and optimizer) in place; every rank calls it.

    The layout may differ from the one that saved (world size, DDP / FSDP2 / pipeline / single
    process): DCP reads each rank's pieces. Build the optimizer before loading (for FSDP2,
    after apply_fsdp). Returns the `extra` dict that was saved (tensors on the CPU). Raises
    CheckpointError for anything wrong with the files or a state that does not fit.
    """
    where = _open(path)
    extra = _extra(where)
    optimizers = [optimizer] if optimizer is not None else []
    # The current state is the template: its keys say what to read, its shardings where to.
    model_sd, optim_sd = get_state_dict(model, optimizers, options=_OPTIONS)
    state = {"model": model_sd}
    if optimizer is not None:
        saved = set(_guarded(where, _SafeReader(where).read_metadata).state_dict_metadata)
        state["optim"], copies = _read_tied_as(optim_sd, saved)
    with _single_process_quiet():
        _guarded(where, lambda: dcp.load(state, storage_reader=_SafeReader(where),
                                         planner=_SafeLoadPlanner(), no_dist=not _distributed()))
    if optimizer is not None:
        state["optim"] = _restore_tied(state["optim"], copies)
    _guarded(where, lambda: set_state_dict(
        model, optimizers, model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}), options=_OPTIONS))
    return extra


# The LM's tied LM head: one tensor with the embedding in one process (its optimizer state
# saved under the embedding's name only), a copy of it on a pipeline's last stage (with its
# own state, equal to the embedding's: both copies take the same steps).
_TIED = ("lm_head.weight", "tok_emb.weight")


def _read_tied_as(optim_sd: dict, saved: set[str]) -> tuple[dict, dict]:
    """The optimizer template to load, with the head's entries that the checkpoint lacks read
    from the embedding's: renamed where this rank holds no embedding, else copied from it
    after loading. Returns (template, {head key: (embedding key, renamed)})."""
    head, emb = _TIED
    template, copies = dict(optim_sd), {}
    for key in optim_sd:
        parts = key.split(".")  # "state.lm_head.weight.exp_avg", "param_groups.lm_head..."
        if ".".join(parts[1:3]) != head or f"optim.{key}" in saved:
            continue
        alias = ".".join([parts[0], *emb.split("."), *parts[3:]])
        if f"optim.{alias}" not in saved:
            continue  # missing for another reason: DCP names it
        value = template.pop(key)
        renamed = alias not in template
        if renamed:  # this rank holds the head only: read it under the embedding's name
            template[alias] = value
        copies[key] = (alias, renamed)
    return template, copies


def _restore_tied(loaded: dict, copies: dict) -> dict:
    """The loaded optimizer state under this rank's own names again (_read_tied_as undone)."""
    out = dict(loaded)
    for key, (alias, renamed) in copies.items():
        value = out.pop(alias) if renamed else out[alias]
        out[key] = value.clone() if isinstance(value, torch.Tensor) and not renamed else value
    return out


def read_state_dict(path: str | os.PathLike) -> dict:
    """Everything a checkpoint holds as plain CPU values, without a model to load it into:
    {"model": {name: tensor}, "optim": {flattened name: value}, "extra": {...}}."""
    where = _open(path)
    extra = _extra(where)
    metadata = _guarded(where, _SafeReader(where).read_metadata)
    flat = {}  # DCP's flattened keys "model.blocks.0.attn.phi": a template of the right shapes
    for key, md in metadata.state_dict_metadata.items():
        is_tensor = isinstance(md, TensorStorageMetadata)
        flat[key] = torch.empty(md.size, dtype=md.properties.dtype) if is_tensor else None
    with _single_process_quiet():
        _guarded(where, lambda: dcp.load(flat, storage_reader=_SafeReader(where),
                                         planner=_SafeLoadPlanner(flatten_state_dict=False),
                                         no_dist=True))
    state: dict = {"model": {}, "optim": {}, "extra": extra}
    for key, value in flat.items():
        section, _, name = key.partition(".")
        state.setdefault(section, {})[name] = value
    return state


def _first_line(e: BaseException) -> str:
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: each rank's error
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line[:300]


def _guarded(where: Path, fn: Callable):
    """fn(), with every error of reading or fitting the files as one CheckpointError (DCP's
    CheckpointException derives from BaseException: caught by name here)."""
    try:
        return fn()
    except (Exception, CheckpointException) as e:
        if isinstance(e, CheckpointError):
            raise
        line = _first_line(e)
        if any(k in line for k in ("Missing key", "Unexpected key", "Size mismatch", "mismatch")):
            what = "the optimizer state does" if "optim." in line else "the weights do"
            raise CheckpointError(f"checkpoint {where}: {what} not fit the model "
                                  f"({line})") from None
        raise CheckpointError(f"checkpoint {where} cannot be loaded ({line})") from None


# ---------------------------------------------------------------------------------------------
# Reading DCP files without running code from them
# ---------------------------------------------------------------------------------------------

_METADATA_TYPES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _SafeUnpickler(pickle.Unpickler):
    """Builds the DCP metadata types, torch dtypes and paths; refuses every other global."""

    def find_class(self, module: str, name: str):
        if name in _METADATA_TYPES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not a type DCP metadata holds: refusing to load it"
        )


class _SafeReader(FileSystemReader):
    """FileSystemReader whose metadata is read by _SafeUnpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _SafeUnpickler(f).load()
        except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError,
                AttributeError, IndexError, KeyError, MemoryError) as e:
            raise CheckpointError(f"{path} is not valid DCP metadata ({_first_line(e)})"
                                  ) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} is not valid DCP metadata (it holds a "
                                  f"{type(metadata).__name__})")
        _check_storage(path, metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_storage(path: Path, metadata: Metadata) -> None:
    """Every piece the metadata points at lies in a file of this folder: a crafted
    `../ckpt.prev/__0_0.distcp` would load another checkpoint's tensors unchecked."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointError(f"{path} is not valid DCP metadata (no storage table)")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not _plain_name(name) or not all(_count(getattr(info, k, None))
                                            for k in ("offset", "length")):
            raise CheckpointError(f"{path} points outside its checkpoint folder or is "
                                  f"malformed: storage entry {name!r}")


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values load with weights_only=True (DCP's own
    unpickles them in full)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
