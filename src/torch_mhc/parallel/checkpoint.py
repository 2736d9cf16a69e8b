"""Distributed checkpoints through torch.distributed.checkpoint (DCP), resumable at any layout.

    save_checkpoint("ckpt/", model, optimizer, extra={"step": 100})   # every rank calls it
    extra = load_checkpoint("ckpt/", model, optimizer)                # every rank calls it

What is saved. `get_state_dict` gives the model and optimizer state keyed by the parameter
names of the plain model (`blocks.3.attn.phi`, ...), whatever wraps it: a DDP prefix is
stripped, FSDP2 shards stay DTensors, pipeline stages already use the plain model's names. The
optimizer state is flattened to the same names (`state.blocks.3.attn.phi.exp_avg`), which is
what lets DCP reshard it. Each rank writes the pieces it owns (DDP's replicated tensors are
written once); on load each rank reads the pieces its layout needs, so a checkpoint saved by
FSDP2 on 2 ranks loads into DDP on 4, into a pipeline, or into one process without any process
group. `extra` is the caller's own small state (step, config, data position, RNG states),
a dict of plain values and tensors written by rank 0 with torch.save to `extra.pt` and read
back with `weights_only=True` (no arbitrary code runs on load). `meta.json`, written last, says
the directory is complete.

Crash safety. The checkpoint is written to `<path>.partial`, and only when every rank has
finished writing is it renamed into place by rank 0: the previous checkpoint at `<path>` moves to
`<path>.old`, the new one to `<path>`, then `.old` is deleted. A crash at any moment leaves
either `<path>` or `<path>.old` complete, and `load_checkpoint` falls back to `.old`.
A failure in rank 0's file operations is sent to every rank and raised there, so no rank is
left waiting in a collective. On several machines `path` must be on a file system every rank
sees.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

__all__ = ["save_checkpoint", "load_checkpoint", "resolve_checkpoint"]

_FORMAT = "torch_mhc.dcp.v1"
_META = "meta.json"  # written last: its presence marks a complete checkpoint
_EXTRA = "extra.pt"
# Flattened optimizer state keys are parameter names, so the state can be resharded across
# layouts (the DCP documentation's recipe for pipeline parallelism).
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _siblings(path: Path) -> tuple[Path, Path]:
    return path.with_name(path.name + ".partial"), path.with_name(path.name + ".old")


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (the directory entry), where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _on_rank0(fn: Callable[[], None]) -> None:
    """Run fn on rank 0 and raise its error on every rank (a plain call in one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        fn()
        return
    error: list[str | None] = [None]
    caught: Exception | None = None
    if dist.get_rank() == 0:
        try:
            fn()
        except Exception as e:  # sent to every rank below, then raised here as it was
            caught, error = e, [f"{type(e).__name__}: {e}"]
    dist.broadcast_object_list(error, src=0)
    if caught is not None:
        raise caught
    if error[0] is not None:
        raise RuntimeError(f"checkpoint I/O failed on rank 0: {error[0]}")


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


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict | None = None,
) -> Path:
    """Write model (and optimizer) state to the directory `path`; every rank must call it.

    model: the module the training step runs (DDP wrapper, FSDP2 module, a pipeline's
    `Pipeline.module`, or a plain module in a single process). extra: the caller's own state,
    plain values and tensors (see the module docstring); rank 0's copy is saved.
    Returns the final path. Replaces an existing checkpoint at `path` only once the new one is
    complete.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    tmp, old = _siblings(path)
    extra_bytes = _serialise_extra(extra)  # every rank checks, so every rank fails alike
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    meta_text = json.dumps({"format": _FORMAT, "saved_by_world_size": world}, indent=2)

    def prepare() -> None:
        if tmp.exists():  # left by a save that failed: never a good checkpoint
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)

    _on_rank0(prepare)

    optimizers = [optimizer] if optimizer is not None else []
    model_sd, optim_sd = get_state_dict(model, optimizers, options=_OPTIONS)
    state = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    dcp.save(state, checkpoint_id=tmp)  # collective: returns once the metadata is written

    def commit() -> None:
        for name, data in ((_EXTRA, extra_bytes), (_META, meta_text.encode())):
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        if path.exists():
            if old.exists():
                shutil.rmtree(old)
            path.rename(old)
        tmp.rename(path)
        _fsync_dir(path.parent)
        if old.exists():
            shutil.rmtree(old)

    _on_rank0(commit)
    return path


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The complete checkpoint directory for `path`: `path` itself, or `<path>.old` when a save
    was interrupted between its two renames. FileNotFoundError if neither is complete."""
    path = Path(path)
    _, old = _siblings(path)
    if (path / _META).is_file():
        return path
    if (old / _META).is_file():
        warnings.warn(
            f"{path} is missing or incomplete; loading the previous checkpoint {old} "
            "(a save was interrupted)",
            stacklevel=2,
        )
        return old
    raise FileNotFoundError(
        f"no complete checkpoint at {path} (no {_META}; neither at {old})"
    )


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict:
    """Load a save_checkpoint directory into model (and optimizer) in place; every rank calls it.

    The layout may differ from the one that saved (world size, DDP / FSDP2 / pipeline / single
    process): DCP reads each rank's pieces. Build the optimizer before loading (for FSDP2,
    after apply_fsdp). Returns the `extra` dict that was saved (tensors on the CPU).
    """
    import torch.distributed.checkpoint as dcp

    where = resolve_checkpoint(path)
    with open(where / _META) as f:
        meta = json.load(f)
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{where} has format {meta.get('format')!r}, expected {_FORMAT!r}")

    optimizers = [optimizer] if optimizer is not None else []
    # The current state is the template: its keys say what to read, its shardings where to.
    model_sd, optim_sd = get_state_dict(model, optimizers, options=_OPTIONS)
    state = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    dcp.load(state, checkpoint_id=where)
    set_state_dict(
        model,
        optimizers,
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
        options=_OPTIONS,
    )
    return torch.load(where / _EXTRA, map_location="cpu", weights_only=True)
