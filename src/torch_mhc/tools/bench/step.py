"""The step benchmark: one training step of the reference LM per variant and width, timed side
by side, as ratios to the residual (also the measurement behind `hyper_connections`)."""

from __future__ import annotations

from torch_mhc import ops as _ops
from torch_mhc.tools.bench.timing import summarize, time_interleaved
from torch_mhc.tools.bench.workloads import DTYPES, build_model, log, random_tokens, train_step

__all__ = ["INDUCTOR_SUFFIX", "bench_training_steps", "default_step_repeats", "select_variants"]

INDUCTOR_SUFFIX = "_inductor"  # a step variant "<kind>_inductor": that kind on the inductor ops


def default_step_repeats(dim: int) -> int:
    """Rounds of the step benchmarks: 5, or 3 above d = 512 (a d = 1024 step takes seconds)."""
    return 5 if dim <= 512 else 3


def _round_ratios(times: dict[str, list[float]]) -> str:
    """The last round's steps as ratios to the residual's (a progress line)."""
    base = times["residual"][-1]
    return ", ".join(f"{name} {ms[-1] / base:.3f}x" for name, ms in times.items()
                     if name != "residual") or f"residual {base:.0f} ms"


def bench_training_steps(
    sizes: list[int],
    variants: list[str],
    *,
    layers: int = 8,
    streams: int = 4,
    batch: int = 8,
    seq: int = 256,
    dtype: str = "float32",
    device: str = "cpu",
    impl: str = "auto",
    optimizer: bool = False,
    repeats: int | None = None,
    warmup: int = 1,
    clock: str = "wall",
) -> dict:
    """Training-step time of each variant at each width, interleaved, ratios to the residual.

    repeats None: default_step_repeats(dim). Returns {"config": ..., "results": [per width]}.
    """
    if "residual" not in variants:
        variants = ["residual", *variants]
    dt = DTYPES[dtype]
    results = []
    for dim in sizes:
        r = repeats or default_step_repeats(dim)
        idx = random_tokens(batch, seq + 1, device=device)  # [B, T + 1]
        steps = {}
        for v in variants:
            # <kind>_inductor: that kind on the inductor ops (the reference under
            # torch.compile), beside the same kind on `impl`.
            on_inductor = v.endswith(INDUCTOR_SUFFIX)
            kind = v[:-len(INDUCTOR_SUFFIX)] if on_inductor else v
            ops_impl = "inductor" if on_inductor else impl
            model = build_model(kind, dim, layers, streams, seq, dtype=dt, device=device)
            steps[v] = train_step(model, idx, impl=None if v == "residual" else ops_impl,
                                  optimizer=optimizer)
        log(f"training step d={dim}: {', '.join(variants)}; {warmup} + {r} rounds")
        times = time_interleaved(steps, r, warmup, clock, device,
                                 on_round=lambda done, t, dim=dim, r=r: log(
                                     f"training step d={dim}: round {done}/{r}, "
                                     + _round_ratios(t)))
        results.append({"dim": dim, "repeats": r, "entries": summarize(times, "residual")})
        del steps
    return {
        "config": {
            "layers": layers, "streams": streams, "batch": batch, "seq": seq, "dtype": dtype,
            "device": device, "impl": _ops.resolve_impl_name(impl, device, dt),
            "optimizer": "AdamW included" if optimizer else "excluded",
            "warmup": warmup, "clock": clock,
            "timed": "forward + cross-entropy + backward" + (" + AdamW step" if optimizer else ""),
        },
        "results": results,
    }


def select_variants(steps_result: dict, variants: list[str]) -> dict:
    """The same measurement restricted to some variants (ratios are per entry, unchanged)."""
    out = {"config": dict(steps_result["config"]), "results": []}
    for res in steps_result["results"]:
        entries = {v: e for v, e in res["entries"].items() if v in variants}
        out["results"].append({**res, "entries": entries})
    return out
