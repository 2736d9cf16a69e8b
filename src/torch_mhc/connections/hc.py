"""Hyper-Connections (HC): static and dynamic maps, initialised as the residual network
(HC paper Eq. 14; the shared initialisation is described in connections.base)."""

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
    check_flag,
)

__all__ = ["HyperConnection"]


class HyperConnection(Connection):
    """Hyper-Connections (Zhu et al., arXiv 2409.19606), static or dynamic.

    Parameters in this library's convention (see functional.maps.hc_maps): static_pre = A_m,
    static_post = B, static_res = A_r^T; w = [W_beta | W_m | W_r] of shape [C, 2 + n].
    """

    kind = "hc"
    decode_kind = "hc"

    def __init__(
        self,
        dim: int,
        streams: int,
        layer_index: int,
        branch: Callable,
        dynamic: bool = True,
        norm_eps: float = 1e-6,
        check_finite: bool = False,
        impl: str = "auto",
    ):
        super().__init__(dim, streams, branch, check_finite, impl)
        n = self.streams
        layer_index = check_count(layer_index, "HyperConnection", "layer_index", 0)
        norm_eps = check_eps(norm_eps, "HyperConnection", "norm_eps", positive=True)
        dynamic = check_flag(dynamic, "HyperConnection", "dynamic")
        self.layer_index, self.dynamic, self.norm_eps = layer_index, dynamic, norm_eps
        self.static_pre = nn.Parameter(torch.empty(n))
        self.static_post = nn.Parameter(torch.empty(n))
        self.static_res = nn.Parameter(torch.empty(n, n))
        # The scales are one-element vectors, not scalars: FSDP2 shards no 0-dim parameter.
        if dynamic:
            self.w = nn.Parameter(torch.empty(self.dim, 2 + n))
            self.s_alpha = nn.Parameter(torch.empty(1))
            self.s_beta = nn.Parameter(torch.empty(1))
        else:
            self.register_parameter("w", None)
            self.register_buffer("s_alpha", torch.empty(1))
            self.register_buffer("s_beta", torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """HC paper Eq. 14: static_pre = e_{k mod n} (layer k reads stream k mod n),
        static_post = 1, static_res = I, W = 0, s_alpha = s_beta = 0.01 (0 when static)."""
        n, k = self.streams, self.layer_index % self.streams
        assign_parameter(self.static_pre, torch.eye(n)[k])
        assign_parameter(self.static_post, torch.ones(n))
        assign_parameter(self.static_res, torch.eye(n))
        scale = 0.01 if self.dynamic else 0.0
        if self.w is not None:
            assign_parameter(self.w, torch.zeros(self.dim, 2 + n))
        assign_parameter(self.s_alpha, torch.full((1,), scale))
        assign_parameter(self.s_beta, torch.full((1,), scale))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A checkpoint may hold the scales as 0-dim tensors: they load into the [1] vectors.
        for name in ("s_alpha", "s_beta"):
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                state_dict[prefix + name] = value.reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def maps(self, x: torch.Tensor, with_pre: bool = False):
        """H_pre, H_post, H_res; with_pre=True appends the branch input sum_j H_pre[j] x[j]
        (one fused op where the implementation has one)."""
        ops = _ops.get_impl(self.impl, x.device, x.dtype)
        return (ops.hc_maps_pre if with_pre else ops.hc_maps)(*self.map_args(x))

    def map_args(self, x: torch.Tensor) -> tuple:
        """The arguments of ops.hc_maps (a subclass holding another parameter layout maps it
        here)."""
        return (
            x, self.w, self.s_alpha.view(()), self.s_beta.view(()),
            self.static_pre, self.static_post, self.static_res, self.norm_eps,
        )

    def decode_args(self, x: torch.Tensor) -> tuple:
        """map_args for the prepared decoding calls (Ops.decoder), read from _parameters
        (Module.__getattr__ costs a decoding step time) and with the scales as stored: their
        0-dim views cost a view each at every call, and the decoder takes one-element
        tensors. A subclass that maps another parameter layout in map_args gets map_args."""
        if type(self).map_args is not HyperConnection.map_args:
            return self.map_args(x)
        params = self.own_tensors(("w", "s_alpha", "s_beta", "static_pre", "static_post",
                                   "static_res"))
        return (x, *params, self.norm_eps)

    def _maps_and_input(self, ops, x: torch.Tensor):
        # x_for_merge None: no single node was made, the merge writes its own dx
        if ops.fused_dx:
            return ops.hc_maps_pre(*self.map_args(x), fused_dx=True)
        return (*ops.hc_maps_pre(*self.map_args(x)), None)

    def no_weight_decay(self) -> set[str]:
        names = {"static_pre", "static_post", "static_res"}
        return names | ({"s_alpha", "s_beta"} if self.dynamic else set())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layer_index={self.layer_index}, dynamic={self.dynamic}"
