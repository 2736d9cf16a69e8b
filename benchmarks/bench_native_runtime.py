"""The native CPU runtime's choices side by side, in one LM training step per round.

    python benchmarks/bench_native_runtime.py --dim 512 --threads 2 --clock process --repeats 5

Entries (one process, run round-robin, so the machine's load hits all alike):
    residual            the residual LM (the baseline)
    mhc                 mHC on the `cpu` ops as shipped: the kernels on torch's OpenMP team,
                        large outputs from the block pool
    mhc own-threads     the kernels' token ranges on threads of our own (what a forked child
                        uses, where OpenMP's team cannot run), pool on
    mhc no-pool         OpenMP team, block pool off (TORCH_MHC_CPU_POOL_MB=0's path)
Prints JSON (median, min, max ms and the ratio to the residual, with its per-round range),
then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager

import torch

from torch_mhc.ops.cpu import native as cpu_native
from torch_mhc.tools.bench.timing import CLOCKS, summarize, time_interleaved
from torch_mhc.tools.bench.workloads import build_model, random_tokens, train_step


@contextmanager
def _runtime(lib: cpu_native.NativeOps, own_threads: bool, pool: bool):
    """The library with its thread source and pool switched for the duration."""
    saved = lib.own_threads, lib.blocks.cap_bytes
    lib.own_threads = own_threads
    lib.blocks.cap_bytes = saved[1] if pool else 0
    try:
        yield
    finally:
        lib.own_threads, lib.blocks.cap_bytes = saved


def steps(dim: int, layers: int, batch: int, seq: int) -> dict:
    lib = cpu_native.load()
    if lib is None:
        raise SystemExit("the native CPU library is unavailable (no C compiler, or "
                         "TORCH_MHC_NATIVE=0)")
    idx = random_tokens(batch, seq + 1)
    residual = train_step(build_model("residual", dim, layers, seq=seq), idx)
    mhc = train_step(build_model("mhc", dim, layers, seq=seq), idx, impl="cpu")

    def variant(own_threads: bool, pool: bool):
        def step():
            with _runtime(lib, own_threads, pool):
                mhc()
        return step

    return {
        "residual": residual,
        "mhc": variant(own_threads=not lib.openmp, pool=True),
        "mhc own-threads": variant(own_threads=True, pool=True),
        "mhc no-pool": variant(own_threads=not lib.openmp, pool=False),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--threads", type=int, default=None, help="default: torch's")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--clock", choices=CLOCKS, default="process")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    times = time_interleaved(steps(args.dim, args.layers, args.batch, args.seq), args.repeats,
                             1, args.clock, "cpu")
    result = {"config": {**vars(args), "threads": torch.get_num_threads()},
              "entries": summarize(times, "residual")}
    print(json.dumps(result, indent=2))
    print("| entry | median ms | min-max ms | x residual | per-round ratio range |")
    print("|---|---:|---:|---:|---:|")
    for name, e in result["entries"].items():
        print(f"| {name} | {e['median_ms']:.0f} | {e['min_ms']:.0f}-{e['max_ms']:.0f} | "
              f"{e['ratio']:.3f} | {e['ratio_min']:.3f}-{e['ratio_max']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
