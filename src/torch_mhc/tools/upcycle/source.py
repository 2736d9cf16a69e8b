"""The residual run an upcycle starts from, the conversion, and the continuation's first
checkpoint.

Every connection kind at its documented initialisation computes the Pre-Norm residual
network of its blocks (docs/maths.md, "Initialisation"), so copying every weight of a
residual LM into a fresh LM of another kind, and leaving the connections' own parameters as
they were built, gives a model of that kind with the residual's function (`upcycled_model`).

A continuation is an ordinary `mhc train` run folder: its first checkpoint (step 0, written
by `write_start`) holds the converted weights, a fresh AdamW state, the sampler of its seed
and empty histories, so the existing trainer resumes it like any interrupted run and its
checkpoints, lock and resume rules apply unchanged.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from torch_mhc.lm.config import ConfigError, TrainConfig, resolve_device
from torch_mhc.lm.data import BatchSampler
from torch_mhc.lm.model import LM
from torch_mhc.lm.train import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    LRSchedule,
    build_optimizer,
    evaluate,
    load_model,
    save_checkpoint,
    seed_everything,
)
from torch_mhc.lm.train.checkpoint import find_checkpoint, read_run_state
from torch_mhc.lm.train.steps import rng_state

__all__ = ["SourceRun", "fresh_optimizer_state", "read_source", "start_loss", "upcycled_model",
           "write_start"]

HISTORIES = ("loss_history", "grad_norm_history", "lr_history", "val_history", "gain_history")


class SourceRun:
    """A finished residual `mhc train` run: its folder, checkpoint, run state and model."""

    def __init__(self, folder: Path, checkpoint: Path, state: dict, model: LM):
        self.folder, self.checkpoint, self.state, self.model = folder, checkpoint, state, model

    @property
    def train_config(self) -> TrainConfig:
        return TrainConfig.from_dict(self.state["train_config"])

    @property
    def val_loss(self) -> float | None:
        history = self.state.get("history", {}).get("val_history") or []
        return float(history[-1]["val_loss"]) if history else None


def _holds_run(folder: Path) -> bool:
    try:
        find_checkpoint(folder)
    except CheckpointError:
        return False
    return True


def read_source(path: str) -> SourceRun:
    """The run at `path`, checked to be a finished residual run (ConfigError otherwise)."""
    folder = Path(path).expanduser()
    where = f"--from {folder}"
    if not folder.exists():
        raise ConfigError(f"{where}: no such folder (expected a `mhc train` run folder)")
    if not folder.is_dir():
        raise ConfigError(f"{where} is a file, expected the folder of a `mhc train` run")
    try:
        checkpoint = find_checkpoint(folder)
        state = read_run_state(checkpoint)
    except CheckpointError as e:
        if _holds_run(folder / "residual"):  # a comparison's folder: its residual run
            raise ConfigError(f"{where} holds a comparison's runs, not one run: pass its "
                              f"residual run, --from {folder / 'residual'}") from None
        raise ConfigError(f"{where} is not a `mhc train` run: {e}") from None
    connection = state["model_config"].get("connection")
    if connection != "residual":
        raise ConfigError(f"{where} is a {connection} run; upcycling starts from a residual run "
                          "(connection = residual)")
    steps = state["train_config"].get("steps") if isinstance(state["train_config"], dict) else None
    if not isinstance(steps, int) or state["step"] < steps:
        raise ConfigError(f"{where} is unfinished: its checkpoint is at step {state['step']} of "
                          f"{steps} (finish it first: mhc train --resume ...)")
    try:
        model = load_model(checkpoint, "cpu", say=lambda message: None)
    except CheckpointError as e:
        raise ConfigError(f"{where}: {e}") from None
    return SourceRun(folder, checkpoint, state, model)


def upcycled_model(residual: LM, kind: str, streams: int) -> LM:
    """A fresh LM of `kind` with `streams` streams holding every weight of `residual`; its
    connections keep the initialisation they were built with. ValueError for a kind that
    cannot take `streams`."""
    if residual.cfg.connection != "residual":
        raise ValueError(f"upcycled_model converts a residual LM, got a {residual.cfg.connection} "
                         "one")
    model = LM(replace(residual.cfg, connection=kind, streams=streams))
    missing, unexpected = model.load_state_dict(residual.state_dict(), strict=False)
    own = {f"blocks.{i}.{sub}.{name}" for i, block in enumerate(model.blocks)
           for sub in ("attn", "mlp")
           for name, _ in [*getattr(block, sub).named_parameters(recurse=False),
                           *getattr(block, sub).named_buffers(recurse=False)]}
    strays = sorted(set(missing) - own)
    if unexpected or strays:  # the two models must differ in the connections only
        raise RuntimeError(f"converting to {kind}: weights without a counterpart "
                           f"(residual only: {sorted(unexpected)}; {kind} only: {strays})")
    return model


def start_loss(model: LM, cfg: TrainConfig, corpus) -> float:
    """Validation loss of `model` on cfg's fixed validation windows, in fp32."""
    device = resolve_device(cfg.device)
    return evaluate(model.to(device), corpus.val, cfg, device, None)


def fresh_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an unused AdamW the state it would build at its first step (zero moments, step 0)
    without changing a parameter, so that a checkpoint holds it: its first real step is then
    the first step of a fresh optimizer."""
    groups = optimizer.param_groups
    lrs = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = 0.0  # with lr 0 neither the update nor the decoupled weight decay moves p
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(groups, lrs, strict=True):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0


def write_start(cfg: TrainConfig, source: SourceRun, corpus) -> float:
    """Write cfg.out_dir's step-0 checkpoint: the source converted to cfg.model's kind, a
    fresh optimizer, the sampler of cfg.seed. Returns the converted model's validation loss.

    The RNG state saved is the one right after seeding, the same for every kind, so that the
    kinds of one seed differ in their connections only."""
    seed_everything(cfg.seed)
    rng = rng_state()
    model = upcycled_model(source.model, cfg.model.connection, cfg.model.streams)
    loss = start_loss(model, cfg, corpus)
    model.train()
    optimizer = build_optimizer(model, cfg)
    fresh_optimizer_state(optimizer)
    sampler = BatchSampler(corpus.train, cfg.batch_size, cfg.seq_len, cfg.seed)
    state = {
        "format": CHECKPOINT_FORMAT,
        "model_config": cfg.model.to_dict(),
        "train_config": cfg.to_dict(),
        "scheduler": {"step": 0, **LRSchedule(cfg).state_dict()},
        "step": 0,
        "rng": rng,
        "sampler": sampler.state_dict(),
        "spike": {"recent": []},
        "history": {key: [] for key in HISTORIES},
    }
    save_checkpoint(cfg.out_dir, model, optimizer, state, keep_previous=False)
    return loss
