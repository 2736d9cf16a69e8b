"""Each native CPU kernel of ops/cpu/native.c alone, against a plain copy-like torch op.

    python benchmarks/bench_native_kernels.py --tokens 2048 --streams 4 --dim 512 --threads 1
    python benchmarks/bench_native_kernels.py --evict 64      # inputs out of cache

Times NativeOps' calls (ctypes, fresh outputs each call) on one set of inputs reused across
rounds: the inputs stay in the last-level cache when they fit, so this shows a kernel's
compute cost. Inside a training step a kernel's inputs were last touched many megabytes
ago; --evict MB writes that many MB of other memory before every call, times the writing
alone as its own entry, and reports each kernel's median minus it (benchmarks/NOTES_ops.md
has both kinds of figures). Process CPU time, median of interleaved rounds; prints JSON,
then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from torch_mhc.ops.cpu import native as cpu_native
from torch_mhc.tools.bench.timing import medians, time_interleaved


def kernels(tokens: int, n: int, c: int, dtype: torch.dtype) -> dict:
    """name -> closure running one kernel call."""
    native = cpu_native.load()
    if native is None:
        raise SystemExit("the native CPU library is unavailable (no C compiler, or "
                         "TORCH_MHC_NATIVE=0)")
    g = torch.Generator().manual_seed(0)
    m = n * n + 2 * n
    x = torch.randn(tokens, n, c, generator=g).to(dtype)
    phi = torch.randn(n * c, m, generator=g) / (n * c) ** 0.5
    # padded as the training forward pads it (16 columns where the library runs 16-float
    # vectors in x @ phi)
    phip = torch.nn.functional.pad(phi, (0, cpu_native.padded_width(m, native.skinny_width) - m))
    ab = torch.rand(2, m, generator=g)
    lt, r, h_pre, h_post, h_res, _ = native.maps_fwd(x, phip, ab, 20, 1e-6, 0.0, 0.0, False)
    g_pre, g_post = torch.randn(tokens, n, generator=g), torch.randn(tokens, n, generator=g)
    g_res = torch.randn(tokens, n, n, generator=g)
    f = torch.randn(tokens, c, generator=g).to(dtype)
    g_link = torch.randn(tokens, n, c, generator=g).to(dtype)
    return {
        "maps_fwd (+ aggregation)":
            lambda: native.maps_fwd(x, phip, ab, 20, 1e-6, 0.0, 0.0, True),
        "maps_bwd (+ aggregation, linked)":
            lambda: native.maps_bwd(x, phi, ab, lt, r, g_pre, g_post, g_res, f, g_link, 20,
                                    0.0, 0.0),
        "maps_bwd (+ aggregation)":
            lambda: native.maps_bwd(x, phi, ab, lt, r, g_pre, g_post, g_res, f, None, 20,
                                    0.0, 0.0),
        "merge_fwd": lambda: native.merge_fwd(x, f, h_post, h_res),
        "merge_bwd (with dx)": lambda: native.merge_bwd(x, f, h_post, h_res, g_link),
        "merge_bwd (linked: no dx, no dH_res)":
            lambda: native.merge_bwd(x, f, h_post, h_res, g_link, fused_dx=True),
        "pre_fwd": lambda: native.pre_fwd(x, h_pre),
        "torch: x + x, for scale": lambda: x + x,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--evict", type=float, default=0.0,
                   help="MB of other memory written before every call (0: none)")
    args = p.parse_args(argv)
    if args.evict < 0:
        p.error(f"--evict expects a size in MB >= 0, got {args.evict}")
    torch.set_num_threads(args.threads)
    steps = kernels(args.tokens, args.streams, args.dim, getattr(torch, args.dtype))
    evict = "writing the eviction buffer alone"
    if args.evict:
        junk = torch.empty(int(args.evict * (1 << 20)) // 4)
        steps = {k: (lambda fn=fn: (junk.fill_(1.0), fn())) for k, fn in steps.items()}
        steps[evict] = lambda: junk.fill_(1.0)
    times = time_interleaved(steps, args.repeats, 2, "process", "cpu")
    median = medians(times)
    offset = median[evict] if args.evict else 0.0
    result = {
        "config": vars(args),
        "median_ms": median,
        "min_ms": {k: min(v) for k, v in times.items()},
        "median_minus_eviction_ms": {k: ms - offset for k, ms in median.items() if k != evict},
    }
    print(json.dumps(result, indent=2))
    print("| kernel | median ms | min ms | median minus eviction ms |\n|---|---:|---:|---:|")
    for k in steps:
        own = "" if k == evict else f"{result['median_minus_eviction_ms'][k]:.2f}"
        print(f"| {k} | {median[k]:.2f} | {result['min_ms'][k]:.2f} | {own} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
