"""The options of `mhc sweep` and what the command prints (the cli module builds the parser).

    mhc sweep --out runs/sweep                          # the "stability" preset
    mhc sweep --out runs/smoke --preset smoke
    mhc sweep --out runs/s --kinds residual,mhc --depths 4,16 --lrs 1e-3,1e-2,1e-1 --seeds 2
    mhc sweep --out runs/s --jobs 2                     # two cells at a time

The grid flags (--kinds, --depths, --lrs, --seeds) replace the preset's axis they name and
leave the others (and the preset's training settings) as they are; the report then names the
preset "modified". Training flags (--steps, --dim, --streams, --data, ...) override the
preset's settings for every cell; each cell sets its kind, depth, lr (min_lr = lr / 10) and
seed itself.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from torch_mhc.lm import config as train_config
from torch_mhc.tools.errors import UsageError
from torch_mhc.tools.sweep.grid import PRESETS, SWEPT

__all__ = ["DESCRIPTION", "EXCLUDED", "add_arguments", "run_command"]

DESCRIPTION = (
    "Train the reference LM for a short run at every cell of a grid of connection kind x "
    "depth (n_layers) x peak learning rate (x seed), each in --out/cells/<kind>-L<depth>-"
    "lr<lr>-s<seed>/, and record where each kind diverges: sweep.json (every cell, written "
    "after each), report.md, heatmap_loss.png and heatmap_gain.png. A rerun into the same "
    "--out skips the cells already recorded. Precedence: preset < flags; a grid flag replaces "
    "that axis of the preset's grid.")
# config fields the sweep sets itself (the base seed stays a flag: the seeds are seed ..
# seed + seeds - 1)
EXCLUDED = (set(SWEPT) - {"seed"}) | {"out_dir", "resume", "overwrite"}
DEFAULT_PRESET = "stability"


def _list_of(kind: type, what: str):
    def parse(text: str) -> tuple:
        items = [t.strip() for t in text.split(",") if t.strip()]
        try:
            return tuple(kind(t) for t in items)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got "
                                             f"{text!r}") from None

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", "--out-dir", dest="out", required=True, metavar="DIR",
                   help="folder of the sweep")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help=f"grid and training settings (default: {DEFAULT_PRESET}; smoke: "
                   "seconds, for tests)")
    p.add_argument("--kinds", type=_list_of(str, "connection kinds"), metavar="K1,K2,...",
                   help="connection kinds (residual, hc, mhc, mhc-lite, kromhc, "
                   "mhc-static-res); default: from --preset")
    p.add_argument("--depths", type=_list_of(int, "integers"), metavar="L1,L2,...",
                   help="numbers of blocks (n_layers); default: from --preset")
    p.add_argument("--lrs", type=_list_of(float, "numbers"), metavar="LR1,LR2,...",
                   help="peak learning rates; default: from --preset")
    p.add_argument("--seeds", type=int, metavar="K",
                   help="seeds per cell: seed .. seed+K-1 (default: from --preset, 1)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="cells trained at once, each in its own process on one torch thread "
                   "(default: 1)")
    train_config.add_config_flags(p, exclude=EXCLUDED, preset_keys=_preset_keys())


def _preset_keys() -> set[str]:
    return {key for preset in PRESETS.values() for key in preset["config"]}


def _require_extras() -> None:
    for name in ("numpy", "tqdm", "matplotlib"):
        try:
            importlib.import_module(name)
        except ImportError:
            raise UsageError(f"{name} is not installed: mhc sweep needs the training extra, "
                             "pip install -e '.[train]' in the torch-mhc checkout") from None


def run_command(args: argparse.Namespace) -> int:
    _require_extras()
    from tqdm.auto import tqdm

    from torch_mhc.tools.sweep.grid import preset_config, preset_grid
    from torch_mhc.tools.sweep.report import aggregate, breaks_text
    from torch_mhc.tools.sweep.run import sweep

    preset = args.preset or DEFAULT_PRESET
    flags = train_config.flag_overrides(args, exclude=EXCLUDED)
    cfg = train_config.build_config(preset_config(preset), None, flags)
    grid = preset_grid(preset, kinds=args.kinds, depths=args.depths, lrs=args.lrs,
                       seeds=args.seeds)
    changed = flags or any(x is not None for x in (args.kinds, args.depths, args.lrs,
                                                    args.seeds))
    label = preset + (", modified" if changed else "")

    def say(message: str) -> None:
        if not cfg.quiet:
            tqdm.write(message, file=sys.stdout)

    done = sweep(args.out, grid, cfg, jobs=args.jobs, label=label, say=say,
                 progress=cfg.progress)
    for kind, squares in aggregate(done["cells"]).items():
        say(f"{kind}: smallest lr that diverged: {breaks_text(squares, ', ')}")
    cells = "cell" if done["ran"] == 1 else "cells"
    say(f"report: {args.out}/report.md ({done['ran']} {cells} run, {done['skipped']} skipped, "
        f"{done['wall_time_s']:.1f} s)")
    return 0
