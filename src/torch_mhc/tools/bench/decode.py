"""The decode benchmark: tokens/s of KV-cached greedy generation, residual vs HC vs mHC."""

from __future__ import annotations

import torch

from torch_mhc import ops as _ops
from torch_mhc.tools.bench.timing import medians, summarize, time_interleaved
from torch_mhc.tools.bench.workloads import DTYPES, build_model, log, random_tokens

__all__ = ["bench_decode"]


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
) -> dict:
    """KV-cached greedy generation (LM.generate, temperature 0) per variant and batch size.

    Timed side by side: the whole generate call (prefill of the prompt, then new_tokens - 1
    one-token steps) and the prefill alone. tokens_per_s = batch * new_tokens / generate time;
    decode_tokens_per_s = batch * (new_tokens - 1) / (generate - prefill), from the medians.
    """
    if "residual" not in variants:
        variants = ("residual", *variants)
    dt = DTYPES[dtype]
    seq = prompt + new_tokens
    models = {v: build_model(v, dim, layers, streams, seq, dtype=dt, device=device).eval()
              for v in variants}
    results = []
    for batch in batches:
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
        log(f"decode B={batch}: {prompt} + {new_tokens} tokens, {', '.join(variants)}; "
            f"{warmup} + {repeats} rounds")
        times = time_interleaved(steps, repeats, warmup, clock, device)
        entries = _entries(times, variants, batch, new_tokens)
        results.append({"batch": batch, "entries": entries})
    return {
        "config": {"dim": dim, "layers": layers, "streams": streams, "prompt": prompt,
                   "new_tokens": new_tokens, "dtype": dtype, "device": device,
                   "impl": _ops.resolve_impl_name(impl, device, dt), "repeats": repeats,
                   "warmup": warmup, "clock": clock, "sampling": "greedy, KV cache"},
        "results": results,
    }


def _entries(times: dict[str, list[float]], variants: tuple[str, ...], batch: int,
             new_tokens: int) -> dict[str, dict]:
    """Per variant: the generate timings against the residual's, the prefill's median, and
    tokens/s of the whole call and of the decode steps alone, with their ratios."""
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
    for v in variants:
        e, base = entries[v], entries["residual"]
        e["tokens_per_s_ratio"] = e["tokens_per_s"] / base["tokens_per_s"]
        e["decode_tokens_per_s_ratio"] = (
            e["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            if e["decode_tokens_per_s"] and base["decode_tokens_per_s"] else None
        )
    return entries
