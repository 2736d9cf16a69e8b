"""Layered configuration for the `mhc` commands: defaults, presets, a TOML file, flags.

Precedence, lowest first: TrainConfig's defaults (or a compare preset), then the TOML file
given with `--config`, then command-line flags. Every layer uses TrainConfig's field names.
A TOML file may put the model's fields at the top level or in a `[model]` table:

    steps = 2000
    lr = 3e-3
    data = "corpus/"

    [model]
    residual = "mhc"
    dim = 256

An unknown key anywhere is a ConfigError naming it (a misspelt key must not be ignored), and
the merged configuration is validated before anything runs.

Flags are generated from the dataclass fields (`--batch-size`, `--n-layers`, `--residual`,
booleans as `--compile / --no-compile`), so a new field gets its flag without editing here;
only the help text lives in `HELP`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, fields
from pathlib import Path

from .model import ModelConfig
from .train import ConfigError, TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["HELP", "add_config_flags", "build_config", "flag_overrides", "load_toml"]

HELP = {
    # model
    "vocab_size": "vocabulary size (byte-level corpora need >= 256)",
    "dim": "model width C",
    "n_layers": "transformer blocks (2 connections each)",
    "n_heads": "attention heads",
    "max_seq_len": "longest sequence the model accepts",
    "mlp_ratio": "MLP width / dim",
    "residual": "connection kind: residual | hc | mhc",
    "streams": "residual streams n for hc / mhc",
    "sinkhorn_iters": "Sinkhorn-Knopp iterations of mHC",
    "norm_eps": "RMSNorm epsilon",
    "rope_base": "rotary embedding base",
    "init_std": "weight init standard deviation",
    "tie_embeddings": "share the embedding and LM-head weights",
    "check_finite": "raise inside a connection whose maps hold NaN/Inf (slower)",
    "recompute": "recompute the connections' stream arithmetic in backward (less memory)",
    "recompute_interval": "connections per recompute group (0: the paper's optimum)",
    # train
    "data": "text file, folder of text files, or saved HF dataset (default: stdlib source)",
    "cache_dir": "token cache folder (default: $TORCH_MHC_CACHE or ~/.cache/torch_mhc)",
    "val_fraction": "fraction of the corpus (its tail) held out for validation",
    "max_bytes": "use only the first N bytes of the corpus",
    "batch_size": "sequences per step",
    "seq_len": "tokens (bytes) per sequence",
    "steps": "optimizer steps",
    "lr": "peak learning rate",
    "min_lr": "final learning rate of the cosine schedule",
    "warmup": "linear warmup steps",
    "schedule": "cosine | step (x step_decay at 80%% and 90%% of the steps)",
    "step_decay": "factor of each drop of the step schedule",
    "beta1": "AdamW beta1",
    "beta2": "AdamW beta2",
    "weight_decay": "AdamW weight decay (connection maps and gates are exempt)",
    "grad_clip": "max gradient norm (0: no clipping)",
    "seed": "seed of the weights and of the data order",
    "eval_every": "validate every N steps (0: only at the end)",
    "eval_batches": "validation batches per evaluation",
    "gain_every": "measure the Amax gains every N steps (0: start and end only)",
    "gain_batch_size": "sequences of the fixed batch the gains are measured on",
    "log_every": "write a metrics line every N steps",
    "out_dir": "folder for metrics.jsonl, checkpoints and TensorBoard logs",
    "checkpoint_every": "checkpoint every N steps (0: only at the end)",
    "resume": "resume out_dir/last.pt, or the checkpoint given",
    "overwrite": "start afresh in an out_dir that already holds a checkpoint",
    "progress": "show a progress bar (on a terminal)",
    "tensorboard": "also log to TensorBoard when it is installed",
    "quiet": "no log lines on stdout",
    "dtype": "auto | fp32 | bf16 (autocast)",
    "device": "auto | cpu | cuda | cuda:N | mps",
    "compile": "torch.compile the model",
    "threads": "CPU threads for torch (0: torch's default); 1 is steadier on a busy machine",
    "parallel": "none | ddp | fsdp | pp (under torchrun --nproc-per-node N -m torch_mhc.cli)",
    "pp_schedule": "1f1b | dualpipev: the pipeline schedule (parallel pp)",
    "micro_batches": "pipeline micro-batches per step (parallel pp; >= stages, divides batch)",
    "spike_factor": "stop when the loss exceeds this x its running mean (0: off)",
    "spike_window": "steps in the spike policy's running mean",
}


def load_toml(path: str | Path) -> dict:
    """The key/value pairs of a TOML config file, checked against TrainConfig's fields."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder, expected a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    try:
        TrainConfig().updated(values)  # names every unknown key
    except ConfigError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    return values


def _field_specs(exclude: set[str]):
    """(name, type string, default) of every flag-able field, model fields first."""
    for cls in (ModelConfig, TrainConfig):
        for f in fields(cls):
            if f.name == "model" or f.name in exclude:
                continue
            default = f.default if f.default is not MISSING else None
            yield f.name, str(f.type), default


def add_config_flags(parser: argparse.ArgumentParser, exclude: set[str] = frozenset()) -> None:
    """One flag per config field; unset flags leave no attribute (argparse.SUPPRESS), so only
    what was typed overrides the lower layers."""
    model_group = parser.add_argument_group("model")
    train_group = parser.add_argument_group("training")
    model_names = {f.name for f in fields(ModelConfig)}
    for name, type_str, default in _field_specs(set(exclude)):
        group = model_group if name in model_names else train_group
        flag = "--" + name.replace("_", "-")
        help_text = f"{HELP.get(name, name)} (default: {default})"
        kwargs = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if name == "resume":
            group.add_argument(flag, nargs="?", const=True, metavar="CHECKPOINT", **kwargs)
        elif type_str == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif type_str.startswith("int"):
            group.add_argument(flag, type=int, metavar="N", **kwargs)
        elif type_str.startswith("float"):
            group.add_argument(flag, type=float, metavar="X", **kwargs)
        else:
            aliases = ["--out"] if name == "out_dir" else []
            group.add_argument(flag, *aliases, type=str, metavar=name.split("_")[-1].upper(),
                               **kwargs)


def flag_overrides(args: argparse.Namespace, exclude: set[str] = frozenset()) -> dict:
    """The config fields given on the command line, as {field: value}."""
    names = {name for name, _, _ in _field_specs(set(exclude))}
    return {k: v for k, v in vars(args).items() if k in names}


def build_config(base: TrainConfig, config_file: str | Path | None, flags: dict) -> TrainConfig:
    """base < config_file < flags, validated."""
    cfg = base
    if config_file is not None:
        cfg = cfg.updated(load_toml(config_file))
    cfg = cfg.updated(flags)
    cfg.validate()
    return cfg
