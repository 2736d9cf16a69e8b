"""Where an mHC connection's time goes on the CPU: each native pass of its training step
timed alone, with the fixed costs around them.

    mhc bench --ops --profile --tokens 2048 --dim 512 --threads 1 --clock process

The connection's forward + backward on the `cpu` ops is four native passes (ops/cpu/native.c):
maps forward (x @ phi, the RMS, gates, Sinkhorn and the aggregation in one pass), merge
forward, merge backward (fused_dx: it leaves x's gradient to the next pass) and maps backward
(Sinkhorn's backward, dphi and the one dx). Each is timed here on the same inputs, in
interleaved rounds, beside:

- the maps forward with one Sinkhorn iteration instead of the connection's, so the difference
  is what the other iterations cost;
- allocating the outputs a step needs ([T, n, C] twice and [T, C] twice, from the pool the
  ops use) and entering the thread team with no work (the fixed cost of one parallel call),
  each timed over 100 calls and given per call;
- the whole connection step through autograd (what `mhc bench --ops` times) and the plain
  residual's x + f forward and backward on the same tokens;
- the streaming rate: torch adding two [T, n, C] tensors into a third (an elementwise op that
  does next to no arithmetic, so it runs at the speed this machine moves bytes). Each pass's
  stream-sized tensors ([T, n, C] and [T, C] read and written) at that rate give its memory
  time: a pass near 1x its memory time waits on memory, one far above it on its arithmetic
  (the maps' three skinny products, n C x (n^2 + 2 n) multiply-adds a token each).

The passes' rows sum to less than the autograd step: the rest is autograd, the custom-op
dispatch and the small tensors around the passes.
"""

from __future__ import annotations

import torch

from torch_mhc.ops.cpu import native
from torch_mhc.ops.cpu import ops as cpu
from torch_mhc.tools.bench.timing import medians, time_interleaved
from torch_mhc.tools.bench.workloads import connection_step, residual_step

__all__ = ["profile", "markdown"]

STREAMING = "streaming rate: x + g into [T, n, C] (torch)"  # the row the memory times use


def _inputs(tokens: int, n: int, c: int, dtype: torch.dtype, iters: int):
    """Streams, parameters as the native passes take them, and the forward's results."""
    g = torch.Generator().manual_seed(0)
    m = n * n + 2 * n
    x = torch.randn(tokens, n, c, generator=g).to(dtype)
    phi = torch.randn(n * c, m, generator=g) / (n * c) ** 0.5
    alpha, b_pre, b_post = torch.full((3,), 0.5), torch.zeros(n), torch.zeros(n)
    b_res = torch.randn(n, n, generator=g)
    phip, ab = cpu.mhc_tables(phi, alpha, b_pre, b_post, b_res, wide=True)
    return dict(x=x, phip=phip, phi=phip[:, :m], ab=ab, iters=iters,
                g=torch.randn(tokens, n, c, generator=g).to(dtype), out=torch.empty_like(x))


def _passes(lib: native.NativeOps, d: dict) -> dict:
    """name -> a closure running that pass once (around an identity branch: f = a)."""
    x, phip, ab, iters = d["x"], d["phip"], d["ab"], d["iters"]
    lt, r, h_pre, h_post, h_res, a = lib.maps_fwd(x, phip, ab, iters, 1e-6, 0.0, 0.0, True)
    _, df, dh_post, _ = lib.merge_bwd(x, a, h_post, h_res, d["g"], fused_dx=True)
    t, n, c = x.shape
    f32 = torch.float32

    def allocate():
        blocks = lib.blocks
        return (blocks.empty(x.shape, x.dtype), blocks.empty(x.shape, x.dtype),
                blocks.empty((t, c), x.dtype), blocks.empty((t, c), x.dtype),
                torch.empty((t, n * n + 2 * n), dtype=f32))

    def team_entry():  # an empty range on every thread: the parallel region's fixed cost
        lib._fns["merge_fwd", x.dtype](None, None, None, None, None, 0, 0,
                                       torch.get_num_threads(), n, c)

    def many(fn):  # fixed costs of microseconds: _CALLS calls a run (a clock read costs ~1 us)
        def run():
            for _ in range(_CALLS):
                fn()
        return run

    return {
        "maps forward": lambda: lib.maps_fwd(x, phip, ab, iters, 1e-6, 0.0, 0.0, True),
        "maps forward, 1 Sinkhorn iteration":
            lambda: lib.maps_fwd(x, phip, ab, 1, 1e-6, 0.0, 0.0, True),
        "merge forward": lambda: lib.merge_fwd(x, a, h_post, h_res),
        "merge backward": lambda: lib.merge_bwd(x, a, h_post, h_res, d["g"], fused_dx=True),
        "maps backward": lambda: lib.maps_bwd(x, d["phi"], ab, lt, r, None, dh_post, None, df,
                                              d["g"], iters, 0.0, 0.0),
        "allocation of the outputs": many(allocate),
        "thread team entry": many(team_entry),
        STREAMING: lambda: torch.add(x, d["g"], out=d["out"]),
    }


def _stream_bytes(tokens: int, n: int, c: int, size: int) -> dict[str, int]:
    """Bytes of the stream-sized tensors each pass reads and writes (element size `size`):
    s = [T, n, C], b = [T, C]. The per-token maps (a few dozen floats a token) are left out."""
    s, b = tokens * n * c * size, tokens * c * size
    return {"maps forward": s + b,         # reads x, writes the aggregate a
            "merge forward": 2 * s + b,    # reads x and f, writes the merged streams
            "merge backward": s + 2 * b,   # reads g and f, writes df (fused_dx: not x)
            "maps backward": 3 * s + b}    # reads x, g and ga, writes dx


_CALLS = 100  # calls per timed run of the two fixed-cost rows (their figures are per call)
_PER_CALL = ("allocation of the outputs", "thread team entry")


def _autograd_steps(tokens: int, n: int, c: int, dtype: torch.dtype) -> dict:
    return {"connection step (autograd)": connection_step("cpu", tokens, n, c, dtype, "cpu"),
            "residual x + f step (autograd)": residual_step(tokens, c, dtype, "cpu")}


def profile(tokens: int = 2048, streams: int = 4, dim: int = 512, dtype: str = "float32",
            iters: int = 20, repeats: int = 15, warmup: int = 2, clock: str = "wall") -> dict:
    """Median and min milliseconds of each pass (see the module docstring)."""
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if dt is None:
        raise ValueError(f"the native passes run float32 and bfloat16 streams, got {dtype!r}")
    lib = native.load()
    if lib is None:
        raise RuntimeError("the native CPU library is unavailable (no C compiler, or "
                           "TORCH_MHC_NATIVE=0): there are no native passes to profile")
    steps = {**_passes(lib, _inputs(tokens, streams, dim, dt, iters)),
             **_autograd_steps(tokens, streams, dim, dt)}
    times = time_interleaved(steps, repeats, warmup, clock, "cpu")
    for name in _PER_CALL:
        times[name] = [t / _CALLS for t in times[name]]
    size = torch.finfo(dt).bits // 8
    added = 3 * tokens * streams * dim * size  # bytes: two tensors read, one written
    rate = added / (medians(times)[STREAMING] / 1e3)  # bytes a second
    return {
        "config": {"tokens": tokens, "streams": streams, "dim": dim, "dtype": dtype,
                   "sinkhorn_iters": iters, "threads": torch.get_num_threads(),
                   "repeats": repeats, "clock": clock, "openmp": lib.openmp},
        "median_ms": medians(times),
        "min_ms": {k: min(v) for k, v in times.items()},
        "max_ms": {k: max(v) for k, v in times.items()},
        # per pass: the stream-sized bytes it reads and writes; the streaming rate (bytes/s)
        "stream_bytes": {**_stream_bytes(tokens, streams, dim, size), STREAMING: added},
        "streaming_bytes_per_s": rate,
    }


def markdown(result: dict) -> str:
    """One row per pass: median, min-max, its share of the autograd connection step, and for
    the four passes (and the streaming add) their stream bytes, GiB/s and time over their
    memory time (their bytes at the streaming rate)."""
    med, lo, hi = result["median_ms"], result["min_ms"], result["max_ms"]
    step = med["connection step (autograd)"]
    nbytes, rate = result["stream_bytes"], result["streaming_bytes_per_s"]
    lines = ["| pass | median ms | min-max ms | share of the connection step | stream MiB | "
             "GiB/s | x its memory time |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, ms in med.items():
        row = f"| {name} | {ms:.3f} | {lo[name]:.3f}-{hi[name]:.3f} | {ms / step:.1%} |"
        if name in nbytes:
            memory_ms = nbytes[name] / rate * 1e3
            row += (f" {nbytes[name] / 2**20:.1f} | {nbytes[name] / 2**30 / (ms / 1e3):.1f} | "
                    f"{ms / memory_ms:.2f} |")
        else:
            row += " | | |"
        lines.append(row)
    lines += ["", f"Streaming rate (the median of `{STREAMING}`): {rate / 2**30:.1f} GiB/s."]
    return "\n".join(lines)
