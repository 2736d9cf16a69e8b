"""Time the connection ops per implementation, in one process.

    mhc bench --ops --tokens 2048 --streams 4 --dim 512 --impls reference cpu
    mhc bench --ops --profile ...                            # each native pass alone
    python -m torch_mhc.tools.bench.ops ...                  # the same

For each implementation, maps + pre-aggregation + post-merge, forward and backward with a
random upstream gradient, around an identity branch (so only the connection is timed),
against the plain residual's x + f on the same tokens. Whole training steps of the
reference LM with each connection are `mhc bench --only step` (torch_mhc.tools.bench.suite).

Runs alternate between the entries and the median is reported (torch_mhc.tools.bench.timing), which
keeps a shared machine's load from favouring one of them; --clock process times this
process's CPU time instead of wall time (steadier when other processes compete for the
cores). Prints JSON, then a markdown table.
"""

from __future__ import annotations

import argparse
import json

import torch

from torch_mhc.tools.bench.timing import CLOCKS, medians, time_interleaved
from torch_mhc.tools.bench.workloads import connection_step, residual_step

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def measure(
    impls: list[str],
    tokens: int = 2048,
    streams: int = 4,
    dim: int = 512,
    dtype: str = "float32",
    device: str = "cpu",
    repeats: int = 15,
    warmup: int = 2,
    clock: str = "wall",
) -> dict:
    """Median milliseconds of each implementation's connection step and of the residual."""
    dt = _DTYPES[dtype]
    steps = {name: connection_step(name, tokens, streams, dim, dt, device) for name in impls}
    steps["residual"] = residual_step(tokens, dim, dt, device)
    times = time_interleaved(steps, repeats, warmup, clock, device)
    return {
        "config": {"tokens": tokens, "streams": streams, "dim": dim, "dtype": dtype,
                   "device": device, "threads": torch.get_num_threads(), "repeats": repeats,
                   "clock": clock},
        "median_ms": medians(times),
        "min_ms": {name: min(ts) for name, ts in times.items()},
    }


def markdown(result: dict) -> str:
    """One row per implementation (and the residual): median and min ms, speed-up."""
    med, mins = result["median_ms"], result["min_ms"]
    base = med.get("reference")
    lines = ["| connection ops | median ms | min ms | speed-up vs reference |",
             "|---|---:|---:|---:|"]
    for name, ms in med.items():
        ratio = f"{base / ms:.2f}x" if base and name not in ("reference", "residual") else ""
        label = "residual x + f" if name == "residual" else name
        lines.append(f"| {label} | {ms:.2f} | {mins[name]:.2f} | {ratio} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=2048, help="ops: tokens (B*T)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--impls", nargs="+", default=["reference", "cpu"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--clock", choices=CLOCKS, default="wall")
    parser.add_argument("--profile", action="store_true",
                        help="time each native pass of the cpu connection step alone "
                             "(tools/bench/op_profile.py); --impls is not used")


def run_command(args: argparse.Namespace) -> int:
    """Time the implementations; print the JSON, then the markdown table."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.profile:
        from torch_mhc.tools.bench import op_profile

        result = op_profile.profile(args.tokens, args.streams, args.dim, args.dtype,
                                    repeats=args.repeats, clock=args.clock)
        print(json.dumps(result, indent=2))
        print(op_profile.markdown(result))
        return 0
    result = measure(args.impls, args.tokens, args.streams, args.dim, args.dtype, args.device,
                     args.repeats, clock=args.clock)
    print(json.dumps(result, indent=2))
    print(markdown(result))
    return 0


if __name__ == "__main__":  # the same as `mhc bench --ops`
    import sys

    from torch_mhc.tools.cli import run_bench_tool

    sys.exit(run_bench_tool("--ops", sys.argv[1:]))
