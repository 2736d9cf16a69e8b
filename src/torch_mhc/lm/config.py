"""Configuration of a run: `TrainConfig` (validated, with the device and dtype it resolves to)
and its layers for the `mhc` commands: defaults, presets, a TOML file, flags.

    cfg = TrainConfig(model=ModelConfig(connection="mhc", dim=128), steps=500, out_dir="runs/a")
    cfg.validate()                 # ConfigError naming the field, what was expected, what came

Precedence, lowest first: TrainConfig's defaults (or a compare preset), then the TOML file
given with `--config`, then command-line flags. Every layer uses TrainConfig's field names.
A TOML file may put the model's fields at the top level or in a `[model]` table:

    steps = 2000
    lr = 3e-3
    data = "corpus/"

    [model]
    connection = "mhc"
    dim = 256

An unknown key anywhere is a ConfigError naming it and the closest known key (a misspelt key
must not be ignored), as is a value of the wrong type; the file's values are validated only
once merged with the flags (a file's n_heads may fit only the width a flag gives), before
anything runs. Paths starting with ~ are expanded when the TrainConfig is built.

Flags are generated from the dataclass fields (`--batch-size`, `--n-layers`, `--connection`,
booleans as `--compile / --no-compile`), so a new field gets its flag without editing here;
only the help text lives in `HELP`.

This module needs torch only (no numpy): the `mhc` command imports it before it knows whether
the training extra is installed.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from torch_mhc.lm.model import BYTE_VOCAB, ModelConfig
from torch_mhc.lm.parallel import layout as _layout

__all__ = [
    "DTYPES",
    "HELP",
    "SCHEDULES",
    "ConfigError",
    "TrainConfig",
    "add_config_flags",
    "build_config",
    "flag_overrides",
    "load_toml",
    "resolve_device",
    "resolve_dtype",
]


class ConfigError(ValueError):
    """A configuration value or input that cannot work; the message names it."""


SCHEDULES = ("cosine", "step")
DTYPES = ("auto", "fp32", "bf16")
SEED_MAX = 2**32 - 1  # numpy's seeds (the data order) are 32-bit
PATH_FIELDS = ("data", "cache_dir", "out_dir")  # resume too, when it is a path


@dataclass
class TrainConfig:
    """Everything a run depends on. `model` is the LM's config; the rest is the training's."""

    model: ModelConfig = field(default_factory=ModelConfig)
    # data
    data: str | None = None  # a text file, a folder, a saved HF dataset; None: the stdlib source
    cache_dir: str | None = None  # token cache; None: torch_mhc.lm.data.default_cache_dir()
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
    resume: bool | str = False  # True: out_dir/ckpt (else ckpt.prev); a str: that one
    overwrite: bool = False  # allow a fresh run in an out_dir that holds a checkpoint
    progress: bool = True  # tqdm bar (shown only on a terminal)
    tensorboard: bool = True  # write out_dir/tb when torch.utils.tensorboard works
    quiet: bool = False  # no log lines on stdout
    # execution
    dtype: str = "auto"  # "fp32" | "bf16" (autocast) | "auto" (see resolve_dtype)
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N" | "mps"
    compile: bool = False  # torch.compile the model for the training steps
    threads: int = 0  # torch.set_num_threads during the run (restored after); 0: as it is
    # parallelism (under torchrun; see torch_mhc.lm.parallel)
    parallel: str = "none"  # "none" | "ddp" | "fsdp" | "pp"
    pp_schedule: str = "1f1b"  # "1f1b" | "dualpipev" (parallel = "pp")
    micro_batches: int = 1  # pipeline micro-batches per step (parallel = "pp"; else 1)
    # spike policy
    spike_factor: float = 4.0  # stop when loss > factor x running mean; 0: off (NaN still stops)
    spike_window: int = 50  # steps in the running mean

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):
            self.model = ModelConfig.from_dict(self.model)
        # "~" expanded once, here, so that the checks and the files written see one path
        for name in PATH_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str) and value.startswith("~"):
                setattr(self, name, os.path.expanduser(value))
        if isinstance(self.resume, str) and self.resume.startswith("~"):
            self.resume = os.path.expanduser(self.resume)

    # --- validation ---------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ConfigError naming the field, what was expected and what came."""
        if not isinstance(self.model, ModelConfig):
            raise ConfigError(f"TrainConfig.model must be a ModelConfig, got {self.model!r}")
        try:
            self.model.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self._validate_numbers()
        self._validate_choices()
        self._validate_paths()
        from torch_mhc import ops

        try:
            device = resolve_device(self.device)
            resolve_dtype(self.dtype, device)
            ops.check_runs_on("auto", device)  # TORCH_MHC_IMPL, which "auto" reads
        except (ValueError, ops.ImplUnavailableError) as e:
            raise ConfigError(str(e)) from None
        self._validate_parallel()

    def _validate_numbers(self) -> None:
        _check_int(self, "batch_size", 1)
        _check_int(self, "seq_len", 1)
        _check_int(self, "steps", 1)
        _check_int(self, "warmup", 0)
        _check_int(self, "seed", 0, hi=SEED_MAX)
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
        if self.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"seq_len {self.seq_len} is longer than the model allows: max_seq_len is "
                f"{self.model.max_seq_len} (raise max_seq_len or lower seq_len)"
            )
        if self.model.vocab_size < BYTE_VOCAB:
            raise ConfigError(
                f"the corpora are byte-level: vocab_size must be >= {BYTE_VOCAB}, got "
                f"{self.model.vocab_size}"
            )

    def _validate_choices(self) -> None:
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

    def _validate_paths(self) -> None:
        if self.data is not None and (not isinstance(self.data, str) or not self.data.strip()):
            raise ConfigError(f"data must be a path (or unset for the stdlib), got {self.data!r}")
        if self.cache_dir is not None:
            _check_folder(self.cache_dir, "cache_dir")
        if self.out_dir is not None:
            _check_folder(self.out_dir, "out_dir")
        elif self.resume is True:
            raise ConfigError("resume = true (--resume) continues the run in out_dir/ckpt: set "
                              "out_dir (--out-dir) too, the folder of the run to continue")

    def _validate_parallel(self) -> None:
        """The parallel fields, and the layout for the world size torchrun announces."""
        if self.parallel not in _layout.PARALLEL_MODES:
            raise ConfigError(
                f"parallel must be one of {_layout.PARALLEL_MODES}, got {self.parallel!r}"
            )
        if self.pp_schedule not in _layout.SCHEDULES:
            raise ConfigError(f"pp_schedule must be one of {_layout.SCHEDULES}, got "
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
                    f"--nproc-per-node N -m torch_mhc train --parallel {self.parallel} ..."
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
            _layout.validate_layout(world, self.parallel, self.model.n_layers, self.batch_size,
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
        train_kw, model_kw = _split_keys(overrides)
        # dataclasses.replace re-runs ModelConfig.__post_init__ (its validation) on the copy
        try:
            model = replace(self.model, **model_kw)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        except TypeError as e:  # a value of a type the comparison in validate cannot take
            raise ConfigError(f"bad model config value: {e}") from None
        return replace(self, model=model, **train_kw)


# Former names of config fields: a file or flag using one gets an error naming the new one.
RENAMED = {"residual": "connection"}


def _split_keys(overrides: dict) -> tuple[dict, dict]:
    """(TrainConfig fields, ModelConfig fields) of a dict whose model fields are at the top
    level or in a "model" dict; ConfigError for an unknown or twice-given key."""
    train_names = {f.name for f in fields(TrainConfig)} - {"model"}
    model_names = {f.name for f in fields(ModelConfig)}
    train_kw, model_kw = {}, {}
    model = overrides.get("model")
    for key in (*overrides, *(model if isinstance(model, dict) else {})):
        if key in RENAMED:
            raise ConfigError(f"config key {key!r} is now {RENAMED[key]!r}")
    for key, value in overrides.items():
        if key == "model":
            if not isinstance(value, dict):
                raise ConfigError(f"'model' must be a table of model fields, got {value!r}")
            for mkey, mvalue in value.items():
                if mkey not in model_names:
                    raise ConfigError(f"unknown model config key {mkey!r}"
                                      f"{_suggest(mkey, model_names)}")
                if mkey in overrides:
                    raise ConfigError(f"{mkey!r} is given both at the top level and in model")
                model_kw[mkey] = mvalue
        elif key in model_names:
            model_kw[key] = value
        elif key in train_names:
            train_kw[key] = value
        else:
            raise ConfigError(f"unknown config key {key!r}"
                              f"{_suggest(key, train_names | model_names)}")
    return train_kw, model_kw


_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string",
               "bool": "true or false"}


def _fits(type_str: str, value) -> bool:
    """Whether a TOML value has a type the field's annotation ("int", "str | None", ...)
    allows; None never comes from TOML."""
    for part in type_str.split(" | "):
        if part == "bool" and isinstance(value, bool):
            return True
        if isinstance(value, bool):
            continue
        if ((part == "int" and isinstance(value, int))
                or (part == "float" and isinstance(value, int | float))
                or (part == "str" and isinstance(value, str))):
            return True
    return False


def _check_types(values: dict) -> None:
    """ConfigError for a value whose type its field cannot take, worded as the validation
    words it (the field and its rule)."""
    train_kw, model_kw = _split_keys(values)
    types = {f.name: str(f.type) for cls in (TrainConfig, ModelConfig) for f in fields(cls)}
    for key, value in {**train_kw, **model_kw}.items():
        if _fits(types[key], value):
            continue
        try:  # the rule as validate states it: only this key differs from the defaults
            TrainConfig().updated({key: value}).validate()
        except (ConfigError, ValueError, TypeError) as e:
            if key in str(e):
                raise ConfigError(str(e)) from None
        expected = " or ".join(_TYPE_WORDS[t] for t in types[key].split(" | ")
                               if t in _TYPE_WORDS)
        raise ConfigError(f"{key} must be {expected}, got {value!r}")


def _suggest(key: str, names: set[str]) -> str:
    """"; did you mean 'x'?" for the closest known name, else where the names are listed."""
    close = difflib.get_close_matches(str(key), sorted(names), n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    return "; the keys are the flags' names with _ for - (see mhc train --help)"


def _check_folder(value, name: str) -> None:
    """A folder path that is, or can become, a folder: no file at it or above it."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name} must be a folder path (a string), got {value!r}")
    path = Path(value).expanduser()
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                where = "" if p == path else f" ({p} is a file)"
                raise ConfigError(f"{name} {value} cannot be a folder{where}: expected a "
                                  "folder path, found a file there")
            return


def _check_int(cfg, name: str, lo: int, hi: int | None = None) -> None:
    value = getattr(cfg, name)
    if (isinstance(value, bool) or not isinstance(value, int) or value < lo
            or (hi is not None and value > hi)):
        rule = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{name} must be an integer {rule}, got {value!r}")


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
# Layers: TOML file and flags
# ---------------------------------------------------------------------------------------------

HELP = {
    # model
    "vocab_size": "vocabulary size (byte-level corpora need >= 256)",
    "dim": "model width C",
    "n_layers": "transformer blocks (2 connections each)",
    "n_heads": "attention heads",
    "max_seq_len": "longest sequence the model accepts",
    "mlp_ratio": "MLP width / dim",
    "connection": "connection kind: residual | hc | mhc | mhc-lite | kromhc | mhc-static-res",
    "streams": "residual streams n for every kind but residual (mHC and its successors: "
               "n >= 2; mhc-lite: n <= 5; kromhc: a power of two)",
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
    "resume": "resume out_dir/ckpt (ckpt.prev if ckpt is damaged), or the checkpoint given; "
              "`mhc train` takes the run's own settings, under --config and the flags given",
    "overwrite": "start afresh in an out_dir that already holds a checkpoint",
    "progress": "show a progress bar (on a terminal)",
    "tensorboard": "also log to TensorBoard when it is installed",
    "quiet": "no log lines on stdout",
    "dtype": "auto | fp32 | bf16 (autocast)",
    "device": "auto | cpu | cuda | cuda:N | mps",
    "compile": "torch.compile the model",
    "threads": "CPU threads for torch (0: torch's default); 1 is steadier on a busy machine",
    "parallel": "none | ddp | fsdp | pp (under torchrun --nproc-per-node N -m torch_mhc train)",
    "pp_schedule": "1f1b | dualpipev: the pipeline schedule (parallel pp)",
    "micro_batches": "pipeline micro-batches per step (parallel pp; >= stages, divides batch)",
    "spike_factor": "stop when the loss exceeds this x its running mean (0: off)",
    "spike_window": "steps in the spike policy's running mean",
}


def load_toml(path: str | Path) -> dict:
    """The key/value pairs of a TOML config file, their names and types checked against
    TrainConfig's and ModelConfig's fields (their values are checked with the flags')."""
    path = Path(path).expanduser()
    tomllib = _tomllib()
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
    # Names and types only: the values are checked together with the flags (build_config),
    # since a file's n_heads may fit only the dim a flag gives.
    try:
        _check_types(values)
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


class _Renamed(argparse.Action):
    """A former flag: using it is a usage error that names the new flag."""

    def __init__(self, *args, new: str, **kwargs):
        self.new = new
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {self.new}")


def add_config_flags(parser: argparse.ArgumentParser, exclude: set[str] = frozenset(),
                     preset_keys: set[str] = frozenset()) -> None:
    """One flag per config field; unset flags leave no attribute (argparse.SUPPRESS), so only
    what was typed overrides the lower layers. preset_keys: fields whose default comes from a
    preset (compare), shown as "(default: from --preset)"."""
    model_group = parser.add_argument_group("model")
    train_group = parser.add_argument_group("training")
    model_names = {f.name for f in fields(ModelConfig)}
    for old, new in RENAMED.items():
        parser.add_argument("--" + old, action=_Renamed, new="--" + new, nargs="?",
                            help=argparse.SUPPRESS)
    for name, type_str, default in _field_specs(set(exclude)):
        group = model_group if name in model_names else train_group
        flag = "--" + name.replace("_", "-")
        help_text = HELP.get(name, name)
        if name in preset_keys:
            help_text += " (default: from --preset)"
        elif "(default:" not in help_text:  # some help texts say the default in words
            help_text += f" (default: {default})"
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


def build_config(base: TrainConfig, config_file: str | Path | None, flags: dict,
                 validate: bool = True) -> TrainConfig:
    """base < config_file < flags, merged, then validated once (unless validate is False)."""
    values = {} if config_file is None else load_toml(config_file)
    merged = {k: v for k, v in values.items() if k != "model"}
    merged.update(values.get("model", {}))
    merged.update(flags)
    cfg = base.updated(merged)
    if validate:
        cfg.validate()
    return cfg


def _tomllib():
    """tomllib (Python >= 3.11) or the tomli backport, imported when a file is read."""
    try:
        import tomllib
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10 only
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError(
                "reading a TOML config on Python 3.10 needs tomli: pip install -e '.[train]' in "
                "the torch-mhc checkout"
            ) from None
    return tomllib
