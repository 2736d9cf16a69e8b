"""`mhc upcycle`'s command line: its options, and the call of `run.upcycle` with them.

Building the parser imports nothing heavy (the trainer, numpy, tqdm come with the run), so
that `mhc --help` and the other commands work without the train extra.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from torch_mhc.connections import CONNECTION_KINDS

__all__ = ["DESCRIPTION", "add_arguments", "run_command"]

DESCRIPTION = ("convert a trained residual run, function-preserving, to other connection kinds "
               "and continue training each beside a residual continuation, on the same batches")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="source", required=True, metavar="RUN_DIR",
                        help="a finished `mhc train` run folder of connection = residual")
    parser.add_argument("--kinds", default="hc,mhc", metavar="K1,K2,...",
                        help="kinds to convert to (default: hc,mhc; also "
                        f"{', '.join(CONNECTION_KINDS[3:])}); the residual continuation is "
                        "always trained")
    parser.add_argument("--steps", type=int, required=True, metavar="N",
                        help="steps of every continuation")
    parser.add_argument("--seeds", type=int, default=1, metavar="S",
                        help="continue on S seeds, paired across kinds (default: 1)")
    parser.add_argument("--out", "--out-dir", dest="out", required=True, metavar="DIR",
                        help="folder of the results")
    parser.add_argument("--streams", type=int, default=None, metavar="n",
                        help="streams of the converted kinds (default: the run's streams)")
    parser.add_argument("--seed", type=int, default=None,
                        help="first seed (default: the run's seed + 1)")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate (default: the run's lr)")
    parser.add_argument("--warmup", type=int, default=None, metavar="W",
                        help="warmup steps (default: min(the run's warmup, steps // 10))")
    parser.add_argument("--eval-every", type=int, default=None, metavar="K",
                        help="validation and gains every K steps (default: steps // 5)")
    parser.add_argument("--resume", action="store_true",
                        help="continue unfinished runs (a rerun does this anyway)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start every run over, discarding what OUT holds")
    parser.add_argument("--verbose", action="store_true",
                        help="show the trainer's own log lines")


def run_command(args: argparse.Namespace) -> int:
    from torch_mhc.tools.upcycle.run import upcycle  # the trainer: imported only to run

    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    upcycle(args.source, args.out, kinds=kinds, steps=args.steps, seeds=args.seeds,
            streams=args.streams, seed=args.seed, lr=args.lr, warmup=args.warmup,
            eval_every=args.eval_every, overwrite=args.overwrite, verbose=args.verbose)
    print(f"report: {Path(args.out) / 'report.md'}")
    return 0
