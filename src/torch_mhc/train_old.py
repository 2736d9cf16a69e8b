"""The training loop: one process today, structured for torchrun tomorrow.

    cfg = TrainConfig(model=ModelConfig(residual="mhc", dim=128), steps=500, out_dir="runs/a")
    result = train(cfg)            # TrainResult: losses, val loss / bits per byte, speed, gains

What one run does, in order:
- validate the whole configuration up front (`TrainConfig.validate`, a `ConfigError` naming the
  field), load the corpus (torch_mhc.data: a memory-mapped uint8 array) and check it holds a
  batch, build the model (`build_model`), AdamW over `torch_mhc.param_groups` (connection
  maps and gates exempt from weight decay; `build_optimizer`), the learning-rate schedule
  (`LRSchedule`: linear warmup, then cosine to min_lr or the mHC paper's step decay);
- optionally resume from a checkpoint (`load_checkpoint`): model, optimizer, schedule step,
  RNG states (torch, numpy, python), the batch sampler's state and the histories, so the
  resumed run continues with exactly the losses of a run that never stopped;
- per step (`train_step`): forward under bf16 autocast when asked, a check of the loss by the
  spike policy (`SpikeGuard`) *before* anything is updated, backward, gradient clipping (the
  norm is checked too), AdamW;
- every log_every steps a JSONL line (and TensorBoard when installed), every eval_every steps
  the validation loss (`evaluate`: nats and bits per byte), every gain_every steps the Amax
  gains of HC / mHC on a fixed batch (`measure_gains`), every checkpoint_every steps and at
  the end a checkpoint (`save_checkpoint`: temp file in the same folder, fsync, rename;
  `last.pt` and the one before it, `prev.pt`).

Spike policy: a non-finite loss or gradient norm, or a loss above spike_factor x the mean of
the last spike_window accepted losses, stops the run with `TrainingDiverged` naming the step.
The check runs before the update, so nothing bad reaches the weights and no checkpoint is
written after it: the last good checkpoint on disk stays byte for byte as it was.

Distributed training (`parallel` = "ddp" | "fsdp" | "pp", launched by torchrun) goes
through torch_mhc.parallel: the layout is checked in `TrainConfig.validate` before anything is
built; every rank seeds alike and draws the same global batch, DDP / FSDP2 ranks keep their
slice of it, a pipeline takes all of it (`micro_batches` per step). The spike policy sees the
loss of the global batch (all-reduced), so every rank stops at the same step. Evaluation runs
the same forwards on every rank (FSDP2 needs them); gains are measured for ddp / fsdp and
skipped under pp. Checkpoints are DCP directories (out_dir/ckpt, `parallel.save_checkpoint`)
with the run's own state in their `extra`; they resume at another world size, or in one
process without torchrun. Everything that writes (logs, metrics, the progress bar) runs on
rank 0 only (`is_main_process()`); peak memory and step times are rank 0's.

    torchrun --nproc-per-node 2 -m torch_mhc.cli train --parallel fsdp --batch-size 16 ...
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import math
import os
import random
import re
import resource
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from . import data as _data
from . import parallel as par
from .connections import param_groups
from .diagnostics import GainReport, collect_gains
from .model import LM, ModelConfig

__all__ = [
    "CheckpointError",
    "ConfigError",
    "LRSchedule",
    "SpikeGuard",
    "TrainConfig",
    "TrainResult",
    "TrainingDiverged",
    "atomic_write_bytes",
    "build_model",
    "build_optimizer",
    "evaluate",
    "is_main_process",
    "load_checkpoint",
    "load_model",
    "measure_gains",
    "save_checkpoint",
    "train",
    "train_step",
]

CHECKPOINT_FORMAT = 1
DCP_CHECKPOINT = "ckpt"  # the distributed checkpoint directory inside out_dir
LAST_CHECKPOINT = "last.pt"
PREVIOUS_CHECKPOINT = "prev.pt"
METRICS_FILE = "metrics.jsonl"
STEP_DECAY_AT = (0.8, 0.9)  # fractions of training at which the step schedule decays


# ---------------------------------------------------------------------------------------------
# Errors: every one of them is a message for the user, not a bug
# ---------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A configuration value or input that cannot work; the message names it."""


class CheckpointError(ValueError):
    """A checkpoint that is unreadable, not ours, or made for another model or data."""


class TrainingDiverged(RuntimeError):
    """The spike policy stopped the run. `step` is the step that failed (1-based), `result`
    the TrainResult up to the last good step."""

    def __init__(self, message: str, step: int, result: TrainResult | None = None):
        super().__init__(message)
        self.step, self.result = step, result


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

SCHEDULES = ("cosine", "step")
DTYPES = ("auto", "fp32", "bf16")


@dataclass
class TrainConfig:
    """Everything a run depends on. `model` is the LM's config; the rest is the training's."""

    model: ModelConfig = field(default_factory=ModelConfig)
    # data
    data: str | None = None  # a text file, a folder, a saved HF dataset; None: the stdlib source
    cache_dir: str | None = None  # token cache; None: torch_mhc.data.default_cache_dir()
    val_fraction: float = 0.01  # the last fraction of the bytes is validation
    max_bytes: int | None = None  # keep only the first max_bytes bytes of the corpus
    # optimisation
    batch_size: int = 16
    seq_len: int = 256
    steps: int = 1000
    lr: float = 1e-3
    min_lr: float = 1e-4  # cosine ends here
    warmup: int = 100  # linear warmup steps
    schedule: str = "cosine"  # "cosine" | "step"
    step_decay: float = 0.316  # "step": lr x this at 80% and again at 90% of the steps
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    seed: int = 0
    # measurement
    eval_every: int = 200  # 0: evaluate only at the end
    eval_batches: int = 20
    gain_every: int = 100  # 0: measure the Amax gains only at the start and the end
    gain_batch_size: int = 4  # rows of the fixed validation batch the gains are measured on
    log_every: int = 10
    # output
    out_dir: str | None = None  # None: nothing written (no metrics file, no checkpoints)
    checkpoint_every: int = 0  # 0: a checkpoint only at the end (needs out_dir)
    resume: bool | str = False  # True: out_dir/last.pt; a str: that checkpoint
    overwrite: bool = False  # allow a fresh run in an out_dir that holds a checkpoint
    progress: bool = True  # tqdm bar (shown only on a terminal)
    tensorboard: bool = True  # write out_dir/tb when torch.utils.tensorboard works
    quiet: bool = False  # no log lines on stdout
    # execution
    dtype: str = "auto"  # "fp32" | "bf16" (autocast) | "auto" (see resolve_dtype)
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N" | "mps"
    compile: bool = False  # torch.compile the model for the training steps
    threads: int = 0  # torch.set_num_threads for the process; 0 leaves torch's default
    # parallelism (under torchrun; see torch_mhc.parallel)
    parallel: str = "none"  # "none" | "ddp" | "fsdp" | "pp"
    pp_schedule: str = "1f1b"  # "1f1b" | "dualpipev" (parallel = "pp")
    micro_batches: int = 1  # pipeline micro-batches per step (parallel = "pp"; else 1)
    # spike policy
    spike_factor: float = 4.0  # stop when loss > factor x running mean; 0: off (NaN still stops)
    spike_window: int = 50  # steps in the running mean

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):
            self.model = ModelConfig.from_dict(self.model)

    # --- validation ---------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ConfigError naming the field, what was expected and what came."""
        if not isinstance(self.model, ModelConfig):
            raise ConfigError(f"TrainConfig.model must be a ModelConfig, got {self.model!r}")
        try:
            self.model.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _check_int(self, "batch_size", 1)
        _check_int(self, "seq_len", 1)
        _check_int(self, "steps", 1)
        _check_int(self, "warmup", 0)
        _check_int(self, "seed", 0)
        for name in ("eval_every", "gain_every", "checkpoint_every", "threads"):
            _check_int(self, name, 0)
        for name in ("eval_batches", "gain_batch_size", "log_every", "spike_window"):
            _check_int(self, name, 1)
        if self.max_bytes is not None:
            _check_int(self, "max_bytes", 1)
        _check_number(self, "lr", lo=0.0, lo_open=True)
        _check_number(self, "min_lr", lo=0.0)
        if self.min_lr > self.lr:
            raise ConfigError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        _check_number(self, "step_decay", lo=0.0, hi=1.0, lo_open=True)
        _check_number(self, "beta1", lo=0.0, hi=1.0, hi_open=True)
        _check_number(self, "beta2", lo=0.0, hi=1.0, hi_open=True)
        _check_number(self, "weight_decay", lo=0.0)
        _check_number(self, "grad_clip", lo=0.0)
        _check_number(self, "spike_factor", lo=0.0)
        if 0.0 < self.spike_factor <= 1.0:
            raise ConfigError(
                f"spike_factor must be 0 (off) or > 1 (a loss that many times the running "
                f"mean stops the run), got {self.spike_factor}"
            )
        _check_number(self, "val_fraction", lo=0.0, hi=1.0, lo_open=True, hi_open=True)
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("overwrite", "progress", "tensorboard", "quiet", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.resume, bool | str) or self.resume == "":
            raise ConfigError(
                f"resume must be true/false or a checkpoint path, got {self.resume!r}"
            )
        if self.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"seq_len {self.seq_len} is longer than the model allows: max_seq_len is "
                f"{self.model.max_seq_len} (raise max_seq_len or lower seq_len)"
            )
        if self.model.vocab_size < _data.VOCAB_SIZE:
            raise ConfigError(
                f"the corpora are byte-level: vocab_size must be >= {_data.VOCAB_SIZE}, got "
                f"{self.model.vocab_size}"
            )
        if self.data is not None and (not isinstance(self.data, str) or not self.data.strip()):
            raise ConfigError(f"data must be a path (or unset for the stdlib), got {self.data!r}")
        if self.out_dir is not None:
            if not isinstance(self.out_dir, str) or not self.out_dir.strip():
                raise ConfigError(f"out_dir must be a folder path, got {self.out_dir!r}")
            if Path(self.out_dir).exists() and not Path(self.out_dir).is_dir():
                raise ConfigError(f"out_dir {self.out_dir} exists and is not a folder")
        elif self.resume is True:
            raise ConfigError("resume = true resumes out_dir/last.pt: set out_dir too")
        try:
            device = resolve_device(self.device)
            resolve_dtype(self.dtype, device)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self._validate_parallel()

    def _validate_parallel(self) -> None:
        """The parallel fields, and the layout for the world size torchrun announces."""
        if self.parallel not in par.PARALLEL_MODES:
            raise ConfigError(
                f"parallel must be one of {par.PARALLEL_MODES}, got {self.parallel!r}"
            )
        if self.pp_schedule not in par.SCHEDULES:
            raise ConfigError(f"pp_schedule must be one of {par.SCHEDULES}, got "
                              f"{self.pp_schedule!r}")
        _check_int(self, "micro_batches", 1)
        if self.parallel != "pp" and self.micro_batches != 1:
            raise ConfigError(
                f"micro_batches is the pipeline's (parallel = 'pp'); gradient accumulation is "
                f"not implemented, so with parallel = {self.parallel!r} it must be 1, got "
                f"{self.micro_batches}"
            )
        if self.parallel != "none":
            if "WORLD_SIZE" not in os.environ:
                raise ConfigError(
                    f"parallel = {self.parallel!r} runs under torchrun: torchrun "
                    f"--nproc-per-node N -m torch_mhc.cli train --parallel {self.parallel} ..."
                )
            if self.compile:
                raise ConfigError("compile is supported with parallel = 'none' only")
        try:
            world = int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            raise ConfigError(
                f"WORLD_SIZE must be an integer, got {os.environ['WORLD_SIZE']!r}"
            ) from None
        try:
            par.validate_layout(world, self.parallel, self.model.n_layers, self.batch_size,
                                micro_batches=self.micro_batches, schedule=self.pp_schedule)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    # --- (de)serialisation --------------------------------------------------------------

    def to_dict(self) -> dict:
        """Plain, JSON-able dict; `model` is a nested dict."""
        d = asdict(self)
        d["model"] = self.model.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """From a dict of TrainConfig fields, where the model's fields may be given either in a
        nested "model" dict or at the top level. Unknown keys are a ConfigError naming them."""
        return cls().updated(d)

    def updated(self, overrides: dict) -> TrainConfig:
        """A copy with `overrides` applied (the same key rules as from_dict)."""
        train_names = {f.name for f in fields(TrainConfig)} - {"model"}
        model_names = {f.name for f in fields(ModelConfig)}
        train_kw, model_kw = {}, {}
        for key, value in overrides.items():
            if key == "model":
                if not isinstance(value, dict):
                    raise ConfigError(f"'model' must be a table of model fields, got {value!r}")
                for mkey, mvalue in value.items():
                    if mkey not in model_names:
                        raise ConfigError(
                            f"unknown model config key {mkey!r}; known: {sorted(model_names)}"
                        )
                    if mkey in overrides:
                        raise ConfigError(f"{mkey!r} is given both at the top level and in model")
                    model_kw[mkey] = mvalue
            elif key in model_names:
                model_kw[key] = value
            elif key in train_names:
                train_kw[key] = value
            else:
                raise ConfigError(
                    f"unknown config key {key!r}; known: {sorted(train_names | model_names)}"
                )
        # dataclasses.replace re-runs ModelConfig.__post_init__ (its validation) on the copy
        try:
            model = replace(self.model, **model_kw)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        except TypeError as e:  # a value of a type the comparison in validate cannot take
            raise ConfigError(f"bad model config value: {e}") from None
        return replace(self, model=model, **train_kw)


def _check_int(cfg, name: str, lo: int) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{name} must be an integer >= {lo}, got {value!r}")


def _check_number(cfg, name: str, lo: float | None = None, hi: float | None = None,
                  lo_open: bool = False, hi_open: bool = False) -> None:
    value = getattr(cfg, name)
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
        lo_s = "" if lo is None else f"{'>' if lo_open else '>='} {lo}"
        hi_s = "" if hi is None else f"{'<' if hi_open else '<='} {hi}"
        rule = " and ".join(s for s in (lo_s, hi_s) if s)
        raise ConfigError(f"{name} must be a number {rule}, got {value!r}")


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda when available, else cpu; anything else must name an available device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be auto, cpu, cuda, cuda:N or mps, got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here")
    if device.type == "cuda" and device.index is not None:
        if device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {name!r} asked for, but there are {torch.cuda.device_count()} GPUs"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {name!r} asked for, but MPS is not available here")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device must be auto, cpu, cuda, cuda:N or mps, got {name!r}")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for a dtype setting, or None for plain fp32.

    "auto": bf16 autocast on a GPU that supports bf16; fp32 on the CPU, where bf16 autocast
    measured no faster for this library's model sizes on the 2-core AVX-512-BF16 machine it
    was tuned on (see the README) and fp32 keeps runs exactly reproducible across machines.
    """
    if name == "fp32":
        return None
    if name == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError("dtype bf16 asked for, but this GPU does not support bfloat16")
        if device.type == "mps":
            raise ValueError("dtype bf16 autocast is not supported on MPS here; use fp32")
        return torch.bfloat16
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return None
    raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")


# ---------------------------------------------------------------------------------------------
# Learning-rate schedule and the spike policy
# ---------------------------------------------------------------------------------------------


class LRSchedule:
    """lr(step) for step = updates done so far (0-based): a pure function of the step.

    Warmup: lr * (step + 1) / warmup for step < warmup. Then
    - "cosine": min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2, p from 0 to 1 over the rest;
    - "step" (the mHC paper's schedule): lr until 80% of the steps, lr * step_decay until
      90%, lr * step_decay^2 after (0.316^2 ~ 0.1).
    Having no state of its own, the schedule is restored by restoring the step.
    """

    def __init__(self, cfg: TrainConfig):
        self.lr, self.min_lr, self.warmup = cfg.lr, cfg.min_lr, cfg.warmup
        self.steps, self.kind, self.decay = cfg.steps, cfg.schedule, cfg.step_decay

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.kind == "step":
            drops = sum(step >= frac * self.steps for frac in STEP_DECAY_AT)
            return self.lr * self.decay**drops
        span = max(1, self.steps - self.warmup)
        p = min(1.0, (step - self.warmup) / span)
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))

    def state_dict(self) -> dict:
        return {"lr": self.lr, "min_lr": self.min_lr, "warmup": self.warmup,
                "steps": self.steps, "kind": self.kind, "decay": self.decay}


class SpikeGuard:
    """Stops the run on a non-finite loss or gradient norm, or a loss spike.

    A spike is a loss above factor x the mean of the last `window` accepted losses (checked
    once at least one loss was accepted; factor 0 turns spike checks off).
    """

    def __init__(self, factor: float, window: int):
        self.factor = factor
        self.recent: deque[float] = deque(maxlen=window)

    def check_loss(self, step: int, loss: float) -> str | None:
        """None if the loss may be used, else the reason it may not."""
        if not math.isfinite(loss):
            return f"the training loss is {loss} (not finite) at step {step}"
        if self.factor > 0 and self.recent:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.factor * mean:
                return (
                    f"loss spike at step {step}: loss {loss:.4f} > {self.factor:g} x the running "
                    f"mean {mean:.4f} of the last {len(self.recent)} steps"
                )
        return None

    @staticmethod
    def check_grad_norm(step: int, norm: float) -> str | None:
        if not math.isfinite(norm):
            return f"the gradient norm is {norm} (not finite) at step {step}"
        return None

    def accept(self, loss: float) -> None:
        self.recent.append(loss)

    def state_dict(self) -> dict:
        return {"recent": list(self.recent)}

    def load_state_dict(self, state: dict) -> None:
        self.recent.clear()
        self.recent.extend(float(v) for v in state["recent"])


# ---------------------------------------------------------------------------------------------
# Building blocks of a run: process, model, optimizer, one step, evaluation, gains
# ---------------------------------------------------------------------------------------------


def is_main_process() -> bool:
    """True on rank 0 of a torch.distributed job, and in a single process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return True


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy's global RNG and Python's random."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def build_model(cfg: TrainConfig, device: torch.device) -> LM:
    """The LM on `device`, its weights drawn from torch's RNG (seed it first)."""
    return LM(cfg.model).to(device)


def wrap_model(model: LM, cfg: TrainConfig) -> torch.nn.Module:
    """What the training step calls: the model itself, or torch.compile of it.

    The place where a DDP / FSDP wrapper will go; checkpoints always save the bare model.
    """
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


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor, lr: float, cfg: TrainConfig, guard: SpikeGuard, step: int,
               device: torch.device, amp_dtype: torch.dtype | None) -> tuple[float, float]:
    """One update; returns (loss, gradient norm before clipping).

    Raises _Stop (caught by train) before touching the weights when the loss or the gradient
    norm fails the spike policy.
    """
    loss = forward_loss(model, x, y, device, amp_dtype)
    loss_value = loss.item()
    if (reason := guard.check_loss(step, loss_value)) is not None:
        raise _Stop(reason, step)
    loss.backward()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf  # inf: measure, never clip
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    _apply_update(optimizer, lr, guard, step, loss_value, norm)
    return loss_value, norm


def _apply_update(optimizer: torch.optim.Optimizer, lr: float, guard: SpikeGuard, step: int,
                  loss_value: float, norm: float) -> None:
    """The optimizer step after backward, unless the gradient norm trips the spike policy."""
    if (reason := guard.check_grad_norm(step, norm)) is not None:
        optimizer.zero_grad(set_to_none=True)
        raise _Stop(reason, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    guard.accept(loss_value)


def train_step_parallel(model: torch.nn.Module, pipe: par.Pipeline | None, info: par.DistInfo,
                        optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                        lr: float, cfg: TrainConfig, guard: SpikeGuard, step: int,
                        amp_dtype: torch.dtype | None) -> tuple[float, float]:
    """train_step on every rank of a distributed run; x, y [B, T]: the global batch.

    DDP / FSDP2: this rank's slice of the batch; the spike policy checks the mean loss over
    the ranks (the global batch's loss), so every rank takes the same decision and none is
    left waiting in a collective. Pipeline: the schedule runs forward and backward together,
    so the loss is checked after the backward pass, still before the update.
    """
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    if pipe is None:
        xs, ys = par.shard_batch(x, info), par.shard_batch(y, info)  # [B / world, T]
        loss = forward_loss(model, xs, ys, info.device, amp_dtype)
        loss_value = par.all_reduce_mean(loss.detach()).item()
        if (reason := guard.check_loss(step, loss_value)) is not None:
            raise _Stop(reason, step)
        loss.backward()
        norm_t = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if hasattr(norm_t, "full_tensor"):  # FSDP2: a DTensor
            norm_t = norm_t.full_tensor()
        norm = norm_t.item()
    else:
        loss_value = pipe.step(x, y).item()  # the global batch's mean loss, on every rank
        if (reason := guard.check_loss(step, loss_value)) is not None:
            optimizer.zero_grad(set_to_none=True)
            raise _Stop(reason, step)
        norm = pipe.clip_grad_norm_(max_norm).item()
    _apply_update(optimizer, lr, guard, step, loss_value, norm)
    return loss_value, norm


class _Stop(Exception):
    def __init__(self, reason: str, step: int):
        super().__init__(reason)
        self.reason, self.step = reason, step


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
    """Amax gains of every connection's H_res on the batch x [b, T]; None for the residual."""
    if model.cfg.residual == "residual":
        return None
    was_training = model.training
    model.eval()
    with collect_gains() as collector, autocast(device, amp_dtype):
        model(x)
    model.train(was_training)
    return collector.report()


# ---------------------------------------------------------------------------------------------
# Files: atomic writes, checkpoints, metrics
# ---------------------------------------------------------------------------------------------


def atomic_write_bytes(path: str | os.PathLike, data: bytes | Callable) -> None:
    """Write `path` so that it is either its old content or the complete new one.

    data: the bytes, or a function that writes to a binary file object. The temp file lives
    in the same folder (os.replace is atomic only within one file system) and is fsynced
    before the rename; on any error it is removed and `path` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        _usual_permissions(fd)
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _usual_permissions(fd: int) -> None:
    """mkstemp creates files readable by their owner only; give the file the permissions a
    plain open() would (0o666 minus the umask), since it replaces an ordinary file."""
    umask = os.umask(0)
    os.umask(umask)
    with contextlib.suppress(OSError, AttributeError):  # fchmod: not on every platform
        os.fchmod(fd, 0o666 & ~umask)


def _rng_state() -> dict:
    """Every RNG a run touches, as tensors and plain Python values (torch.load weights_only
    accepts them, so a checkpoint is loaded without unpickling arbitrary objects)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: str | os.PathLike, state: dict) -> Path:
    """Write state to out_dir/last.pt atomically; the checkpoint it replaces becomes prev.pt.

    Order: the new file is complete and fsynced under a temp name, then last.pt -> prev.pt,
    then temp -> last.pt. A crash leaves at least one complete checkpoint, and load_checkpoint
    falls back to prev.pt when last.pt is missing.
    """
    out = Path(out_dir)
    last, prev = out / LAST_CHECKPOINT, out / PREVIOUS_CHECKPOINT
    out.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{LAST_CHECKPOINT}.", suffix=".tmp")
    try:
        _usual_permissions(fd)
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        if last.exists():
            os.replace(last, prev)
        os.replace(tmp, last)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return last


def resolve_checkpoint_path(cfg: TrainConfig) -> Path:
    """The checkpoint `cfg.resume` points at: a file (out_dir/last.pt, or prev.pt if only that
    exists) or a distributed checkpoint directory (out_dir/ckpt, or one named by resume).

    A distributed run (parallel != "none") looks for out_dir/ckpt first; a single process for
    last.pt first, then out_dir/ckpt (a run saved by torchrun, resumed without it)."""
    if isinstance(cfg.resume, str):
        path = Path(cfg.resume).expanduser()
        if path.is_dir() and not _is_dcp(path):
            path = path / LAST_CHECKPOINT
            if not path.exists() and _is_dcp(path.parent / DCP_CHECKPOINT):
                path = path.parent / DCP_CHECKPOINT
    else:
        out = Path(cfg.out_dir)
        candidates = [out / LAST_CHECKPOINT, out / PREVIOUS_CHECKPOINT]
        if cfg.parallel != "none":
            candidates = [out / DCP_CHECKPOINT, *candidates]
        else:
            candidates.append(out / DCP_CHECKPOINT)
        path = next((c for c in candidates if c.is_file() or _is_dcp(c)), candidates[0])
    if _is_dcp(path):
        return path
    if not path.is_file():
        raise CheckpointError(f"no checkpoint to resume from: {path} does not exist")
    return path


def _is_dcp(path: Path) -> bool:
    """A complete parallel.save_checkpoint directory (or its interrupted-save fallback)."""
    try:
        par.resolve_checkpoint(path)
    except FileNotFoundError:
        return False
    return True


def _load_dcp(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              cfg: TrainConfig) -> dict:
    """Load a distributed checkpoint into model and optimizer in place (any layout, also one
    process without a process group); return its extra state, checked like a checkpoint file."""
    try:
        state = par.load_checkpoint(path, model, optimizer)
    except Exception as e:  # DCP: missing keys, shape mismatches, unreadable files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"distributed checkpoint {path} does not fit this run ({first[:300]})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a torch-mhc training checkpoint")
    _check_resumable({**state, "optimizer": "loaded by DCP"}, cfg, path)
    return state


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict:
    """Read and sanity-check a checkpoint written by save_checkpoint.

    weights_only loading: a checkpoint holds tensors and plain values only, so nothing in it
    can run code. Raises CheckpointError for a missing, corrupt or foreign file.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a file")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # zip, pickle, EOF and runtime errors all mean the same here
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a torch checkpoint ({first[:200]})"
        ) from None
    needed = {"format", "model", "model_config", "train_config", "step"}
    if not isinstance(state, dict) or not needed <= set(state):
        raise CheckpointError(f"{path} is not a torch-mhc training checkpoint")
    if state["format"] != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{path} has checkpoint format {state['format']}, this version reads "
            f"{CHECKPOINT_FORMAT}"
        )
    return state


def _model_from_state(state: dict, path: Path, device: torch.device) -> LM:
    try:
        model_cfg = ModelConfig.from_dict(state["model_config"])
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path} holds an invalid model config: {e}") from None
    model = LM(model_cfg)
    _load_weights(model, state["model"], path)
    return model.to(device)


def _load_weights(model: LM, weights: dict, path: Path) -> None:
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        detail = " ".join(line.strip() for line in first[:3])[:300]
        raise CheckpointError(f"{path}: the weights do not fit the model ({detail})") from None


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu") -> LM:
    """The LM saved in a checkpoint, in eval mode, for generation or evaluation."""
    device = resolve_device(device) if isinstance(device, str) else device
    state = load_checkpoint(path, map_location=device)
    return _model_from_state(state, Path(path), device).eval()


class _MetricsLog:
    """JSONL lines in out_dir/metrics.jsonl and, when available, TensorBoard scalars."""

    def __init__(self, cfg: TrainConfig, start_step: int):
        self.file = None
        self.tb = None
        if cfg.out_dir is None or not is_main_process():
            return
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        path = Path(cfg.out_dir) / METRICS_FILE
        if start_step > 0 and path.exists():
            # drop what an interrupted run logged after the checkpoint it resumes from, so the
            # file reads as one uninterrupted run
            kept = [line for line in path.read_text().splitlines(keepends=True)
                    if line.strip() and json.loads(line).get("step", 0) <= start_step]
            atomic_write_bytes(path, "".join(kept).encode())
        elif path.exists():
            atomic_write_bytes(path, b"")  # a fresh run (overwrite=True) starts a fresh log
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard not installed: JSONL only
                SummaryWriter = None
            if SummaryWriter is not None:
                self.tb = SummaryWriter(log_dir=str(Path(cfg.out_dir) / "tb"),
                                        purge_step=start_step if start_step else None)

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key not in ("step", "kind") and isinstance(value, int | float):
                    self.tb.add_scalar(f"{record.get('kind', 'train')}/{key}", value, step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


class _PeakMemory:
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


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    """What a run measured. Losses in nats per byte; times in seconds."""

    config: dict
    steps: int  # optimizer steps completed
    final_loss: float  # mean training loss over the last min(20, steps) steps
    val_loss: float
    val_bpb: float
    tokens_per_s: float  # tokens / time of the training steps (no eval, gains, checkpoints)
    step_time_median_s: float  # robust to other processes' interference, unlike the mean
    peak_mem_bytes: int
    peak_mem_kind: str
    params: int
    connection_params: int
    amp_dtype: str  # "fp32" or "bf16"
    device: str
    elapsed_s: float
    loss_history: list[float] = field(default_factory=list)  # one per step, step 1 first
    grad_norm_history: list[float] = field(default_factory=list)
    lr_history: list[float] = field(default_factory=list)
    val_history: list[dict] = field(default_factory=list)  # {"step", "val_loss", "val_bpb"}
    gain_history: list[dict] = field(default_factory=list)  # {"step", **GainReport.to_dict()}
    diverged: str | None = None  # the spike policy's message, if it stopped the run
    checkpoint: str | None = None  # the last checkpoint written

    @property
    def final_gains(self) -> dict | None:
        return self.gain_history[-1] if self.gain_history else None

    @property
    def max_composite_gain_fwd(self) -> float:
        """Worst token, worst depth, worst measurement over the run (nan for the residual)."""
        return max((g["max_composite_fwd"] for g in self.gain_history), default=math.nan)

    @property
    def max_composite_gain_bwd(self) -> float:
        return max((g["max_composite_bwd"] for g in self.gain_history), default=math.nan)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["max_composite_gain_fwd"] = self.max_composite_gain_fwd
        d["max_composite_gain_bwd"] = self.max_composite_gain_bwd
        return d


_HISTORIES = ("loss_history", "grad_norm_history", "lr_history", "val_history", "gain_history")


class _Printer:
    """Log lines on rank 0 only; through tqdm.write while a bar is shown."""

    def __init__(self, cfg: TrainConfig):
        self.enabled = is_main_process() and not cfg.quiet
        self.bar = None

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None and not self.bar.disable:
            self.bar.write(message)
        else:
            print(message, flush=True)


def load_training_corpus(cfg: TrainConfig) -> _data.Corpus:
    """The corpus, checked to hold a training batch and a validation batch."""
    try:
        corpus = _data.load_corpus(cfg.data, cache_dir=cfg.cache_dir,
                                   val_fraction=cfg.val_fraction, max_bytes=cfg.max_bytes)
    except (OSError, ValueError, ImportError) as e:  # missing, empty, not text, no `datasets`
        raise ConfigError(str(e)) from None
    where = cfg.data if cfg.data is not None else "the standard library corpus"
    need = cfg.seq_len + 1
    if len(corpus.train) < need:
        raise ConfigError(
            f"corpus shorter than one batch: {where} has {len(corpus.train)} training bytes, a "
            f"sequence needs seq_len + 1 = {need} (use a bigger corpus or a smaller seq_len)"
        )
    if len(corpus.val) < need:
        raise ConfigError(
            f"validation split too short: {where} has {len(corpus.val)} validation bytes "
            f"(val_fraction {cfg.val_fraction}), a sequence needs seq_len + 1 = {need}"
        )
    return corpus


def _check_out_dir(cfg: TrainConfig) -> None:
    """Refuse to start a fresh run over a checkpoint (unless overwrite)."""
    if cfg.out_dir is None or cfg.resume is not False or cfg.overwrite:
        return
    for name in (LAST_CHECKPOINT, PREVIOUS_CHECKPOINT, DCP_CHECKPOINT):
        if (Path(cfg.out_dir) / name).exists():
            raise ConfigError(
                f"{Path(cfg.out_dir) / name} exists: pass resume to continue that run, or "
                "overwrite to start a new one in its place, or choose another out_dir"
            )


def _check_resumable(state: dict, cfg: TrainConfig, path: Path) -> None:
    """The checkpoint must hold this model and this data stream."""
    try:
        saved = ModelConfig.from_dict(state["model_config"]).to_dict()
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path} holds an invalid model config: {e}") from None
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
    for key in ("optimizer", "sampler", "rng", "history", "spike"):
        if key not in state:
            raise CheckpointError(f"{path} has no {key!r} state: it cannot be resumed")


def train(cfg: TrainConfig, corpus: _data.Corpus | None = None) -> TrainResult:
    """Run the training `cfg` describes; see the module docstring.

    corpus: an already loaded corpus (compare passes one to three runs); by default the one
    cfg.data names. Raises ConfigError / CheckpointError for bad input before anything is
    written, and TrainingDiverged (with .result) when the spike policy stops the run.
    """
    t_start = time.perf_counter()
    cfg.validate()
    _check_out_dir(cfg)
    if cfg.parallel == "none":
        return _train(cfg, corpus, None, t_start)
    # "cuda" / "auto": cuda:LOCAL_RANK when there is a GPU; "cpu": gloo on the CPU
    info = par.init_distributed(device="cpu" if cfg.device == "cpu" else None)
    try:
        result = _train(cfg, corpus, info, t_start)
    except TrainingDiverged:  # raised on every rank at the same step (all-reduced loss)
        par.destroy_distributed()
        raise
    # also avoids torch 2.13's abort at exit after DCP saves (see destroy_distributed)
    par.destroy_distributed()
    return result


def _train(cfg: TrainConfig, corpus: _data.Corpus | None, info: par.DistInfo | None,
           t_start: float) -> TrainResult:
    """The run of `train`; info: this rank's DistInfo, or None for a single process."""
    device = resolve_device(cfg.device) if info is None else info.device
    amp_dtype = resolve_dtype(cfg.dtype, device)

    resume_state, resume_path, resume_dcp = None, None, False
    if cfg.resume is not False:
        resume_path = resolve_checkpoint_path(cfg)
        resume_dcp = resume_path.is_dir()
        if not resume_dcp:
            if info is not None:
                raise CheckpointError(
                    f"{resume_path} is a single-process checkpoint; a distributed run resumes "
                    f"from a distributed checkpoint directory (out_dir/{DCP_CHECKPOINT})"
                )
            resume_state = load_checkpoint(resume_path, map_location="cpu")
            _check_resumable(resume_state, cfg, resume_path)
    if corpus is None:
        # rank 0 builds the token cache, the others read it once it is complete
        if is_main_process():
            corpus = load_training_corpus(cfg)
        par.barrier()
        if corpus is None:
            corpus = load_training_corpus(cfg)

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    memory = _PeakMemory(device)  # from here: the model, optimizer state and activations
    seed_everything(cfg.seed)
    model = build_model(cfg, device)
    model.train()
    n_params, n_conn_params = model.num_params(), model.connection_params()
    pipe = None
    if cfg.parallel == "ddp":
        step_model = par.wrap_ddp(model, info)
    elif cfg.parallel == "fsdp":
        step_model = model = par.apply_fsdp(model, info)
    elif cfg.parallel == "pp":
        pipe = par.build_pipeline(cfg.model, model, info, cfg.pp_schedule,
                                  n_microbatches=cfg.micro_batches)
        step_model = model = pipe.module  # this rank's stages, under the LM's names
    else:
        step_model = wrap_model(model, cfg)
    optimizer = build_optimizer(step_model if pipe is None else pipe.module, cfg)
    schedule = LRSchedule(cfg)
    guard = SpikeGuard(cfg.spike_factor, cfg.spike_window)
    try:
        sampler = _data.BatchSampler(corpus.train, cfg.batch_size, cfg.seq_len, cfg.seed,
                                     device=device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    # the fixed batch the gains are measured on: the first validation windows
    gain_x, _ = next(_data.val_batches(corpus.val, cfg.gain_batch_size, cfg.seq_len, 1,
                                       device=device))

    result = TrainResult(
        config=cfg.to_dict(), steps=0, final_loss=math.nan, val_loss=math.nan,
        val_bpb=math.nan, tokens_per_s=math.nan, step_time_median_s=math.nan,
        peak_mem_bytes=0, peak_mem_kind="", params=n_params,
        connection_params=n_conn_params,
        amp_dtype="bf16" if amp_dtype is not None else "fp32", device=str(device),
        elapsed_s=0.0,
    )
    start_step = 0
    if resume_dcp:  # every rank reads its pieces; the run's own state is the extra
        resume_state = _load_dcp(resume_path, step_model, optimizer, cfg)
    if resume_state is not None:
        if not resume_dcp:
            _load_weights(model, resume_state["model"], resume_path)
        try:
            if not resume_dcp:
                optimizer.load_state_dict(resume_state["optimizer"])
            sampler.load_state_dict(resume_state["sampler"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {resume_path} does not fit this run: {e}") from None
        guard.load_state_dict(resume_state["spike"])
        _set_rng_state(resume_state["rng"])
        for key in _HISTORIES:
            setattr(result, key, list(resume_state["history"].get(key, [])))
        if result.val_history:
            result.val_loss = result.val_history[-1]["val_loss"]
            result.val_bpb = result.val_history[-1]["val_bpb"]
        start_step = int(resume_state["step"])
        result.steps = start_step
        result.checkpoint = str(resume_path)

    printer = _Printer(cfg)
    metrics = _MetricsLog(cfg, start_step)
    step_times: list[float] = []
    layout = "" if info is None else (
        f", parallel {cfg.parallel} on {info.world_size} processes"
        + (f" ({cfg.pp_schedule}, {cfg.micro_batches} micro-batches)" if pipe else ""))
    printer(
        f"training {cfg.model.residual} (n={cfg.model.n_streams}): {result.params:,} parameters "
        f"({result.connection_params:,} in connections), {cfg.steps} steps of "
        f"{cfg.batch_size}x{cfg.seq_len} tokens, {result.amp_dtype} on {device}{layout}; "
        f"data: {corpus.source_description}"
        + (f"; resuming {resume_path} at step {start_step}" if start_step else "")
    )
    if pipe is not None and cfg.model.residual != "residual":
        printer("gains are not measured under parallel = 'pp' (no stage sees every block)")

    def record_eval(step: int) -> None:
        if pipe is not None:
            val = evaluate_pipeline(pipe, corpus.val, cfg, device)
        else:  # every rank runs the same forwards (FSDP2 gathers parameters collectively)
            val = evaluate(step_model, corpus.val, cfg, device, amp_dtype)
        entry = {"step": step, "val_loss": val, "val_bpb": _data.bits_per_byte(val)}
        result.val_history.append(entry)
        result.val_loss, result.val_bpb = entry["val_loss"], entry["val_bpb"]
        metrics.write({"kind": "eval", **entry})
        printer(f"step {step}: val loss {val:.4f} nats, {entry['val_bpb']:.4f} bits/byte")

    def record_gains(step: int) -> None:
        if pipe is not None:
            return
        report = measure_gains(model, gain_x, device, amp_dtype)
        if report is None:
            return
        entry = {"step": step, **report.to_dict()}
        result.gain_history.append(entry)
        metrics.write({"kind": "gain", "step": step,
                       "max_composite_fwd": report.max_composite_fwd,
                       "max_composite_bwd": report.max_composite_bwd,
                       "composite_fwd": report.composite_fwd,
                       "composite_bwd": report.composite_bwd})

    def checkpoint(step: int) -> None:
        if cfg.out_dir is None or (info is None and not is_main_process()):
            return
        state = {
            "format": CHECKPOINT_FORMAT,
            "model_config": cfg.model.to_dict(),
            "train_config": cfg.to_dict(),
            "scheduler": {"step": step, **schedule.state_dict()},
            "step": step,
            "rng": _rng_state(),
            "sampler": sampler.state_dict(),
            "spike": guard.state_dict(),
            "history": {key: getattr(result, key) for key in _HISTORIES},
        }
        if info is not None:  # every rank writes its pieces; rank 0's state is the extra
            path = par.save_checkpoint(Path(cfg.out_dir) / DCP_CHECKPOINT, step_model,
                                       optimizer, extra=state)
            result.checkpoint = str(path)
            return
        state["model"] = model.state_dict()
        state["optimizer"] = optimizer.state_dict()
        result.checkpoint = str(save_checkpoint(cfg.out_dir, state))

    if start_step == 0:
        record_gains(0)  # at initialisation: every HC / mHC starts as the residual network
    bar = tqdm(total=cfg.steps, initial=start_step, desc=cfg.model.residual, unit="step",
               disable=None if (cfg.progress and is_main_process()) else True,
               dynamic_ncols=True, leave=False)
    printer.bar = bar
    window_tokens, window_time = 0, 0.0
    try:
        for step in range(start_step, cfg.steps):  # step = updates done before this one
            done = step + 1
            lr = schedule(step)
            t0 = time.perf_counter()
            x, y = sampler.next()  # [B, T] each
            try:
                if info is None:
                    loss, norm = train_step(step_model, optimizer, x, y, lr, cfg, guard, done,
                                            device, amp_dtype)
                else:
                    loss, norm = train_step_parallel(step_model, pipe, info, optimizer, x, y,
                                                     lr, cfg, guard, done, amp_dtype)
            except _Stop as stop:
                raise _diverged(stop, cfg, result, metrics, printer) from None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            step_times.append(dt)
            result.loss_history.append(loss)
            result.grad_norm_history.append(norm)
            result.lr_history.append(lr)
            result.steps = done
            window_tokens += x.numel()
            window_time += dt
            bar.update(1)
            if done % cfg.log_every == 0 or done == cfg.steps:
                tok_s = window_tokens / window_time
                metrics.write({"kind": "train", "step": done, "loss": loss, "lr": lr,
                               "grad_norm": norm, "tokens_per_s": tok_s,
                               "elapsed": time.perf_counter() - t_start})
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
                if bar.disable:
                    printer(f"step {done}/{cfg.steps}: loss {loss:.4f}, lr {lr:.2e}, "
                            f"grad norm {norm:.3f}, {tok_s:,.0f} tokens/s")
                window_tokens, window_time = 0, 0.0
            if done == cfg.steps or (cfg.eval_every and done % cfg.eval_every == 0):
                record_eval(done)
            if done == cfg.steps or (cfg.gain_every and done % cfg.gain_every == 0):
                record_gains(done)
            if done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
                checkpoint(done)
    finally:
        bar.close()
        printer.bar = None
        metrics.close()
        _finish(result, step_times, cfg, memory, t_start)

    printer(
        f"done: {result.steps} steps, final loss {result.final_loss:.4f}, val "
        f"{result.val_loss:.4f} nats = {result.val_bpb:.4f} bits/byte, "
        f"{result.tokens_per_s:,.0f} tokens/s"
        + (f", checkpoint {result.checkpoint}" if result.checkpoint else "")
    )
    return result


def _finish(result: TrainResult, step_times: list[float], cfg: TrainConfig,
            memory: _PeakMemory, t_start: float) -> None:
    """Fill in the summary numbers of the result (also for a stopped run)."""
    tail = result.loss_history[-min(20, len(result.loss_history)):]
    result.final_loss = sum(tail) / len(tail) if tail else math.nan
    if step_times:
        result.tokens_per_s = len(step_times) * cfg.batch_size * cfg.seq_len / sum(step_times)
        result.step_time_median_s = float(np.median(step_times))
    result.peak_mem_bytes = memory.peak()
    result.peak_mem_kind = memory.kind
    result.elapsed_s = time.perf_counter() - t_start


def _diverged(stop: _Stop, cfg: TrainConfig, result: TrainResult, metrics: _MetricsLog,
              printer: _Printer) -> TrainingDiverged:
    kept = (f"the last good checkpoint {result.checkpoint} was left untouched"
            if result.checkpoint else "no checkpoint had been written")
    message = f"training stopped: {stop.reason}; {kept}"
    result.diverged = message
    metrics.write({"kind": "stopped", "step": stop.step, "reason": stop.reason})
    printer(message)
    return TrainingDiverged(message, stop.step, result)
