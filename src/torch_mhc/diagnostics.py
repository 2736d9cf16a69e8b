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
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

__all__ = ["amax_gain", "composite_gains", "collect_gains", "GainCollector", "GainReport"]

ACTIVE: GainCollector | None = None  # read by every connection's forward


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

    def record(self, module, h_res: torch.Tensor) -> None:
        m = h_res.detach().reshape(-1, *h_res.shape[-2:])
        if self.max_tokens is not None:
            m = m[: self.max_tokens]
        self.names.append(f"{module.kind}[{getattr(module, 'layer_index', len(self.maps))}]")
        self.maps.append(m.to(torch.float64, copy=True))

    def report(self) -> GainReport:
        if not self.maps:
            raise RuntimeError(
                "no connection recorded its maps: run a forward pass of a model with HC or "
                "mHC connections inside collect_gains() (the plain residual records nothing)"
            )
        return composite_gains(self.maps, self.names)


@contextlib.contextmanager
def collect_gains(max_tokens: int | None = None):
    """Context manager: connections called inside record their H_res into the collector."""
    global ACTIVE
    if ACTIVE is not None:
        raise RuntimeError("collect_gains() is already active; nesting is not supported")
    collector = GainCollector(max_tokens)
    ACTIVE = collector
    try:
        yield collector
    finally:
        ACTIVE = None
