"""The sinkhorn benchmark: functional.sinkhorn forward + backward against autograd through the
unrolled loop and the ops' Sinkhorns: time and bytes saved for backward."""

from __future__ import annotations

import torch

from torch_mhc import ops as _ops
from torch_mhc.functional.sinkhorn import sinkhorn, sinkhorn_unrolled
from torch_mhc.tools.bench.timing import summarize, time_interleaved
from torch_mhc.tools.bench.workloads import log, saved_bytes

__all__ = ["bench_sinkhorn"]


def bench_sinkhorn(
    *,
    tokens: int = 2048,
    sizes: tuple[int, ...] = (4, 8),
    iters: int = 20,
    repeats: int = 30,
    warmup: int = 1,
    clock: str = "wall",
    device: str = "cpu",
    seed: int = 0,
    inductor: bool = False,
) -> dict:
    """Sinkhorn forward + backward (random upstream gradient) on [tokens, n, n] fp32 logits.

    Entries: "unrolled" (autograd through sinkhorn_unrolled's loop: the baseline),
    "sinkhorn" (functional.sinkhorn: saves the logits, recomputes the iterates in backward),
    and "ops.cpu" (the cpu implementation's token-last Sinkhorn). saved_bytes counts every
    storage saved for backward, the input logits included when a function saves them.
    max_abs_diff: largest difference from the baseline, output and input gradient.
    """
    fns = {"unrolled": sinkhorn_unrolled, "sinkhorn": sinkhorn}
    cpu_sinkhorn = _ops.get_impl("cpu").sinkhorn
    if cpu_sinkhorn is not sinkhorn:
        fns["ops.cpu"] = cpu_sinkhorn
    if inductor:  # the reference under torch.compile (compiled in the warm-up round)
        fns["ops.inductor"] = _ops.get_impl("inductor").sinkhorn
    results = []
    for n in sizes:
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(tokens, n, n, generator=g).to(device).requires_grad_()  # [T, n, n]
        upstream = torch.randn(tokens, n, n, generator=g).to(device)  # [T, n, n]

        def fwd_bwd(fn, logits=logits, upstream=upstream):
            out = fn(logits, iters)
            return out, torch.autograd.grad(out, logits, upstream)[0]

        want_out, want_grad = fwd_bwd(sinkhorn_unrolled)
        entries = {}
        for name, fn in fns.items():
            out, grad = fwd_bwd(fn)
            nbytes, _ = saved_bytes(lambda fn=fn, z=logits: fn(z, iters))
            entries[name] = {
                "saved_bytes": nbytes,
                "saved_bytes_per_matrix": nbytes / tokens,
                "max_abs_diff": max((out - want_out).abs().max().item(),
                                    (grad - want_grad).abs().max().item()),
            }
        steps = {name: (lambda fn=fn: fwd_bwd(fn)) for name, fn in fns.items()}
        log(f"sinkhorn [{tokens}, {n}, {n}]: {', '.join(fns)}; {warmup} + {repeats} rounds")
        times = time_interleaved(steps, repeats, warmup, clock, device)
        for name, stats in summarize(times, "unrolled").items():
            entries[name].update(stats)
            entries[name]["saved_ratio"] = (
                entries[name]["saved_bytes"] / entries["unrolled"]["saved_bytes"]
            )
        results.append({"shape": [tokens, n, n], "entries": entries})
    return {
        "config": {"tokens": tokens, "sizes": list(sizes), "iters": iters, "dtype": "float32",
                   "device": device, "repeats": repeats, "warmup": warmup, "clock": clock,
                   "timed": "forward + backward (random upstream gradient)"},
        "results": results,
    }
