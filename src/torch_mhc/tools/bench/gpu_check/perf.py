"""The GPU check's timings: each Triton kernel launch alone (L2 flushed, launches amortised),
Sinkhorn forward and backward, the training step, decoding.

Kernel timings (section kernels), each row naming its method:

    cuda_graph  a CUDA graph of K launches, each after a write of a buffer larger than L2
                (2 x L2, at least 256 MiB), replayed; minus the same graph without the
                launches; divided by K. The warm figure (ms_l2_warm): a graph of K launches
                back to back, divided by K.
    events      the same sequences between one pair of CUDA events each (where a graph
                could not be captured).
    wall        CPU (the dry run): each launch timed alone with the host clock after the
                buffer write.

A device-to-device copy of the launch's bytes is timed the same way; bandwidth is reported as
a fraction of it.
"""

from __future__ import annotations

import statistics
import time

import torch

from torch_mhc import ops as _ops
from torch_mhc.tools.bench import decode, decode_call
from torch_mhc.tools.bench.timing import cuda_event_ms, time_ms
from torch_mhc.tools.bench.workloads import build_model, random_tokens, train_step

MIB = 2**20


def _real_maker(device: str, n: int):
    """Random tensors for op_args; phi [n*C, M] scaled so that logits are O(1) (linear domain)."""
    m = n * n + 2 * n
    gen = torch.Generator(device=device).manual_seed(0)

    def make(*shape, dtype=torch.float32):
        t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
        if len(shape) == 2 and shape[1] == m and shape[0] >= n:
            t /= shape[0] ** 0.5
        return t.to(dtype)

    return make


def _launch_bytes(launch) -> int:
    """Bytes a launch must move at least: each tensor argument once, phi once per token block
    that reads it (ops/triton/traffic.py, the model docs/performance.md states)."""
    from torch_mhc.ops.triton.traffic import launch_bytes

    return launch_bytes(launch)


def flush_buffer(device: str, min_mib: int) -> torch.Tensor:
    """A buffer larger than the device's L2 cache (2 x L2, at least min_mib): writing it
    between launches evicts what the previous launch left in L2."""
    size = min_mib * MIB
    if device == "cuda":
        size = max(size, 2 * torch.cuda.get_device_properties().L2_cache_size)
    return torch.empty(size, dtype=torch.uint8, device=device)


def _graph_ms(body, repeats: int) -> list[float]:
    """Milliseconds of a CUDA graph of body() per replay (captured after a warm-up run on a
    side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return cuda_event_ms(graph.replay, repeats)


def time_launch(fn, flush: torch.Tensor, launches: int, repeats: int, device: str) -> dict:
    """ms per launch of fn with L2 flushed before each launch, ms_l2_warm back to back, both
    amortised over `launches` launches; method names how (module docstring)."""
    k = launches

    def flushed():
        for _ in range(k):
            flush.fill_(1)
            fn()

    def flush_only():
        for _ in range(k):
            flush.fill_(1)

    def warm():
        for _ in range(k):
            fn()

    if device != "cuda":
        times = []
        for _ in range(repeats + 1):
            flush.fill_(1)
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return {"ms": statistics.median(times[1:]), "ms_l2_warm": time_ms(fn, repeats, device),
                "method": "wall"}
    try:
        timer, method = _graph_ms, "cuda_graph"
        both = timer(flushed, repeats)
    except Exception as err:  # a launch that cannot be captured: events around the sequences
        timer, method = cuda_event_ms, f"events ({type(err).__name__} capturing a graph)"
        both = timer(flushed, repeats)
    alone, back_to_back = timer(flush_only, repeats), timer(warm, repeats)
    return {"ms": (statistics.median(both) - statistics.median(alone)) / k,
            "ms_l2_warm": statistics.median(back_to_back) / k, "method": method}


def _copy_ms(nbytes: int, flush: torch.Tensor, launches: int, repeats: int, device: str):
    """A device-to-device copy moving nbytes (half read, half written), timed as a launch."""
    src = torch.empty(max(1, nbytes // 2), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return time_launch(lambda: dst.copy_(src), flush, launches, repeats, device)["ms"]


def bench_kernels(cfg: dict) -> dict:
    from torch_mhc.ops.triton import aot as triton_aot

    device, rows, tc = cfg["device"], [], cfg["timing"]
    n, t = cfg["kernel_n"], cfg["big_tokens"]
    flush = flush_buffer(device, tc["flush_min_mib"])
    for c in cfg["big_channels"]:
        make = _real_maker(device, n)
        for op, launch in triton_aot.op_launches(n, torch.bfloat16, t, c, 20, make):
            row = {"op": op, "kernel": launch.name, "tokens": t, "channels": c, "n": n,
                   "dtype": "bfloat16"}
            try:
                nbytes = _launch_bytes(launch)
                row.update(time_launch(launch.run, flush, tc["launches"], cfg["repeats"],
                                       device), bytes=nbytes)
                copy = _copy_ms(nbytes, flush, tc["launches"], cfg["repeats"], device)
                row.update(gb_per_s=nbytes / row["ms"] / 1e6, copy_ms=copy,
                           fraction_of_copy=copy / row["ms"])
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"[:2000]
            rows.append(row)
        del make
    return {"rows": rows, "flush_bytes": flush.numel(), "launches_per_figure": tc["launches"]}


def bench_sinkhorn(cfg: dict) -> dict:
    """Forward and backward ms per call, `launches` calls between one pair of CUDA events (L2
    warm; host dispatch included where it is the bottleneck); wall clock on a CPU."""
    device, rows, impls = cfg["device"], [], cfg["sk_impls"]
    k = cfg["timing"]["launches"]
    for n in cfg["ns"]:
        gen = torch.Generator().manual_seed(n)
        logits = torch.randn(cfg["sk_tokens"], n, n, generator=gen).to(device)
        up = torch.randn(cfg["sk_tokens"], n, n, generator=gen).to(device)
        for impl in impls:
            row = {"impl": impl, "n": n, "tokens": cfg["sk_tokens"], "iters": 20,
                   "method": f"{k} calls per event pair" if device == "cuda" else "wall"}
            try:
                fn = _ops.get_impl(impl).sinkhorn
                x = logits.clone().requires_grad_()

                def fwd(fn=fn, x=x):
                    for _ in range(k):
                        fn(x.detach(), 20)

                out = fn(x, 20)

                def bwd(out=out, x=x, up=up):
                    for _ in range(k):
                        torch.autograd.grad(out, x, up, retain_graph=True)

                repeats = max(1, cfg["repeats"] // 4)  # each figure is k calls already
                row["fwd_ms"] = time_ms(fwd, repeats, device) / k
                row["bwd_ms"] = time_ms(bwd, repeats, device) / k
                row["bwd_over_fwd"] = row["bwd_ms"] / row["fwd_ms"]
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"[:2000]
            rows.append(row)
    return {"rows": rows}


STEP_VARIANTS = {"residual": ("residual", {}), "hc": ("hc", {}), "mhc": ("mhc", {}),
                 "mhc+recompute": ("mhc", {"recompute": True})}


def bench_step(cfg: dict, dtype: torch.dtype) -> dict:
    """Median ms of a training step, one CUDA event pair per step (wall clock on a CPU)."""
    device, sc = cfg["device"], cfg["step"]
    idx = random_tokens(sc["batch"], sc["seq"] + 1, device=device)
    entries = {}
    for name, (kind, fields) in STEP_VARIANTS.items():
        entry = entries[name] = {}
        try:
            model = build_model(kind, sc["dim"], sc["layers"], 4, sc["seq"], dtype=dtype,
                                device=device, **fields)
            step = train_step(model, idx)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            entry["median_ms"] = time_ms(step, sc["repeats"], device)
            if device == "cuda":
                entry["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            del model, step
        except Exception as err:
            entry["error"] = f"{type(err).__name__}: {err}"[:2000]
    base = entries["residual"].get("median_ms")
    for entry in entries.values():
        if base and "median_ms" in entry:
            entry["ratio"] = entry["median_ms"] / base
    return {"config": {**sc, "dtype": str(dtype), "streams": 4,
                       "impl": _ops.resolve_impl_name("auto", device, dtype)},
            "method": "one event pair per step" if device == "cuda" else "wall",
            "entries": entries}


def bench_decode(cfg: dict, dtype: torch.dtype) -> dict:
    dc = cfg["decode"]
    res = decode.bench_decode(dim=dc["dim"], layers=dc["layers"], batches=dc["batches"],
                              prompt=dc["prompt"], new_tokens=dc["new_tokens"],
                              dtype=str(dtype).replace("torch.", ""), device=cfg["device"],
                              repeats=2, warmup=1)
    # one connection's call on one token, and where its time goes (host or kernels); an
    # error is recorded per impl, keeping the tokens/s measured above
    cc, res["call"] = dc["call"], {}
    try:  # the prepared decoding path gives the ops' bits, each kind
        res["prepared_equal"] = decode_call.prepared_matches_ops(
            ("mhc", "mhc-lite", "kromhc", "mhc-static-res"), cc["impls"][0], dc["dim"], 4,
            cfg["device"], dtype)
    except Exception as err:
        res["prepared_equal"] = [{"error": f"{type(err).__name__}: {err}"[:2000]}]
    for impl in cc["impls"]:
        try:
            res["call"][impl] = decode_call.profile_call(
                "mhc", impl, dc["dim"], 4, cfg["device"], dtype, cc["calls"], cc["rounds"],
                cc["profiled"], cc["top"])
        except Exception as err:  # recorded; the section keeps its other results
            res["call"][impl] = {"error": f"{type(err).__name__}: {err}"[:2000]}
    return {**res, "method": "host wall clock around each generate call, the device "
                             "synchronised before and after"}


__all__ = ["bench_decode", "bench_kernels", "bench_sinkhorn", "bench_step", "flush_buffer",
           "time_launch"]
