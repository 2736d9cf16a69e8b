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
group. `extra` is a small JSON-able dict (step, config, data position) written by rank 0 to
`meta.json`.

Crash safety. The checkpoint is written to `<path>.partial`, and only when every rank has
finished writing is it renamed into place: the previous checkpoint at `<path>` moves to
`<path>.old`, the new one to `<path>`, then `.old` is deleted. A crash at any moment leaves
either `<path>` or `<path>.old` complete, and `load_checkpoint` falls back to `.old`.
On several machines `path` must be on a file system every rank sees.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from .env import barrier, is_rank0

__all__ = ["save_checkpoint", "load_checkpoint", "resolve_checkpoint"]

_FORMAT = "torch_mhc.dcp.v1"
_META = "meta.json"
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


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict | None = None,
) -> Path:
    """Write model (and optimizer) state to the directory `path`; every rank must call it.

    model: the module the training step runs (DDP wrapper, FSDP2 module, a pipeline's
    `Pipeline.module`, or a plain module in a single process). extra: JSON-able metadata.
    Returns the final path. Replaces an existing checkpoint at `path` only once the new one is
    complete.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    tmp, old = _siblings(path)
    meta = {"format": _FORMAT, "extra": extra or {}}
    try:
        meta_text = json.dumps(meta, indent=2, sort_keys=True)
    except TypeError as e:
        raise TypeError(f"save_checkpoint: extra must be JSON-serialisable: {e}") from None

    if is_rank0():
        if tmp.exists():  # left by a save that failed: never a good checkpoint
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()

    optimizers = [optimizer] if optimizer is not None else []
    model_sd, optim_sd = get_state_dict(model, optimizers, options=_OPTIONS)
    state = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    dcp.save(state, checkpoint_id=tmp)  # collective: returns once the metadata is written

    if is_rank0():
        with open(tmp / _META, "w") as f:
            f.write(meta_text)
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
    barrier()
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
    after apply_fsdp). Returns the `extra` dict that was saved.
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
    return meta["extra"]
