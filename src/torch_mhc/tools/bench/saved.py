"""The saved benchmark: bytes saved for backward per token per connection, residual vs HC vs
mHC, without and with selective recomputation. Counted, not timed: deterministic."""

from __future__ import annotations

import torch

from torch_mhc import ops as _ops
from torch_mhc.runtime.recompute import optimal_interval
from torch_mhc.tools.bench.workloads import DTYPES, build_model, log, random_tokens, saved_bytes

__all__ = ["SAVED_VARIANTS", "bench_saved"]

SAVED_VARIANTS = {  # name -> (connection kind, ModelConfig fields)
    "residual": ("residual", {}),
    "hc": ("hc", {}),
    "mhc": ("mhc", {}),
    "hc+recompute": ("hc", {"recompute": True}),
    "mhc+recompute": ("mhc", {"recompute": True}),
}


def bench_saved(
    *,
    dim: int = 512,
    layers: int = 8,
    streams: int = 4,
    batch: int = 2,
    seqs: tuple[int, ...] = (32, 64),
    dtype: str = "float32",
    device: str = "cpu",
    impl: str = "auto",
) -> dict:
    """Bytes saved for backward per token per connection, per variant; ratios to residual.

    Everything the LM saves (blocks included; parameters excluded) plus, with recomputation,
    what the recompute groups keep outside autograd (RecomputeStats.kept), divided by the
    tokens and the 2L connections. Measured at every seq in `seqs` to show the figure is per
    token; the figures reported are those at the longest. The mHC+recompute row uses the
    optimal interval L_r = round(sqrt(n * 2L / (n + 2))); `by_interval` sweeps others.
    """
    dt = DTYPES[dtype]
    n_conn = 2 * layers
    opt = optimal_interval(streams, n_conn)

    def per_token(kind: str, seq: int, fields: dict) -> float:
        model = build_model(kind, dim, layers, streams, seq, dtype=dt, device=device, **fields)
        idx = random_tokens(batch, seq, device=device)  # [B, T]
        _ops.set_default_impl(impl)
        try:
            nbytes, loss = saved_bytes(lambda: model(idx, idx)[1], exclude=model.parameters())
        finally:
            _ops.set_default_impl(None)
        if fields.get("recompute"):
            nbytes += model.recompute_stats.kept
        del loss
        return nbytes / (batch * seq) / n_conn

    by_seq = {}
    for seq in seqs:
        log(f"saved bytes d={dim} T={seq}: {', '.join(SAVED_VARIANTS)}")
        by_seq[seq] = {name: per_token(kind, seq, f)
                       for name, (kind, f) in SAVED_VARIANTS.items()}
    longest = max(seqs)
    main = by_seq[longest]
    esize = torch.empty((), dtype=dt).element_size()
    entries, spread = _entries(by_seq, dim * esize)
    intervals = sorted({1, 2, opt, 4, 8, n_conn} & set(range(1, n_conn + 1)))
    by_interval = {
        str(k): per_token("mhc", longest, {"recompute": True, "recompute_interval": k})
        for k in intervals
    }
    return {
        "config": {
            "dim": dim, "layers": layers, "connections": n_conn, "streams": streams,
            "batch": batch, "seqs": list(seqs), "reported_seq": longest, "dtype": dtype,
            "device": device, "impl": _ops.resolve_impl_name(impl, device, dt),
            "recompute_interval": opt,
        },
        "entries": entries,
        "per_token_relative_spread_across_seqs": spread,
        "mhc_recompute_by_interval": {
            k: {"bytes_per_token_per_connection": b, "ratio": b / main["residual"]}
            for k, b in by_interval.items()
        },
    }


def _entries(by_seq: dict[int, dict[str, float]], row_bytes: int) -> tuple[dict, float]:
    """Per variant the figures at the longest seq, and the largest relative spread of a
    variant's per-token figure across the seqs (0 when bytes scale per token exactly).

    row_bytes: the bytes of one C-wide row, the unit of extra_over_residual_in_C."""
    seqs = list(by_seq)
    main = by_seq[max(seqs)]
    entries = {
        name: {
            "bytes_per_token_per_connection": b,
            "ratio": b / main["residual"],
            "extra_over_residual_in_C": (b - main["residual"]) / row_bytes,
            "by_seq": {str(s): by_seq[s][name] for s in seqs},
        }
        for name, b in main.items()
    }
    spread = max(
        max(by_seq[s][name] for s in seqs) / min(by_seq[s][name] for s in seqs) - 1.0
        for name in main
    )
    return entries, spread
