"""A connection's fixed costs per call on the `cpu` ops, each against what it replaced.

    python benchmarks/bench_connection_calls.py --tokens 8 --threads 1 --repeats 15

Two comparisons, each in one process, in interleaved rounds (every entry once a round):
    custom ops / direct    an mHC connection's forward and backward (ops.mhc_maps_pre and
                           post_merge with fused_dx, as ManifoldHyperConnection runs them)
                           with every native call through its torch.library custom op, and
                           as shipped: called directly in plain eager mode (native_call)
    torch copies / C loops the maps backward's two layout changes, phi [K, M] into phi^T's
                           column blocks and the per-thread phi gradient back into [K, M]:
                           torch's transposing copies against native.c's maps_phi_blocks
                           and maps_dphi_sum, each call after 48 MB of other traffic (as
                           in a model, where the layer's work comes between)
Prints JSON (per entry: median, min, max ms per call, the ratio to the first entry with its
per-round range, and the paired ratio with its interval), then a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from torch_mhc import ops
from torch_mhc.ops.cpu import native
from torch_mhc.ops.cpu import ops as cpu
from torch_mhc.tools.bench.report import script_report
from torch_mhc.tools.bench.timing import summarize


def _rounds(entries: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """ms per call of each entry (its callable returns that) over `repeats` interleaved
    rounds, after one untimed round."""
    for run in entries.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in entries}
    for _ in range(repeats):
        for name, run in entries.items():
            times[name].append(run())
    return times


def connection_calls(tokens: int, calls: int) -> dict[str, Callable[[], float]]:
    n, c = 4, 512
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, n, c, generator=g).requires_grad_()
    params = [torch.randn(n * c, 2 * n + n * n, generator=g) / (n * c) ** 0.5,
              torch.full((3,), 0.5), torch.zeros(n), torch.zeros(n),
              torch.randn(n, n, generator=g)]
    params = [p.requires_grad_() for p in params]
    upstream = torch.randn(tokens, n, c, generator=g)
    impl = ops.get_impl("cpu", "cpu", torch.float32)

    def step():
        _, h_post, h_res, f, x_for_merge = impl.mhc_maps_pre(x, *params, fused_dx=True)
        impl.post_merge(x_for_merge, f, h_post, h_res, fused_dx=True).backward(upstream)

    def timed(through_ops: bool) -> Callable[[], float]:
        def run() -> float:
            # native_call takes the custom ops whenever a dispatch mode is active
            saved = cpu.dispatch_mode_active
            if through_ops:
                cpu.dispatch_mode_active = lambda: True
            try:
                start = time.perf_counter()
                for _ in range(calls):
                    step()
                return (time.perf_counter() - start) / calls * 1e3
            finally:
                cpu.dispatch_mode_active = saved
        return run

    return {"custom ops": timed(True), "direct": timed(False)}


def layout_copies(lib: native.NativeOps, calls: int) -> dict[str, Callable[[], float]]:
    k, m, blocks = 2048, 24, 128  # n = 4, C = 512: K = n C, M = n n + 2 n
    phi = torch.randn(k, m)
    parts = torch.randn(1, blocks, m, 16)  # one thread's gradient, in column blocks
    other = torch.randn(12 << 20)  # 48 MB

    def torch_copies():
        phitb = phi.reshape(blocks, 16, m).transpose(1, 2).contiguous()
        return phitb, parts[0].transpose(1, 2).reshape(k, m).contiguous()

    def c_loops():
        phitb = torch.empty((blocks, m, 16))
        lib._lib.maps_phi_blocks(phi.data_ptr(), phitb.data_ptr(), k, m)
        dphi = torch.empty((k, m))
        lib._lib.maps_dphi_sum(parts.data_ptr(), 1, k, m, m, dphi.data_ptr())
        return phitb, dphi

    for a, b in zip(torch_copies(), c_loops(), strict=True):
        if not torch.equal(a, b):
            raise SystemExit("the C loops' layouts differ from torch's copies")

    def timed(fn) -> Callable[[], float]:
        def run() -> float:
            total = 0.0
            for _ in range(calls):
                other.add_(1.0)
                start = time.perf_counter()
                fn()
                total += time.perf_counter() - start
            return total / calls * 1e3
        return run

    return {"torch copies": timed(torch_copies), "C loops": timed(c_loops)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8, help="tokens of the connection's calls")
    p.add_argument("--calls", type=int, default=200, help="calls per entry and round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", metavar="PATH", help="also write the JSON here (atomically)")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.calls < 1 or args.threads < 1 or args.repeats < 2:
        p.error(f"--tokens, --calls and --threads must be >= 1 and --repeats >= 2, got "
                f"{args.tokens}, {args.calls}, {args.threads}, {args.repeats}")
    lib = native.load()
    if lib is None:
        raise SystemExit("the native CPU library is unavailable (no C compiler, or "
                         "TORCH_MHC_NATIVE=0)")
    torch.set_num_threads(args.threads)
    results = {
        f"connection forward + backward, {args.tokens} tokens": summarize(
            _rounds(connection_calls(args.tokens, args.calls), args.repeats), "custom ops"),
        "maps backward's layout copies (K = 2048, M = 24)": summarize(
            _rounds(layout_copies(lib, args.calls), args.repeats), "torch copies"),
    }
    print(script_report({**vars(args), "n": 4, "C": 512, "dtype": "float32",
                         "clock": "wall, ms per call"}, results, args.json))
    print("| comparison | entry | median us | min-max us | x first | paired (interval) |")
    print("|---|---|---:|---:|---:|---|")
    for what, entries in results.items():
        for name, e in entries.items():
            low, high, _ = e["ratio_interval"] or (e["ratio_paired"],) * 3
            us = {key: e[key] * 1e3 for key in ("median_ms", "min_ms", "max_ms")}
            print(f"| {what} | {name} | {us['median_ms']:.1f} | {us['min_ms']:.1f}-"
                  f"{us['max_ms']:.1f} | {e['ratio']:.3f} | {e['ratio_paired']:.3f} "
                  f"({low:.3f}-{high:.3f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
