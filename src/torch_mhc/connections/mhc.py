"""Manifold-Constrained Hyper-Connections (mHC): H_res projected onto the doubly stochastic
matrices by Sinkhorn (the shared initialisation is described in connections.base)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torch_mhc import ops as _ops
from torch_mhc.connections.base import (
    Connection,
    assign_parameter,
    check_count,
    check_eps,
    check_gate,
    check_mixing_streams,
    pre_bias,
    res_bias,
)

__all__ = ["ManifoldHyperConnection"]


class ManifoldHyperConnection(Connection):
    """Manifold-Constrained Hyper-Connections (Xie et al., arXiv 2512.24880), Eq. 7-9.

    Parameters: phi [n*C, n*n + 2n] (the RMSNorm weight folded in), the gates
    alpha = (alpha_pre, alpha_post, alpha_res), the static biases b_pre [n], b_post [n],
    b_res [n, n]. `norm_eps`, `pre_eps` and `sinkhorn_eps` exist for DeepSeek-V4
    compatibility (integrations.deepseek_v4); the paper's algorithm has pre_eps = sinkhorn_eps = 0.
    """

    kind = "mhc"
    decode_kind = "mhc"

    def __init__(
        self,
        dim: int,
        streams: int,
        layer_index: int,
        branch: Callable,
        sinkhorn_iters: int = 20,
        gate_init: float = 0.01,
        res_init_diag: float | None = None,
        norm_eps: float = 1e-6,
        pre_eps: float = 0.0,
        sinkhorn_eps: float = 0.0,
        check_finite: bool = False,
        impl: str = "auto",
    ):
        super().__init__(dim, streams, branch, check_finite, impl)
        check_mixing_streams(self.streams, type(self).__name__)
        n = self.streams
        owner = type(self).__name__
        # "20" or 20.0 (a hand-edited config) and True are wrong types, not wrong counts
        sinkhorn_iters = check_count(sinkhorn_iters, owner, "sinkhorn_iters", 1)
        layer_index = check_count(layer_index, owner, "layer_index", 0)
        norm_eps = check_eps(norm_eps, owner, "norm_eps", positive=True)
        pre_eps = check_eps(pre_eps, owner, "pre_eps", positive=False)
        sinkhorn_eps = check_eps(sinkhorn_eps, owner, "sinkhorn_eps", positive=False)
        gate_init = check_gate(gate_init, owner)
        if res_init_diag is None:
            res_init_diag = 0.5 + 0.5 / n  # I / 2 + J / (2n)
        if not 0.0 < res_init_diag < 1.0 and n > 1:
            raise ValueError(f"res_init_diag must lie in (0, 1), got {res_init_diag!r}")
        self.layer_index, self.sinkhorn_iters = layer_index, sinkhorn_iters
        self.norm_eps, self.pre_eps, self.sinkhorn_eps = norm_eps, pre_eps, sinkhorn_eps
        self.gate_init, self.res_init_diag = float(gate_init), res_init_diag
        self.phi = nn.Parameter(torch.empty(n * self.dim, n * n + 2 * n))
        self.alpha = nn.Parameter(torch.empty(3))
        self.b_pre = nn.Parameter(torch.empty(n))
        self.b_post = nn.Parameter(torch.empty(n))
        self.b_res = nn.Parameter(torch.empty(n, n))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """phi = 0, alpha = gate_init, and the biases of the module docstring: H_pre =
        e_{k mod n} / 2 + 1 / (2n), H_post = 2 sigmoid(0) = 1, H_res = sinkhorn(b_res)."""
        n = self.streams
        assign_parameter(self.phi, torch.zeros(self.phi.shape))
        assign_parameter(self.alpha, torch.full((3,), self.gate_init))
        assign_parameter(self.b_pre, pre_bias(n, self.layer_index))
        assign_parameter(self.b_post, torch.zeros(n))
        assign_parameter(self.b_res, res_bias(n, self.res_init_diag))

    def maps(self, x: torch.Tensor, with_pre: bool = False):
        """H_pre, H_post, H_res; with_pre=True appends the branch input sum_j H_pre[j] x[j]
        (one fused op where the implementation has one)."""
        ops = _ops.get_impl(self.impl, x.device, x.dtype)
        return (ops.mhc_maps_pre if with_pre else ops.mhc_maps)(*self.map_args(x))

    def map_args(self, x: torch.Tensor) -> tuple:
        """The arguments of ops.mhc_maps (a subclass holding another parameter layout maps it
        here)."""
        params = self.own_tensors(("phi", "alpha", "b_pre", "b_post", "b_res"))
        return (x, *params, self.sinkhorn_iters, self.norm_eps, self.sinkhorn_eps, self.pre_eps)

    def _maps_and_input(self, ops, x: torch.Tensor):
        if ops.fused_dx:
            return ops.mhc_maps_pre(*self.map_args(x), fused_dx=True)
        return (*ops.mhc_maps_pre(*self.map_args(x)), None)

    def no_weight_decay(self) -> set[str]:
        return {"alpha", "b_pre", "b_post", "b_res"}

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, layer_index={self.layer_index}, "
            f"sinkhorn_iters={self.sinkhorn_iters}"
        )
