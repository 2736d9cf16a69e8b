"""StreamHead: a learned, per-token weighted collapse of the streams (DeepSeek-V4's HyperHead).

reduce_streams takes the mean of the n streams before the final norm. DeepSeek-V4 instead
weights them with coefficients computed from the streams themselves, the same way mHC
computes H_pre (an RMS-scaled linear map of the flattened streams, then a sigmoid):

    v   = flatten(x)                                   # [..., n*C]
    r   = sqrt(mean(v**2) + norm_eps)                  # RMS over n*C
    w   = sigmoid(alpha * (v @ phi) / r + b) + eps     # [..., n]
    out = sum_j w[j] x[j]                              # [..., C]

Parameters: phi [n*C, n], the gate alpha [1], the bias b [n]. Initialisation keeps the
function of reduce_streams: phi = 0 and sigmoid(b) = 1/n, so out is the mean of the streams
(for n = 1, sigmoid cannot reach 1: w starts at 0.99, which the final norm absorbs; mHC's
connections, whose H_pre has the same limit, take n >= 2 instead). DeepSeek-V4 initialises
differently (random phi, alpha = 1, b = 0): converting its weights
(integrations.deepseek_v4.from_deepseek_v4_head) keeps them. eps is DeepSeek-V4's hc_eps (0 in
the default).

The weights are computed in float32 (float64 stays float64) whatever the streams' dtype, like
the connections' maps; the weighted sum too, and the result is cast back to x's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torch_mhc.connections.base import assign_parameter, check_count, check_eps

__all__ = ["StreamHead"]


class StreamHead(nn.Module):
    """[..., n, C] -> [..., C]: out = sum_j w_j(x) x_j (see the module docstring)."""

    def __init__(self, dim: int, streams: int, gate_init: float = 0.01,
                 norm_eps: float = 1e-6, eps: float = 0.0):
        super().__init__()
        dim = check_count(dim, "StreamHead", "dim", 1)
        streams = check_count(streams, "StreamHead", "streams", 1)
        if not math.isfinite(gate_init):
            raise ValueError(f"StreamHead expects a finite gate_init, got {gate_init!r}")
        norm_eps = check_eps(norm_eps, "StreamHead", "norm_eps", positive=True)
        eps = check_eps(eps, "StreamHead", "eps", positive=False)
        self.dim, self.streams, self.norm_eps, self.eps = dim, streams, norm_eps, eps
        self.gate_init = float(gate_init)
        self.phi = nn.Parameter(torch.empty(streams * dim, streams))
        self.alpha = nn.Parameter(torch.empty(1))
        self.b = nn.Parameter(torch.empty(streams))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """phi = 0, alpha = gate_init and b with sigmoid(b) = the mean's weight: the head starts
        as the mean of the streams (also after a build on the meta device and to_empty)."""
        w = _mean_weight(self.streams)
        assign_parameter(self.phi, torch.zeros(self.phi.shape))
        assign_parameter(self.alpha, torch.full((1,), self.gate_init))
        assign_parameter(self.b, torch.full((self.streams,), math.log(w / (1 - w))))

    def parameters_as_phi_alpha_b(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(phi [n*C, n], alpha [1], b [n]); subclasses holding another layout derive them."""
        return self.phi, self.alpha, self.b

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        """w [..., n] in float32 (float64 for float64 streams)."""
        self._check_input(x)
        phi, alpha, b = self.parameters_as_phi_alpha_b()
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        v = x.flatten(-2).to(dt)  # [..., n*C]
        inv_rms = torch.rsqrt(v.square().mean(-1, keepdim=True) + self.norm_eps)  # [..., 1]
        logits = F.linear(v, phi.to(dt).t()) * inv_rms  # [..., n]
        return torch.sigmoid(alpha.to(dt) * logits + b.to(dt)) + self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weights(x)  # [..., n]
        return (w.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)  # [..., C]

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"StreamHead expects a floating-point streams tensor, got {got}")
        if x.dim() < 2 or tuple(x.shape[-2:]) != (self.streams, self.dim):
            raise ValueError(
                f"StreamHead expects a streams tensor of shape [..., {self.streams}, {self.dim}]"
                f" (n={self.streams}, C={self.dim}), got {tuple(x.shape)}"
            )

    def no_weight_decay(self) -> set[str]:
        return {"alpha", "b"}

    def extra_repr(self) -> str:
        return f"dim={self.dim}, streams={self.streams}, eps={self.eps}"


def _mean_weight(n: int) -> float:
    return min(1.0 / n, 0.99)
