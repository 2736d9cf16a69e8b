"""The decode benchmark: tokens/s of KV-cached greedy generation, residual vs HC vs mHC."""

from __future__ import annotations

import contextlib
import statistics

import torch

from torch_mhc import ops as _ops
from torch_mhc.connections import frozen_connections
from torch_mhc.tools.bench.timing import (
    median_interval,
    medians,
    summarize,
    time_interleaved,
    time_once,
)
from torch_mhc.tools.bench.workloads import DTYPES, build_model, log, random_tokens

__all__ = ["bench_decode", "time_decode_steps"]


def bench_decode(
    *,
    dim: int = 512,
    layers: int = 8,
    streams: int = 4,
    batches: tuple[int, ...] = (1, 8),
    prompt: int = 128,
    new_tokens: int = 128,
    variants: tuple[str, ...] = ("residual", "hc", "mhc"),
    dtype: str = "float32",
    device: str = "cpu",
    impl: str = "auto",
    repeats: int = 3,
    warmup: int = 1,
    clock: str = "wall",
    builds: int = 2,
) -> dict:
    """KV-cached greedy generation (LM.generate, temperature 0) per variant and batch size.

    Timed side by side: the whole generate call (prefill of the prompt, then new_tokens - 1
    one-token steps) and the prefill alone. tokens_per_s = batch * new_tokens / generate time;
    decode_tokens_per_s = batch * (new_tokens - 1) / (generate - prefill), from the medians.
    Then new_tokens - 1 one-token steps of every model interleaved step by step
    (time_decode_steps): step_tokens_per_s = batch / median step time, the steadier figure on
    a shared machine.

    builds: the models are built this many times, each time in a rotated order, and every
    build's rounds are pooled. Decoding streams every weight from memory at each token, and
    where a model's weights land matters: two identical models built one after the other in
    one process decoded at batch 8 up to 15% apart (2026-12-02, 2-core EPYC), about the
    difference being measured. Rotating and pooling builds keeps that from favouring one
    variant.
    """
    if "residual" not in variants:
        variants = ("residual", *variants)
    if builds < 1:
        raise ValueError(f"builds must be >= 1, got {builds}")
    dt = DTYPES[dtype]
    seq = prompt + new_tokens
    times: dict[int, dict[str, list[float]]] = {b: {} for b in batches}
    for build in range(builds):
        order = variants[build % len(variants):] + variants[:build % len(variants)]
        models = {v: build_model(v, dim, layers, streams, seq, dtype=dt, device=device).eval()
                  for v in order}
        for batch in batches:
            log(f"decode B={batch}, build {build + 1}/{builds}: {prompt} + {new_tokens} "
                f"tokens, {', '.join(order)}; {warmup} + {repeats} rounds")
            got = _time_batch(models, batch, prompt, new_tokens, impl, repeats, warmup, clock,
                              device)
            for name, ts in got.items():
                times[batch].setdefault(name, []).extend(ts)
        del models
    results = [{"batch": b, "entries": _entries(times[b], variants, b, new_tokens)}
               for b in batches]
    return {
        "config": {"dim": dim, "layers": layers, "streams": streams, "prompt": prompt,
                   "new_tokens": new_tokens, "dtype": dtype, "device": device,
                   "impl": _ops.resolve_impl_name(impl, device, dt), "repeats": repeats,
                   "builds": builds, "warmup": warmup, "clock": clock,
                   "sampling": "greedy, KV cache",
                   "steps": "inside one frozen_connections block, as LM.generate runs them"},
        "results": results,
    }


def _time_batch(models: dict, batch: int, prompt: int, new_tokens: int, impl: str,
                repeats: int, warmup: int, clock: str, device: str) -> dict[str, list[float]]:
    """Interleaved rounds of generate and of the prefill alone, per model, at one batch size."""
    idx = random_tokens(batch, prompt, device=device)  # [B, T0]

    def generate(model, idx=idx):
        _ops.set_default_impl(impl)
        try:
            return model.generate(idx, new_tokens, temperature=0.0)
        finally:
            _ops.set_default_impl(None)

    def prefill(model, idx=idx, batch=batch):
        _ops.set_default_impl(impl)
        try:
            with torch.no_grad():
                return model(idx, kv_cache=model.new_kv_cache(batch, prompt))
        finally:
            _ops.set_default_impl(None)

    steps = {}
    for v, m in models.items():
        steps[v] = lambda m=m: generate(m)
        steps[f"{v}/prefill"] = lambda m=m: prefill(m)
    times = time_interleaved(steps, repeats, warmup, clock, device)
    _ops.set_default_impl(impl)
    try:
        times.update(time_decode_steps(models, idx, new_tokens, warmup, clock, device))
    finally:
        _ops.set_default_impl(None)
    return times


@torch.no_grad()
def time_decode_steps(models: dict, idx: torch.Tensor, new_tokens: int, warmup: int,
                      clock: str, device: str, frozen: bool = True) -> dict[str, list[float]]:
    """"<variant>/step": the time of each one-token KV-cached step after the prefill of idx,
    the steps of all models interleaved (one step of each in turn, the first rotating).

    A whole generate call takes seconds, long enough for the machine's memory bandwidth to
    change under it (rounds of the same model spread by 10% here); a step of every model in
    turn puts the models' steps side by side within tens of milliseconds. frozen: the steps
    run inside one frozen_connections block, as LM.generate runs its tokens (False: every
    connection call checks its parameters, as a caller's own loop outside such a block).
    """
    with frozen_connections() if frozen else contextlib.nullcontext():
        return _decode_steps(models, idx, new_tokens, warmup, clock, device)


def _decode_steps(models: dict, idx: torch.Tensor, new_tokens: int, warmup: int, clock: str,
                  device: str) -> dict[str, list[float]]:
    batch, prompt = idx.shape
    caches = {}
    for v, m in models.items():
        caches[v] = m.new_kv_cache(batch, prompt + new_tokens)
        m(idx, kv_cache=caches[v])
    token = idx[:, -1:]  # [B, 1]: the cost of a step does not depend on the token
    names = list(models)
    times: dict[str, list[float]] = {f"{v}/step": [] for v in names}
    for s in range(warmup + new_tokens - 1):
        # the warm-up steps write positions the timed steps then write again: the cache and
        # the model hold prompt + new_tokens positions whatever the warm-up
        pos = prompt + (s - warmup if s >= warmup else s)
        for v in names[s % len(names):] + names[:s % len(names)]:
            ms = time_once(lambda v=v, pos=pos: models[v](token, kv_cache=caches[v],
                                                          start_pos=pos),
                           clock, device)
            if s >= warmup:
                times[f"{v}/step"].append(ms)
    return times


def _entries(times: dict[str, list[float]], variants: tuple[str, ...], batch: int,
             new_tokens: int) -> dict[str, dict]:
    """Per variant: the generate timings against the residual's, the prefill's median,
    tokens/s of the whole call and of its decode part (generate - prefill), and the median of
    the interleaved one-token steps with the tokens/s it gives; each with its ratio."""
    gen = summarize({v: times[v] for v in variants}, "residual")
    median = medians(times)
    pre = {v: median[f"{v}/prefill"] for v in variants}
    entries = {}
    for v in variants:
        g_ms = gen[v]["median_ms"]
        decode_ms = g_ms - pre[v]
        entries[v] = {
            **gen[v],
            "prefill_median_ms": pre[v],
            "tokens_per_s": batch * new_tokens / g_ms * 1e3,
            "decode_tokens_per_s": batch * (new_tokens - 1) / decode_ms * 1e3
            if decode_ms > 0 else None,
        }
    step = summarize({v: times[f"{v}/step"] for v in variants}, "residual")
    for v in variants:
        entries[v]["step_median_ms"] = step[v]["median_ms"]
        entries[v]["step_tokens_per_s"] = batch / step[v]["median_ms"] * 1e3
        entries[v]["step_tokens_per_s_ratio"] = 1.0 / step[v]["ratio"]
        # the steps were timed side by side: the median of the step-by-step tokens/s ratios
        # (the residual's step time over this one's) and its confidence interval
        per_step = [b / t for t, b in zip(times[f"{v}/step"], times["residual/step"],
                                          strict=True)]
        entries[v]["step_tokens_per_s_ratio_paired"] = statistics.median(per_step)
        entries[v]["step_tokens_per_s_ratio_interval"] = median_interval(per_step)
        entries[v]["steps"] = len(times[f"{v}/step"])
    for v in variants:
        e, base = entries[v], entries["residual"]
        e["tokens_per_s_ratio"] = e["tokens_per_s"] / base["tokens_per_s"]
        e["decode_tokens_per_s_ratio"] = (
            e["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            if e["decode_tokens_per_s"] and base["decode_tokens_per_s"] else None
        )
    return entries
