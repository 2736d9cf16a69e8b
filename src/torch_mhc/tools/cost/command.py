"""`mhc cost`: its options (add_arguments) and what it does with them (run_command); the parser
itself is built by torch_mhc.tools.cli."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from torch_mhc.tools.cost.format import format_table
from torch_mhc.tools.cost.model import DTYPE_BITS, PAPER_27B, CostConfig, estimate
from torch_mhc.tools.errors import UsageError

__all__ = ["DESCRIPTION", "add_arguments", "config_from_args", "run_command"]

DESCRIPTION = ("Analytic cost of residual, HC and mHC connections (memory traffic, FLOPs, "
               "activations, pipeline traffic, KV cache).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=["paper-27b"], help="start from the paper's 27B sizes")
    p.add_argument("--layers", type=int, help="transformer blocks (2 connections each)")
    p.add_argument("--hidden", type=int, help="hidden size C")
    p.add_argument("--streams", type=int, help="residual streams n (default 4)")
    p.add_argument("--tokens", type=int, help="sequence length T (default 4096)")
    p.add_argument("--batch", type=int, help="sequences per data-parallel replica (default 1)")
    p.add_argument("--dtype", choices=list(DTYPE_BITS), help="element type (default bf16)")
    p.add_argument("--sinkhorn-iters", type=int, help="Sinkhorn iterations (default 20)")
    p.add_argument("--heads", type=int, help="query heads")
    p.add_argument("--kv-heads", type=int, help="key/value heads")
    p.add_argument("--head-dim", type=int, help="head size")
    p.add_argument("--ffn-mult", type=float, help="MLP width / C (default 4)")
    p.add_argument("--pipeline-stages", type=int, help="must divide 2*layers (default 1)")
    p.add_argument("--micro-batches", type=int, help="must divide batch (default 1)")
    p.add_argument("--data-parallel", type=int, help="data-parallel replicas (default 1)")
    p.add_argument("--tensor-parallel", type=int, help="tensor-parallel ranks (default 1)")
    p.add_argument("--recompute-interval", type=int,
                   help="L_r in connections (default: the optimum per stage)")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")


def config_from_args(args: argparse.Namespace) -> CostConfig:
    """The preset (if any) with the given flags over it; UsageError without layers and hidden,
    ValueError (CostConfig's check) for sizes that do not fit together."""
    kwargs = dict(PAPER_27B) if args.preset == "paper-27b" else {}
    for f in fields(CostConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            kwargs[f.name] = value
    missing = [f"--{name}" for name in ("layers", "hidden") if name not in kwargs]
    if missing:
        raise UsageError(f"{' and '.join(missing)} required (or --preset paper-27b)")
    return CostConfig(**kwargs)


def run_command(args: argparse.Namespace) -> int:
    """Print the table (or the JSON report with --json)."""
    report = estimate(config_from_args(args))
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0
