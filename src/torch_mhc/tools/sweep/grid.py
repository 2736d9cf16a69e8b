"""The grid of `mhc sweep`: its presets, the checks of its axes, one configuration per cell.

A cell is (kind, n_layers, lr, seed); everything else comes from the base TrainConfig (the
preset's, with the command line's flags on top). Each cell's cosine schedule ends at
lr x MIN_LR_RATIO, so every cell decays alike whatever its peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from torch_mhc.connections import CONNECTION_KINDS, check_streams
from torch_mhc.lm.config import SEED_MAX, ConfigError, TrainConfig

__all__ = ["MIN_LR_RATIO", "PRESETS", "SWEPT", "Cell", "Grid", "cell_config", "preset_config",
           "preset_grid"]

MIN_LR_RATIO = 0.1
# config fields every cell sets itself: not taken from flags
SWEPT = ("connection", "n_layers", "lr", "min_lr", "seed")

PRESETS: dict[str, dict] = {
    # about a second per cell: the tests' sweep (at 3e-3 the 12 steps barely start learning)
    "smoke": {
        "grid": {"kinds": ("residual", "hc", "mhc"), "depths": (1, 2), "lrs": (3e-3, 3e-2),
                 "seeds": 1},
        "config": {"dim": 32, "n_heads": 2, "max_seq_len": 32, "seq_len": 32, "batch_size": 4,
                   "steps": 12, "warmup": 2, "eval_every": 0, "eval_batches": 2,
                   "gain_every": 6, "gain_batch_size": 2, "log_every": 6, "threads": 1},
    },
    # compare's "stress" setting (width 64, up to 24 blocks = 48 sublayers), shorter, with
    # peak learning rates from a safe 3e-3 to 1.0. Gradient clipping and pre-norm keep even
    # lr 1.0 from a 4x loss spike (the default spike_factor) in the residual model, which only
    # trains worse; spike_factor 2 counts a loss twice its running mean as diverged.
    "stability": {
        "grid": {"kinds": ("residual", "hc", "mhc"), "depths": (6, 12, 24),
                 "lrs": (3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0), "seeds": 1},
        "config": {"dim": 64, "n_heads": 2, "max_seq_len": 64, "seq_len": 64, "batch_size": 8,
                   "steps": 300, "warmup": 30, "eval_every": 0, "eval_batches": 5,
                   "gain_every": 25, "log_every": 25, "threads": 1, "spike_factor": 2.0},
    },
}


class Cell(NamedTuple):
    kind: str
    n_layers: int
    lr: float
    seed: int

    @property
    def name(self) -> str:
        """The cell's folder name; repr(lr) is the shortest text that reads back as lr."""
        return f"{self.kind}-L{self.n_layers}-lr{float(self.lr)!r}-s{self.seed}"

    @classmethod
    def of(cls, record: dict) -> Cell:
        return cls(record["kind"], int(record["n_layers"]), float(record["lr"]),
                   int(record["seed"]))


@dataclass(frozen=True)
class Grid:
    kinds: tuple[str, ...]
    depths: tuple[int, ...]
    lrs: tuple[float, ...]
    seeds: int  # how many: base seed .. base seed + seeds - 1

    def check(self, streams: int, base_seed: int) -> None:
        """ConfigError for an empty axis, an unknown kind or one that cannot use `streams`,
        a depth < 1, an lr that is not a finite number > 0, seeds < 1."""
        for axis, values in (("kinds", self.kinds), ("depths", self.depths),
                             ("lrs", self.lrs)):
            if not values:
                raise ConfigError(f"empty grid: no {axis} given")
            if len(set(values)) != len(values):
                raise ConfigError(f"{axis} lists a value twice: {', '.join(map(str, values))}")
        unknown = [k for k in self.kinds if k not in CONNECTION_KINDS]
        if unknown:
            raise ConfigError(f"unknown kind(s) {', '.join(unknown)}; expected names from "
                              f"{', '.join(CONNECTION_KINDS)}")
        for kind in self.kinds:
            if kind != "residual":
                try:
                    check_streams(kind, streams)
                except ValueError as e:
                    raise ConfigError(f"kind {kind} cannot run with streams = {streams}: "
                                      f"{e}") from None
        bad = [d for d in self.depths if isinstance(d, bool) or not isinstance(d, int) or d < 1]
        if bad:
            raise ConfigError(f"depths must be integers >= 1, got {bad[0]!r}")
        bad = [x for x in self.lrs if not (isinstance(x, int | float) and math.isfinite(x)
                                           and x > 0)]
        if bad:
            raise ConfigError(f"lrs must be finite numbers > 0, got {bad[0]!r}")
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1:
            raise ConfigError(f"seeds must be an integer >= 1, got {self.seeds!r}")
        if base_seed + self.seeds - 1 > SEED_MAX:
            raise ConfigError(f"seed + seeds - 1 must be <= {SEED_MAX}, got seed {base_seed} "
                              f"and seeds {self.seeds}")

    def cells(self, base_seed: int) -> list[Cell]:
        """Every cell; seed by seed, and all kinds of one (depth, lr) together, so that an
        interrupted sweep holds whole rows of the comparison."""
        return [Cell(kind, depth, float(lr), base_seed + s)
                for s in range(self.seeds) for depth in self.depths
                for lr in sorted(self.lrs) for kind in self.kinds]


def preset_config(preset: str) -> TrainConfig:
    """TrainConfig defaults with the preset's values applied."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    return TrainConfig().updated(PRESETS[preset]["config"])


def preset_grid(preset: str, **axes) -> Grid:
    """The preset's grid, with each axis given (not None) in place of the preset's."""
    values = dict(PRESETS[preset]["grid"])
    values.update({k: v for k, v in axes.items() if v is not None})
    return Grid(kinds=tuple(values["kinds"]), depths=tuple(values["depths"]),
                lrs=tuple(values["lrs"]), seeds=values["seeds"])


def cell_config(base: TrainConfig, cell: Cell, folder: Path) -> TrainConfig:
    """The cell's run: base with the cell's kind, depth, lr and seed, in its own folder,
    silent (the sweep reports), resuming a checkpoint an interrupted sweep left there."""
    from torch_mhc.lm.train import LAST_CHECKPOINT, PREVIOUS_CHECKPOINT

    resume = any((folder / name).exists() for name in (LAST_CHECKPOINT, PREVIOUS_CHECKPOINT))
    cfg = base.updated({"connection": cell.kind, "n_layers": cell.n_layers, "lr": cell.lr,
                        "min_lr": cell.lr * MIN_LR_RATIO, "seed": cell.seed})
    return cfg.updated({"out_dir": str(folder), "resume": resume, "overwrite": not resume,
                        "quiet": True, "progress": False})
