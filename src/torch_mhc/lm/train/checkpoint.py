"""The training checkpoint: one format for single-process and distributed runs.

A run writes `out_dir/ckpt/`, a torch_mhc.lm.parallel checkpoint directory (DCP layout: the
tensors in `*.distcp` files, `.metadata`, the run's own state in `extra.pt`, CRC-32 sums of
every file in `meta.json`); the checkpoint it replaces becomes `out_dir/ckpt.prev/`. Any
layout resumes any other: one process, DDP, FSDP2 or a pipeline, at any world size. A save
stopped mid-rotation can leave the newest complete checkpoint at `ckpt.old`: readers try
`ckpt`, `ckpt.old`, `ckpt.prev`, newest first (`CANDIDATES`).

The run's state (`extra.pt`) holds: format, model_config, train_config, step, scheduler, rng
(torch, numpy, python), sampler, spike (the policy's window) and the histories. Loading reads
no pickled code (see torch_mhc.lm.parallel.checkpoint), checks the sums first and the
configuration second, and only then reads tensors. A checkpoint that fails the sums, holds
malformed state or whose tensors cannot be read falls back to the next candidate with a message;
one made for another model is refused. The run then saves with `verified` = the checkpoint it
resumed from, so that the failed newer ones are moved aside (`ckpt.corrupt-<n>`) instead of
the good one being rotated out.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from torch_mhc.lm import parallel as par
from torch_mhc.lm.config import TrainConfig, resolve_device
from torch_mhc.lm.model import LM, ModelConfig
from torch_mhc.lm.parallel.checkpoint import is_complete
from torch_mhc.lm.train.errors import (
    CheckpointError,
    DiskFullError,
    storage_errno,
    storage_problem,
)
from torch_mhc.runtime.files import remove_tree

__all__ = [
    "CANDIDATES",
    "CHECKPOINT_FORMAT",
    "LAST_CHECKPOINT",
    "OLD_CHECKPOINTS",
    "PREVIOUS_CHECKPOINT",
    "check_resumable",
    "find_checkpoint",
    "load_checkpoint",
    "load_model",
    "load_model_with_source",
    "open_for_resume",
    "restore",
    "save_checkpoint",
]

CHECKPOINT_FORMAT = 2  # of the run's state in extra.pt; 2: the DCP layout for every run
LAST_CHECKPOINT = "ckpt"
PREVIOUS_CHECKPOINT = "ckpt.prev"
# where a run folder may hold a complete checkpoint, newest first (ckpt.old: a stopped rotation)
CANDIDATES = (LAST_CHECKPOINT, "ckpt.old", PREVIOUS_CHECKPOINT)
# an earlier version's single-file checkpoints in a run folder: no longer read, named when met
OLD_CHECKPOINTS = ("last.pt", "prev.pt")
_RUN_STATE_KEYS = ("format", "model_config", "train_config", "step")
_RESUME_KEYS = ("sampler", "rng", "history", "spike")


def save_checkpoint(out_dir: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None, state: dict,
                    keep_previous: bool = True, verified: str | os.PathLike | None = None,
                    say=None) -> Path:
    """Write out_dir/ckpt (every rank calls it); the checkpoint it replaces becomes ckpt.prev.

    model: what the step runs (bare, DDP, FSDP2, a pipeline's module). state: the run's own
    plain values and tensors. keep_previous=False: the checkpoints already there belong to
    another run (an overwritten one): both are deleted once the new one is complete, so
    ckpt and ckpt.prev are always of one run. verified: the checkpoint the run resumed from
    or last saved; the newer ones (which failed to load) are moved aside, reported through
    `say`. A write the storage refuses (full disk, quota, file-size limit) is a
    DiskFullError; the previous checkpoint is then untouched and no partial one is left.
    """
    out = Path(out_dir)
    had_one = os.path.lexists(out / LAST_CHECKPOINT)
    try:
        path = par.save_checkpoint(out / LAST_CHECKPOINT, model, optimizer, extra=state,
                                   previous=out / PREVIOUS_CHECKPOINT if keep_previous else None,
                                   verified=verified if keep_previous else None, say=say)
    except BaseException as e:
        code = None if isinstance(e, KeyboardInterrupt) else storage_errno(e)
        if code is None:
            raise
        raise DiskFullError(code, f"{storage_problem(code)} writing the checkpoint "
                            f"{out / LAST_CHECKPOINT}; {_what_is_kept(had_one, keep_previous)}"
                            ) from None
    if not keep_previous and par.is_rank0():
        remove_tree(out / PREVIOUS_CHECKPOINT)
    return path


def _what_is_kept(had_one: bool, keep_previous: bool) -> str:
    if had_one and keep_previous:
        return ("this run's previous checkpoint there is intact (free space, then "
                "mhc train --resume continues from it)")
    if had_one:
        return "the earlier run's checkpoint there is left as it was (free space, then run again)"
    return "this run has no checkpoint yet (free space, then run again)"


def find_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint directory meant by `path`: a checkpoint itself, or a run folder (its
    ckpt). CheckpointError when there is none."""
    path = Path(path).expanduser()
    if path.is_file():
        raise CheckpointError(
            f"{path} is a file; torch-mhc checkpoints are folders (a run's out_dir/"
            f"{LAST_CHECKPOINT}) in the DCP layout, single-file .pt checkpoints are no longer "
            "read")
    for candidate in (path, *(path / name for name in CANDIDATES)):
        if _is_checkpoint(candidate):
            return candidate
    runs = _runs_inside(path)
    old = [name for name in OLD_CHECKPOINTS if (path / name).is_file()]
    hint = (f"; it holds the runs {', '.join(runs)} (a `mhc compare`, `mhc upcycle` or "
            f"`mhc sweep` folder holds one run per kind or cell): pass one of them, e.g. "
            f"{path / runs[0]}" if runs else
            f"; it holds {old[0]}, a single-file checkpoint of an earlier version, which is "
            "no longer read" if old else "")
    raise CheckpointError(f"no checkpoint at {path} (neither a checkpoint folder nor a run "
                          f"folder holding {LAST_CHECKPOINT}/){hint}")


def _runs_inside(path: Path, depth: int = 2) -> list[str]:
    """The run folders (holding a checkpoint) up to `depth` levels below path, as relative
    names (`mhc`, `hc/seed0`): what a user who passed a folder of runs meant."""
    found: list[str] = []
    try:
        children = sorted(c for c in path.iterdir() if c.is_dir())
    except OSError:
        return found
    for child in children:
        if any(_is_checkpoint(child / name) for name in CANDIDATES):
            found.append(child.name)
        elif depth > 1:
            found += [f"{child.name}/{name}" for name in _runs_inside(child, depth - 1)]
    return found


def _is_checkpoint(path: Path) -> bool:
    try:
        par.resolve_checkpoint(path)
    except FileNotFoundError:
        return False
    return True


def open_for_resume(cfg: TrainConfig, say=print, failed: tuple[tuple[Path, str], ...] = ()
                    ) -> tuple[Path, dict]:
    """(checkpoint, its run state) that cfg.resume names, checked to fit cfg, no tensor read.

    resume = True: out_dir's newest checkpoint that reads (`CANDIDATES`), falling back with a
    message through `say` past any missing, corrupt or unreadable one. A path: that
    checkpoint or run folder (a run folder's `ckpt` falls back alike). failed: (checkpoint,
    error) pairs already tried (e.g. whose tensors did not load): skipped, named in the message.
    """
    candidates = _resume_candidates(cfg)
    tried = {Path(p) for p, _ in failed}
    errors = [message for _, message in failed]
    for candidate in candidates:
        if candidate in tried or not is_complete(candidate):
            continue
        try:
            state = read_run_state(candidate)
        except CheckpointError as e:
            errors.append(str(e))
            continue
        if errors:
            say(f"warning: {errors[0]}; resuming from the previous checkpoint {candidate}")
        check_resumable(state, cfg, candidate)
        return candidate, state
    if errors:
        raise CheckpointError(errors[0] + (f" (and its previous: {errors[1]})"
                                           if len(errors) > 1 else ""))
    raise CheckpointError(f"no checkpoint to resume from: {candidates[0]} does not exist")


def saved_train_config(cfg: TrainConfig) -> dict | None:
    """The settings (TrainConfig.to_dict()) of the run cfg.resume would resume: read from the
    checkpoint open_for_resume would try first (of those that read), without a tensor and
    without checking that it fits cfg; None where there is none to read."""
    try:
        candidates = _resume_candidates(cfg)
    except CheckpointError:
        return None
    for candidate in candidates:
        if not is_complete(candidate):
            continue
        try:
            saved = read_run_state(candidate)["train_config"]
        except CheckpointError:
            continue
        return saved if isinstance(saved, dict) else None
    return None


def _resume_candidates(cfg: TrainConfig) -> list[Path]:
    """The checkpoints cfg.resume names, newest first: out_dir's (resume = True), or the one
    given and, for a run folder's ckpt, the older ones beside it."""
    if isinstance(cfg.resume, str):
        return _fallbacks(find_checkpoint(cfg.resume))
    return [Path(cfg.out_dir) / name for name in CANDIDATES]


def _fallbacks(path: Path) -> list[Path]:
    """`path`, then, for a run folder's ckpt, the older checkpoints beside it."""
    if path.name not in CANDIDATES:
        return [path]
    return [path] + [path.with_name(name) for name in CANDIDATES[CANDIDATES.index(path.name) + 1:]]


def read_run_state(path: Path) -> dict:
    """The run's own state in a checkpoint (sums checked, types checked), without reading
    any tensor."""
    state = par.read_extra(path)
    missing = [k for k in _RUN_STATE_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"{path} is not a torch-mhc training checkpoint (no {missing})")
    if state["format"] != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {state['format']!r}, this "
                              f"version reads {CHECKPOINT_FORMAT}")
    step = state["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{path} holds an invalid step {step!r} (an integer >= 0)")
    for key in ("model_config", "train_config", *_RESUME_KEYS):
        if key in state and not isinstance(state[key], dict | list | tuple):
            raise CheckpointError(f"{path} holds an invalid {key!r} state "
                                  f"({type(state[key]).__name__})")
    if not isinstance(state.get("history", {}), dict):
        raise CheckpointError(f"{path} holds an invalid 'history' state")
    return state


def check_resumable(state: dict, cfg: TrainConfig, path: Path) -> None:
    """The checkpoint must hold this model and this data stream."""
    saved = _model_config(state, path).to_dict()
    mine = cfg.model.to_dict()
    diff = [f"{k}: checkpoint {saved[k]!r}, config {mine[k]!r}" for k in mine
            if saved.get(k) != mine[k]]
    if diff:
        raise CheckpointError(
            f"checkpoint {path} was made for another model ({'; '.join(diff)})"
        )
    if state["step"] > cfg.steps:
        raise CheckpointError(
            f"checkpoint {path} is at step {state['step']}, beyond steps = {cfg.steps}"
        )
    for key in _RESUME_KEYS:
        if key not in state:
            raise CheckpointError(f"{path} has no {key!r} state: it cannot be resumed")


def _model_config(state: dict, path: Path) -> ModelConfig:
    try:
        return ModelConfig.from_dict(state["model_config"])
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path} holds an invalid model config: {e}") from None


def restore(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Read the tensors of `path` into model (and optimizer), in place; every rank calls it."""
    par.load_checkpoint(path, model, optimizer)


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Everything a checkpoint holds, for inspection: the run state plus "model" (name ->
    tensor) and "optimizer" (flattened names -> values), on the CPU."""
    path = find_checkpoint(path)
    read_run_state(path)
    full = par.read_state_dict(path)
    return {**full["extra"], "model": full["model"], "optimizer": full["optim"]}


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu", say=print) -> LM:
    """The LM saved in a checkpoint, in eval mode, for generation. A run folder's ckpt falls
    back to its ckpt.old and ckpt.prev (with a message through `say`) when ckpt is damaged."""
    return load_model_with_source(path, device, say)[0]


def load_model_with_source(path: str | os.PathLike, device: str | torch.device = "cpu",
                           say=print) -> tuple[LM, Path, int]:
    """load_model's model, and the checkpoint folder it came from and its step (a fallback's,
    where ckpt was damaged)."""
    device = resolve_device(device) if isinstance(device, str) else device
    path = find_checkpoint(path)
    candidates = [path] + [p for p in _fallbacks(path)[1:] if is_complete(p)]
    for i, candidate in enumerate(candidates):
        try:
            state = read_run_state(candidate)
            model = LM(_model_config(state, candidate))
            restore(candidate, model, None)
            return model.to(device).eval(), candidate, state["step"]
        except CheckpointError as e:
            if i + 1 == len(candidates):
                raise
            say(f"warning: {e}; loading the previous checkpoint {candidates[i + 1]}")
    raise AssertionError("unreachable")
