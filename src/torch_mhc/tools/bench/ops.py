"""Time the connection ops per implementation, in one process.

    mhc bench --ops --tokens 2048 --streams 4 --dim 512 --impls reference cpu
    mhc bench --ops --kinds mhc,mhc-lite,kromhc,mhc-static-res --impls cpu  # the successors
    mhc bench --ops --kinds mhc,hc --impls cpu               # HC's ops beside mHC's
    mhc bench --ops --profile ...                            # each native pass alone
    mhc bench --ops ... --json ops.json                      # also written to a file
    python -m torch_mhc.tools.bench.ops ...                  # the same

For each implementation (and each connection kind of --kinds: mHC's, HC's, mHC's successors'),
maps + pre-aggregation + post-merge, forward and backward with a random upstream gradient,
around an identity branch (so only the connection is timed), against the plain residual's
x + f on the same tokens; every run starts from no gradients (none is added to). Whole
training steps of the reference LM with each connection are `mhc bench --only step`
(torch_mhc.tools.bench.suite).

Runs alternate between the entries and the median is reported (torch_mhc.tools.bench.timing), which
keeps a shared machine's load from favouring one of them; --clock process times this
process's CPU time instead of wall time (steadier when other processes compete for the
cores). Prints JSON (its config with the date, versions, machine and load average at the
start and end), then a markdown table; --json PATH writes the JSON there too (atomically).
"""

from __future__ import annotations

import argparse
import json

import torch

from torch_mhc import ops as _ops
from torch_mhc.functional.successors import VARIANT_KINDS
from torch_mhc.ops.triton.aot import require_triton
from torch_mhc.tools.bench.report import check_json_path, load_average, run_meta, write_json_atomic
from torch_mhc.tools.bench.timing import CLOCKS, medians, time_interleaved
from torch_mhc.tools.bench.workloads import connection_step, residual_step
from torch_mhc.tools.boundary import positive_int

OP_KINDS = ("mhc", "hc", *VARIANT_KINDS)


def _names(option: str, values: list[str], allowed: tuple[str, ...]) -> list[str]:
    """The names of a list option given space- or comma-separated (`--kinds mhc hc` or
    `--kinds mhc,hc`; a repeated option adds to the list), each one of `allowed`, each kept
    once; ValueError otherwise."""
    names = [name.strip() for value in values for name in value.split(",") if name.strip()]
    names = list(dict.fromkeys(names))  # each once, in the order given
    bad = [name for name in names if name not in allowed]
    if bad or not names:
        raise ValueError(f"argument {option}: expected names from {', '.join(allowed)} "
                         f"(space- or comma-separated), got {' '.join(values)!r}")
    return names


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
    kinds: tuple[str, ...] = ("mhc",),
) -> dict:
    """Median milliseconds of each implementation's connection step (entries "<impl>" for
    mHC, "<impl> <kind>" for HC and the successors) and of the residual."""
    dt = _DTYPES[dtype]
    steps = {(name if kind == "mhc" else f"{name} {kind}"):
             connection_step(name, tokens, streams, dim, dt, device, kind)
             for kind in kinds for name in impls}
    steps["residual"] = residual_step(tokens, dim, dt, device)
    times = time_interleaved(steps, repeats, warmup, clock, device)
    return {
        "config": {"tokens": tokens, "streams": streams, "dim": dim, "dtype": dtype,
                   "device": device, "threads": torch.get_num_threads(), "repeats": repeats,
                   "clock": clock, "kinds": list(kinds)},
        "median_ms": medians(times),
        "min_ms": {name: min(ts) for name, ts in times.items()},
    }


def markdown(result: dict) -> str:
    """One row per implementation and kind (and the residual): median and min ms, speed-up
    over the reference implementation of the same kind, and time over the same
    implementation's mHC."""
    med, mins = result["median_ms"], result["min_ms"]
    lines = ["| connection ops | median ms | min ms | speed-up vs reference | x mHC |",
             "|---|---:|---:|---:|---:|"]
    for name, ms in med.items():
        impl, _, kind = name.partition(" ")
        base = med.get("reference" + (f" {kind}" if kind else ""))
        ratio = f"{base / ms:.2f}x" if base and impl not in ("reference", "residual") else ""
        own = med.get(impl) if kind else None
        over = f"{ms / own:.3f}" if own else ""
        label = "residual x + f" if name == "residual" else f"{impl} {kind or 'mhc'}"
        lines.append(f"| {label} | {ms:.2f} | {mins[name]:.2f} | {ratio} | {over} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=positive_int, default=2048,
                        help="tokens (batch x sequence) of the streams x [T, n, C] "
                             "(default: %(default)s)")
    parser.add_argument("--streams", type=positive_int, default=4,
                        help="n, the number of streams (default: %(default)s)")
    parser.add_argument("--dim", type=positive_int, default=512,
                        help="C, the width of each stream (default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32",
                        help="the streams' dtype (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="(default: %(default)s)")
    parser.add_argument("--impls", nargs="+", action="extend", default=None, metavar="IMPL",
                        help="op implementations, any of " + ", ".join(_ops.IMPLS)
                             + " (default: reference cpu)")
    parser.add_argument("--kinds", nargs="+", action="extend", default=None, metavar="KIND",
                        help="connection kinds, any of " + ", ".join(OP_KINDS)
                             + " (default: mhc)")
    parser.add_argument("--repeats", type=positive_int, default=15,
                        help="timed rounds (default: %(default)s)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="wall, or this process's CPU time (default: %(default)s)")
    parser.add_argument("--profile", action="store_true",
                        help="time each native pass of mHC's cpu connection step alone "
                             "(tools/bench/op_profile.py); takes no --impls or --kinds")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the JSON to PATH (atomically)")


def check_arguments(args: argparse.Namespace) -> None:
    """ValueError naming an implementation or kind that is unknown or cannot run here, either
    given with --profile, or a --json path that cannot be written. Fills in the defaults of
    --impls and --kinds."""
    if args.json is not None:
        check_json_path(args.json)
    if args.profile:
        given = [o for o, v in (("--impls", args.impls), ("--kinds", args.kinds)) if v]
        if given:
            raise ValueError(f"--profile times the cpu ops' mHC passes; it takes no "
                             f"{' or '.join(given)}")
        return
    args.impls = _names("--impls", args.impls or ["reference", "cpu"], _ops.IMPLS)
    args.kinds = tuple(_names("--kinds", args.kinds or ["mhc"], OP_KINDS))
    if "triton" in args.impls:
        require_triton("--impls triton")


def run_command(args: argparse.Namespace) -> int:
    """Time the implementations; print the JSON (and write --json), then the markdown table."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    where = run_meta()
    if args.profile:
        from torch_mhc.tools.bench import op_profile

        result = op_profile.profile(args.tokens, args.streams, args.dim, args.dtype,
                                    repeats=args.repeats, clock=args.clock)
        table = op_profile.markdown(result)
    else:
        result = measure(args.impls, args.tokens, args.streams, args.dim, args.dtype,
                         args.device, args.repeats, clock=args.clock, kinds=args.kinds)
        table = markdown(result)
    result["config"].update(where, load_average_end=load_average())
    if args.json is not None:
        write_json_atomic(args.json, result)
    print(json.dumps(result, indent=2))
    print(table)
    return 0


if __name__ == "__main__":  # the same as `mhc bench --ops`
    import sys

    from torch_mhc.tools.bench.command import run_bench_tool

    sys.exit(run_bench_tool("--ops", sys.argv[1:]))
