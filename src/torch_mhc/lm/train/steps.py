"""The building blocks of a run: seeding, model, optimizer, one training step, evaluation, gains.

    ctx = StepContext(model, optimizer, SpikeGuard(4.0, 50), device, amp_dtype=None, grad_clip=1.0)
    loss, grad_norm = train_step(ctx, x, y, lr=1e-3, step=1)    # x, y [B, T]

A step checks the loss with the spike policy *before* backward and the gradient norm before
the update, raising `StepRejected` so that nothing bad reaches the weights. In a distributed
run (`ctx.info` set) DDP / FSDP2 ranks train on their slice of the global batch and check the
all-reduced loss, so every rank takes the same decision; a pipeline (`ctx.pipe`) takes the
whole batch in micro-batches.
"""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import dataclass

import numpy as np
import torch

from torch_mhc.connections import param_groups
from torch_mhc.lm import data as _data
from torch_mhc.lm import parallel as par
from torch_mhc.lm.config import TrainConfig
from torch_mhc.lm.model import LM
from torch_mhc.lm.train.schedule import SpikeGuard
from torch_mhc.runtime.diagnostics import GainReport, collect_health

__all__ = [
    "StepContext",
    "StepRejected",
    "autocast",
    "build_model",
    "build_optimizer",
    "evaluate",
    "evaluate_pipeline",
    "forward_loss",
    "measure_gains",
    "rng_state",
    "seed_everything",
    "set_rng_state",
    "train_step",
    "wrap_model",
]


class StepRejected(Exception):
    """The spike policy refused a step (raised before the update); `step` is 1-based."""

    def __init__(self, reason: str, step: int):
        super().__init__(reason)
        self.reason, self.step = reason, step


@dataclass
class StepContext:
    """What every training step uses, fixed for the run."""

    model: torch.nn.Module  # what the step calls: the model, torch.compile'd, DDP or FSDP2
    optimizer: torch.optim.Optimizer
    guard: SpikeGuard
    device: torch.device
    amp_dtype: torch.dtype | None  # bf16 autocast, or None for fp32
    grad_clip: float  # max global gradient norm; 0: measure only
    info: par.DistInfo | None = None  # this rank in a distributed run
    pipe: par.Pipeline | None = None  # parallel = "pp"

    @property
    def max_norm(self) -> float:
        return self.grad_clip if self.grad_clip > 0 else math.inf  # inf: measure, never clip


# ---------------------------------------------------------------------------------------------
# Randomness: seeding, and every RNG's state as tensors and plain values
# ---------------------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy's global RNG and Python's random."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def rng_state() -> dict:
    """Every RNG a run touches, as tensors and plain Python values (torch.load with
    weights_only accepts them, so a checkpoint loads without unpickling arbitrary objects)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------
# Model and optimizer
# ---------------------------------------------------------------------------------------------


def build_model(cfg: TrainConfig, device: torch.device) -> LM:
    """The LM on `device`, its weights drawn from torch's RNG (seed it first)."""
    return LM(cfg.model).to(device)


def wrap_model(model: LM, cfg: TrainConfig) -> torch.nn.Module:
    """What a single-process training step calls: the model itself, or torch.compile of it.
    Checkpoints always save the bare model."""
    return torch.compile(model) if cfg.compile else model


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over param_groups: connection maps and gates, norms and biases without decay."""
    groups = param_groups(model, cfg.weight_decay)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def autocast(device: torch.device, amp_dtype: torch.dtype | None):
    """bf16 autocast context, or a no-op for fp32."""
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=amp_dtype)


def forward_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                 device: torch.device, amp_dtype: torch.dtype | None) -> torch.Tensor:
    """Mean cross-entropy in nats of one batch x, y [B, T] (a scalar tensor with grad)."""
    with autocast(device, amp_dtype):
        _, loss = model(x, y)
    return loss


# ---------------------------------------------------------------------------------------------
# One training step
# ---------------------------------------------------------------------------------------------


def train_step(ctx: StepContext, x: torch.Tensor, y: torch.Tensor, lr: float,
               step: int) -> tuple[float, float]:
    """One update on the global batch x, y [B, T]; returns (loss, gradient norm before
    clipping). Raises StepRejected before touching the weights when the spike policy fails."""
    if ctx.pipe is not None:
        loss_value, norm = _pipeline_backward(ctx, x, y, step)
    else:
        if ctx.info is not None:  # DDP / FSDP2: this rank's slice [B / world, T]
            x, y = par.shard_batch(x, ctx.info), par.shard_batch(y, ctx.info)
        loss = forward_loss(ctx.model, x, y, ctx.device, ctx.amp_dtype)
        # the global batch's loss: every rank sees the same value, takes the same decision
        loss_value = (par.all_reduce_mean(loss.detach()) if ctx.info else loss.detach()).item()
        if (reason := ctx.guard.check_loss(step, loss_value)) is not None:
            raise StepRejected(reason, step)
        loss.backward()
        norm_t = torch.nn.utils.clip_grad_norm_(ctx.model.parameters(), ctx.max_norm)
        if hasattr(norm_t, "full_tensor"):  # FSDP2: a DTensor
            norm_t = norm_t.full_tensor()
        norm = norm_t.item()
    _apply_update(ctx, lr, step, loss_value, norm)
    return loss_value, norm


def _pipeline_backward(ctx: StepContext, x: torch.Tensor, y: torch.Tensor,
                       step: int) -> tuple[float, float]:
    """The pipeline runs forward and backward together: the loss is checked after the
    backward pass, still before the update."""
    loss_value = ctx.pipe.step(x, y).item()  # the global batch's mean loss, on every rank
    if (reason := ctx.guard.check_loss(step, loss_value)) is not None:
        ctx.optimizer.zero_grad(set_to_none=True)
        raise StepRejected(reason, step)
    return loss_value, ctx.pipe.clip_grad_norm_(ctx.max_norm).item()


def _apply_update(ctx: StepContext, lr: float, step: int, loss_value: float,
                  norm: float) -> None:
    """The optimizer step after backward, unless the gradient norm trips the spike policy."""
    if (reason := ctx.guard.check_grad_norm(step, norm)) is not None:
        ctx.optimizer.zero_grad(set_to_none=True)
        raise StepRejected(reason, step)
    for group in ctx.optimizer.param_groups:
        group["lr"] = lr
    ctx.optimizer.step()
    ctx.optimizer.zero_grad(set_to_none=True)
    ctx.guard.accept(loss_value)


# ---------------------------------------------------------------------------------------------
# Measurements: validation loss, Amax gains
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model: torch.nn.Module, val_tokens: np.ndarray, cfg: TrainConfig,
             device: torch.device, amp_dtype: torch.dtype | None) -> float:
    """Mean validation cross-entropy in nats over a fixed set of windows (the same each call)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in _data.val_batches(val_tokens, cfg.batch_size, cfg.seq_len, cfg.eval_batches,
                                  device=device):
        total += forward_loss(model, x, y, device, amp_dtype).item()
        count += 1
    model.train(was_training)
    return total / count


@torch.no_grad()
def evaluate_pipeline(pipe: par.Pipeline, val_tokens: np.ndarray, cfg: TrainConfig,
                      device: torch.device) -> float:
    """evaluate through a pipeline (every rank calls it; fp32, the stages' own dtype)."""
    was_training = pipe.module.training
    pipe.module.eval()
    total, count = 0.0, 0
    for x, y in _data.val_batches(val_tokens, cfg.batch_size, cfg.seq_len, cfg.eval_batches,
                                  device=device):
        total += pipe.eval_loss(x, y).item()
        count += 1
    pipe.module.train(was_training)
    return total / count


@torch.no_grad()
def measure_gains(model: LM, x: torch.Tensor, device: torch.device,
                  amp_dtype: torch.dtype | None) -> GainReport | None:
    """Amax gains and connection health (a diagnostics.HealthReport) of every connection on
    the batch x [b, T]; None for the residual."""
    if model.cfg.connection == "residual":
        return None
    was_training = model.training
    model.eval()
    with collect_health() as collector, autocast(device, amp_dtype):
        model(x)
    model.train(was_training)
    return collector.report()
