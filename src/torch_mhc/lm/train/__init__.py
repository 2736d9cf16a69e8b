"""The training loop, for one process or many (torchrun): needs the `train` extra (numpy, tqdm).

    cfg = TrainConfig(model=ModelConfig(connection="mhc", dim=128), steps=500, out_dir="runs/a")
    result = train(cfg)            # TrainResult: losses, val loss / bits per byte, speed, gains

The parts, each its own module:
- torch_mhc.lm.config: `TrainConfig`, its validation (`ConfigError` naming the field), the
  device and dtype a setting resolves to;
- trainer: `train` and the `Trainer` that runs it (see its docstring for the order of a run);
- steps: model, optimizer, one `train_step`, evaluation, Amax gains, seeding and RNG state;
- schedule: the learning-rate schedule (`LRSchedule`) and the spike policy (`SpikeGuard`);
- checkpoint: the one checkpoint format of every run (a DCP directory `out_dir/ckpt`, the one
  before it `out_dir/ckpt.prev`), safe loading, `load_model` for generation;
- metrics: metrics.jsonl / TensorBoard, log lines, the progress bar, peak memory;
- lock: one run per out_dir (`RunLock`);
- errors: what can stop a run, and the exit status `mhc train` gives each.

Spike policy: a non-finite loss or gradient norm, or a loss above spike_factor x the mean of
the last spike_window accepted losses, stops the run with `TrainingDiverged` naming the step.
The check runs before the update, so nothing bad reaches the weights and no checkpoint is
written after it: the last good checkpoint on disk stays byte for byte as it was.

Distributed training (`parallel` = "ddp" | "fsdp" | "pp", launched by torchrun) goes
through torch_mhc.lm.parallel: the layout is checked in `TrainConfig.validate` before anything is
built; every rank seeds alike and draws the same global batch, DDP / FSDP2 ranks keep their
slice of it, a pipeline takes all of it (`micro_batches` per step). The spike policy sees the
loss of the global batch (all-reduced), so every rank stops at the same step. Evaluation runs
the same forwards on every rank (FSDP2 needs them); gains are measured for ddp / fsdp and
skipped under pp. Checkpoints resume at another world size, or in one process without
torchrun. Everything that writes (logs, metrics, the progress bar, the lock) runs on rank 0
only (`parallel.is_rank0()`); peak memory and step times are rank 0's.

    torchrun --nproc-per-node 2 -m torch_mhc.tools.cli train --parallel fsdp --batch-size 16 ...
"""

from torch_mhc.lm.config import ConfigError, TrainConfig, resolve_device, resolve_dtype
from torch_mhc.lm.parallel import is_rank0
from torch_mhc.lm.train.checkpoint import (
    CHECKPOINT_FORMAT,
    LAST_CHECKPOINT,
    PREVIOUS_CHECKPOINT,
    load_checkpoint,
    load_model,
    save_checkpoint,
)
from torch_mhc.lm.train.errors import (
    CheckpointError,
    DiskFullError,
    RunInterrupted,
    RunLockedError,
    TrainingDiverged,
)
from torch_mhc.lm.train.lock import RunLock
from torch_mhc.lm.train.metrics import METRICS_FILE
from torch_mhc.lm.train.schedule import LRSchedule, SpikeGuard
from torch_mhc.lm.train.steps import (
    StepContext,
    build_model,
    build_optimizer,
    evaluate,
    forward_loss,
    measure_gains,
    seed_everything,
    train_step,
)
from torch_mhc.lm.train.trainer import (
    Trainer,
    TrainResult,
    load_training_corpus,
    torch_threads,
    train,
)
from torch_mhc.runtime.files import atomic_write

atomic_write_bytes = atomic_write  # the name the single-file train module exported
is_main_process = is_rank0  # one definition: torch_mhc.lm.parallel.is_rank0

__all__ = [
    "CHECKPOINT_FORMAT",
    "LAST_CHECKPOINT",
    "METRICS_FILE",
    "PREVIOUS_CHECKPOINT",
    "CheckpointError",
    "ConfigError",
    "DiskFullError",
    "LRSchedule",
    "RunInterrupted",
    "RunLock",
    "RunLockedError",
    "SpikeGuard",
    "StepContext",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "TrainingDiverged",
    "atomic_write",
    "atomic_write_bytes",
    "build_model",
    "build_optimizer",
    "evaluate",
    "forward_loss",
    "is_main_process",
    "load_checkpoint",
    "load_model",
    "load_training_corpus",
    "measure_gains",
    "resolve_device",
    "resolve_dtype",
    "save_checkpoint",
    "seed_everything",
    "torch_threads",
    "train",
    "train_step",
]
