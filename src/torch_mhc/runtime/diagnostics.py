"""Amax Gain Magnitude (mHC paper, section 3.1, Fig. 3 and 7).

For a map M (one layer's H_res, or the composite H_res_l @ ... @ H_res_1 of layers 1..l,
per token):
    forward gain  = max_i |sum_j M_ij|   (largest absolute row sum)
    backward gain = max_j |sum_i M_ij|   (largest absolute column sum)
Each is reported as the mean over tokens and the worst token.

Collection costs nothing when not asked for: connections test one module-level variable,
and only inside `collect_gains()` do they hand their H_res (detached) to the collector.

    with collect_gains() as gains:
        model(tokens)
    report = gains.report()     # per layer and composite, forward and backward

Connection health (`collect_health()`, a sibling of `collect_gains()` on the same hook; its
HealthReport is a GainReport with these fields added), per layer l and for the composite
H_res_l ... H_res_1 of layers 1..l:
    colsum_min, colsum_max   smallest / largest column sum of the map, over columns and
                             tokens. Our Sinkhorn ends on rows, so rows are exact and the
                             columns carry its error; a column sum near 0 starves a stream
                             of gradient while the Amax gains (a max) stay near 1.
    max_abs_log_colsum       max over columns and tokens of |log column sum| (inf when a
                             sum is <= 0): shrinking and growing columns alike.
    max_abs_colsum_error     max over columns and tokens of |column sum - 1|: Sinkhorn's
                             remaining column error (rows are exact), which grows with the
                             logits' spread (functional.sinkhorn: ~1e-7 for spreads <= 1,
                             up to n - 1 for 100 and more); also the backward gain's excess.
    dist_identity            ||M - I||_F (Frobenius norm), mean over tokens: how far H_res
                             moved off the identity ("H_res never moves").
    dist_uniform             ||M - J/n||_F, mean over tokens: 0 when every output stream
                             is the mean of the inputs (the composite tending to J/n is the
                             streams' collapse). For n streams ||I - J/n||_F = sqrt(n - 1).
and per layer only:
    stream_cosine            mean over tokens of the mean pairwise cosine similarity of
                             the n streams entering layer l (1: copies of each other).
    logit_range              max - min of the logits H_res exponentiates (mHC: Sinkhorn's
                             n x n logits; mHC-lite: the n! softmax logits), per token;
                             {"mean", "max"} over tokens. None where H_res takes no exp.
    exp_underflow            share of those logits z with exp(z - max_token z) == 0 in
                             float32 (z - max below about -103.97): entries an exp-then-
                             normalise evaluation sets to 0, with zero gradient (mHC-lite's
                             softmax; a plain Sinkhorn). torch_mhc's Sinkhorn iterates such
                             matrices in the log domain instead (range above
                             sinkhorn.LINEAR_RANGE = 32), so for mHC it flags far logits.
    gate_pre, gate_post      mean of H_pre and of H_post over tokens and streams.
`HealthReport.flat()` gives all of it as one flat {name: float} dict for metrics logs.
"""

from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass, field, fields

import torch

__all__ = [
    "GainCollector",
    "GainReport",
    "HealthCollector",
    "HealthReport",
    "amax_gain",
    "collect_gains",
    "collect_health",
    "composite_gains",
    "composite_health",
    "exp_underflow_share",
    "logit_range",
    "map_health",
    "stream_cosine",
]

ACTIVE: GainCollector | None = None  # read by every connection's forward


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread. Recomputation
    (torch_mhc's recompute_streams, torch.utils.checkpoint) replays connections there, whose
    maps the forward pass recorded already."""
    task = getattr(torch._C, "_current_graph_task_id", None)  # private; absent: assume not
    return task is not None and task() != -1


def amax_gain(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward Amax gain of maps [..., n, n]; returns two tensors [...]."""
    fwd = m.sum(dim=-1).abs().amax(dim=-1)
    bwd = m.sum(dim=-2).abs().amax(dim=-1)
    return fwd, bwd


def _summary(g: torch.Tensor) -> dict:
    g = g.reshape(-1)
    return {"mean": g.mean().item(), "max": g.max().item()}


@dataclass
class GainReport:
    """Per-layer and composite gains, each {"mean": ..., "max": ...} over tokens."""

    layers: list[str] = field(default_factory=list)
    layer_fwd: list[dict] = field(default_factory=list)
    layer_bwd: list[dict] = field(default_factory=list)
    composite_fwd: list[dict] = field(default_factory=list)  # entry l: layers 1..l+1
    composite_bwd: list[dict] = field(default_factory=list)

    @property
    def max_composite_fwd(self) -> float:
        return max((c["max"] for c in self.composite_fwd), default=float("nan"))

    @property
    def max_composite_bwd(self) -> float:
        return max((c["max"] for c in self.composite_bwd), default=float("nan"))

    def to_dict(self) -> dict:
        return {
            "layers": self.layers,
            "layer_fwd": self.layer_fwd,
            "layer_bwd": self.layer_bwd,
            "composite_fwd": self.composite_fwd,
            "composite_bwd": self.composite_bwd,
            "max_composite_fwd": self.max_composite_fwd,
            "max_composite_bwd": self.max_composite_bwd,
        }


def composite_gains(maps: list[torch.Tensor], names: list[str] | None = None) -> GainReport:
    """Gains of each map [..., n, n] and of the running products, in float64.

    maps[l] must be layer l's H_res for the same tokens (same leading shape).
    """
    report = GainReport(layers=list(names) if names is not None else
                        [str(i) for i in range(len(maps))])
    composite = None
    for m in maps:
        m = m.detach().to(torch.float64)
        composite = m if composite is None else m @ composite
        for target, g in zip((report.layer_fwd, report.layer_bwd), amax_gain(m), strict=True):
            target.append(_summary(g))
        for target, g in zip(
            (report.composite_fwd, report.composite_bwd), amax_gain(composite), strict=True
        ):
            target.append(_summary(g))
    return report


class GainCollector:
    """Receives each connection's H_res during one forward pass, in call order."""

    def __init__(self, max_tokens: int | None = None):
        self.max_tokens = max_tokens
        self.names: list[str] = []
        self.maps: list[torch.Tensor] = []

    def record(self, module, h_res: torch.Tensor, **_more) -> None:
        """One connection's H_res [..., n, n]; `_more` (x, h_pre, h_post) is for
        HealthCollector."""
        m = h_res.detach().reshape(-1, *h_res.shape[-2:])
        if self.max_tokens is not None:
            m = m[: self.max_tokens]
        self.names.append(f"{module.kind}[{getattr(module, 'layer_index', len(self.maps))}]")
        self.maps.append(m.to(torch.float64, copy=True))

    def report(self) -> GainReport:
        if not self.maps:
            raise RuntimeError(
                "no connection recorded its maps: run a forward pass of a model with HC or "
                "mHC connections inside collect_gains() or collect_health() (the plain "
                "residual records nothing)"
            )
        return composite_gains(self.maps, self.names)


# ---------------------------------------------------------------------------------------------
# Connection health
# ---------------------------------------------------------------------------------------------

# float32 exp(z) is 0 below this (half the smallest subnormal, 2^-150, rounds to 0)
FP32_EXP_ZERO_BELOW = -103.97207708399179


def map_health(m: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-map figures of maps m [..., n, n]: each a tensor [...] (see the module docstring)."""
    n = m.shape[-1]
    cs = m.sum(dim=-2)  # [..., n] column sums
    log_cs = torch.where(cs > 0, cs.clamp_min(1e-300).log().abs(), torch.full_like(cs, math.inf))
    eye = torch.eye(n, dtype=m.dtype, device=m.device)
    return {
        "colsum_min": cs.amin(dim=-1),
        "colsum_max": cs.amax(dim=-1),
        "max_abs_log_colsum": log_cs.amax(dim=-1),
        "max_abs_colsum_error": (cs - 1.0).abs().amax(dim=-1),
        "dist_identity": (m - eye).flatten(-2).norm(dim=-1),
        "dist_uniform": (m - 1.0 / n).flatten(-2).norm(dim=-1),
    }


# how each per-token figure is reduced over tokens
_TOKEN_REDUCE = {"colsum_min": "min", "colsum_max": "max", "max_abs_log_colsum": "max",
                 "max_abs_colsum_error": "max", "dist_identity": "mean", "dist_uniform": "mean"}
HEALTH_FIELDS = tuple(_TOKEN_REDUCE)


def _reduce(name: str, t: torch.Tensor) -> float:
    t = t.reshape(-1)
    return getattr(t, _TOKEN_REDUCE[name])().item()


def stream_cosine(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Mean pairwise cosine similarity of the streams of x [..., n, C], per token: [...]
    (NaN for n = 1, which has no pairs; a zero stream counts as cosine 0)."""
    x = x.to(torch.float64)
    n = x.shape[-2]
    unit = x / x.norm(dim=-1, keepdim=True).clamp_min(eps)
    gram = unit @ unit.transpose(-1, -2)  # [..., n, n]
    off = gram.sum(dim=(-1, -2)) - gram.diagonal(dim1=-2, dim2=-1).sum(dim=-1)
    return off / (n * (n - 1)) if n > 1 else torch.full(x.shape[:-2], math.nan)


def logit_range(z: torch.Tensor) -> torch.Tensor:
    """max - min of each token's logits z [T, ...] -> [T]."""
    z = z.reshape(z.shape[0], -1)
    return z.amax(dim=-1) - z.amin(dim=-1)


def exp_underflow_share(z: torch.Tensor) -> float:
    """Share of the entries of z [T, ...] whose exp(z - max of the token) is 0 in float32."""
    z = z.reshape(z.shape[0], -1).to(torch.float32)
    return (torch.exp(z - z.amax(dim=-1, keepdim=True)) == 0).double().mean().item()


def _res_logits(module, x: torch.Tensor) -> torch.Tensor | None:
    """The logits a connection's H_res exponentiates, [..., n, n] or [..., R]; None if none.

    mHC: alpha_res * mat((flatten(x) @ phi[:, 2n:]) / r) + b_res (functional.maps.mhc_maps);
    the variants provide `res_logits(x)`; HC and the plain residual have none.
    """
    method = getattr(module, "res_logits", None)
    if method is not None:
        return method(x)
    if getattr(module, "kind", "") != "mhc":
        return None
    n = x.shape[-2]
    v = x.flatten(-2).float() if x.dtype != torch.float64 else x.flatten(-2)
    r = torch.sqrt(v.square().mean(dim=-1, keepdim=True) + module.norm_eps)
    logits = (v @ module.phi[:, 2 * n:].to(v.dtype)) / r  # [..., n*n]
    return module.alpha[2].to(v.dtype) * logits.unflatten(-1, (n, n)) + module.b_res.to(v.dtype)


@dataclass
class HealthReport(GainReport):
    """GainReport plus connection health (module docstring); per-layer lists in layer order,
    composite entry l for layers 1..l+1."""

    layer_health: list[dict] = field(default_factory=list)  # {field: float} per layer
    composite_health: list[dict] = field(default_factory=list)
    stream_cosine: list[float] = field(default_factory=list)
    logit_range: list[dict | None] = field(default_factory=list)  # {"mean", "max"} or None
    exp_underflow: list[float | None] = field(default_factory=list)
    gate_pre: list[float] = field(default_factory=list)
    gate_post: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = super().to_dict()
        for name in ("layer_health", "composite_health", "stream_cosine", "logit_range",
                     "exp_underflow", "gate_pre", "gate_post"):
            d[name] = getattr(self, name)
        return d

    def flat(self) -> dict[str, float]:
        """Every figure as {name: float} for a metrics log (None and NaN left out):
        summaries over depth first, then layer{l}/<figure> and composite{l}/<figure>."""
        return flat_health(self.to_dict())


def flat_health(d: dict) -> dict[str, float]:
    """HealthReport.flat() from the report's dict (as kept in training histories)."""
    comp, layers = d["composite_health"], d["layer_health"]
    out = {
        "max_composite_fwd": d["max_composite_fwd"],
        "max_composite_bwd": d["max_composite_bwd"],
        "min_composite_colsum": min(c["colsum_min"] for c in comp),
        "max_composite_colsum": max(c["colsum_max"] for c in comp),
        "max_abs_log_colsum": max(c["max_abs_log_colsum"] for c in comp + layers),
        # per layer only: a composite's column error mixes every layer's
        "max_abs_colsum_error": max((c.get("max_abs_colsum_error") for c in layers
                                     if c.get("max_abs_colsum_error") is not None),
                                    default=None),
        "composite_dist_identity": comp[-1]["dist_identity"],
        "composite_dist_uniform": comp[-1]["dist_uniform"],
        "last_stream_cosine": d["stream_cosine"][-1],
        "max_logit_range": max((r["max"] for r in d["logit_range"] if r), default=None),
        "max_exp_underflow": max((u for u in d["exp_underflow"] if u is not None),
                                 default=None),
        "mean_gate_pre": sum(d["gate_pre"]) / len(d["gate_pre"]),
        "mean_gate_post": sum(d["gate_post"]) / len(d["gate_post"]),
    }
    for i, (lay, cmp) in enumerate(zip(layers, comp, strict=True)):
        for name in HEALTH_FIELDS:  # histories written before a figure existed lack it
            out[f"layer{i}/{name}"] = lay.get(name)
            out[f"composite{i}/{name}"] = cmp.get(name)
        out[f"layer{i}/fwd_gain"] = d["layer_fwd"][i]["max"]
        out[f"layer{i}/bwd_gain"] = d["layer_bwd"][i]["max"]
        out[f"layer{i}/stream_cosine"] = d["stream_cosine"][i]
        if d["logit_range"][i]:
            out[f"layer{i}/logit_range"] = d["logit_range"][i]["max"]
            out[f"layer{i}/exp_underflow"] = d["exp_underflow"][i]
        out[f"layer{i}/gate_pre"] = d["gate_pre"][i]
        out[f"layer{i}/gate_post"] = d["gate_post"][i]
    return {k: float(v) for k, v in out.items()
            if v is not None and not (isinstance(v, float) and math.isnan(v))}


def composite_health(maps: list[torch.Tensor], names: list[str] | None = None) -> HealthReport:
    """composite_gains plus the map figures (map_health) per layer and composite, float64."""
    g = composite_gains(maps, names)
    report = HealthReport(**{f.name: getattr(g, f.name) for f in fields(GainReport)})
    composite = None
    for m in maps:
        m = m.detach().to(torch.float64)
        composite = m if composite is None else m @ composite
        for target, mat in ((report.layer_health, m), (report.composite_health, composite)):
            target.append({k: _reduce(k, v) for k, v in map_health(mat).items()})
    return report


class HealthCollector(GainCollector):
    """GainCollector that also measures the streams, the res logits and the gates."""

    def __init__(self, max_tokens: int | None = None):
        super().__init__(max_tokens)
        self.extra: list[dict] = []

    def _tokens(self, t: torch.Tensor, dims: int) -> torch.Tensor:
        t = t.detach().reshape(-1, *t.shape[t.dim() - dims:])  # [tokens, *last dims]
        return t if self.max_tokens is None else t[: self.max_tokens]

    @torch.no_grad()
    def record(self, module, h_res: torch.Tensor, x: torch.Tensor | None = None,
               h_pre: torch.Tensor | None = None, h_post: torch.Tensor | None = None) -> None:
        super().record(module, h_res)
        entry = {"stream_cosine": math.nan, "logit_range": None, "exp_underflow": None,
                 "gate_pre": math.nan, "gate_post": math.nan}
        if x is not None:
            x = self._tokens(x, 2)  # [T, n, C]
            entry["stream_cosine"] = stream_cosine(x).mean().item()
            z = _res_logits(module, x)
            if z is not None:
                z = z.reshape(z.shape[0], -1)
                span = logit_range(z)
                entry["logit_range"] = {"mean": span.mean().item(), "max": span.max().item()}
                entry["exp_underflow"] = exp_underflow_share(z)
        if h_pre is not None:
            entry["gate_pre"] = self._tokens(h_pre, 1).double().mean().item()
        if h_post is not None:
            entry["gate_post"] = self._tokens(h_post, 1).double().mean().item()
        self.extra.append(entry)

    def report(self) -> HealthReport:
        super().report()  # its error when nothing was recorded
        report = composite_health(self.maps, self.names)
        for entry in self.extra:
            for name, value in entry.items():
                getattr(report, name).append(value)
        return report


@contextlib.contextmanager
def collect_gains(max_tokens: int | None = None):
    """Context manager: connections called inside record their H_res into the collector
    (max_tokens: the tokens kept from each call, None for all):

        with collect_gains() as gains:
            model(x)
        report = gains.report()
    """
    _check_max_tokens(max_tokens, "collect_gains")
    with _active(GainCollector(max_tokens), "collect_gains") as collector:
        yield collector


@contextlib.contextmanager
def collect_health(max_tokens: int | None = None):
    """Like collect_gains(), and the health figures of the module docstring as well."""
    _check_max_tokens(max_tokens, "collect_health")
    with _active(HealthCollector(max_tokens), "collect_health") as collector:
        yield collector


def _check_max_tokens(max_tokens, name: str) -> None:
    if max_tokens is None:
        return
    expected = (f"{name}(max_tokens) expects the number of tokens to keep from each "
                f"connection call (an int >= 1) or None for all of them")
    try:
        if isinstance(max_tokens, bool):
            raise TypeError
        max_tokens = operator.index(max_tokens)  # ints, NumPy's integers
    except TypeError:
        raise TypeError(f"{expected}, got {type(max_tokens).__name__}; use it as "
                        f"`with {name}() as collector: model(x)`") from None
    if max_tokens < 1:
        raise ValueError(f"{expected}, got {max_tokens}")


@contextlib.contextmanager
def _active(collector: GainCollector, name: str):
    global ACTIVE
    if ACTIVE is not None:
        active = "collect_health" if isinstance(ACTIVE, HealthCollector) else "collect_gains"
        raise RuntimeError(f"{name}() inside an active collector: nesting is not supported "
                           f"({active}() is already active)")
    ACTIVE = collector
    try:
        yield collector
    finally:
        ACTIVE = None
