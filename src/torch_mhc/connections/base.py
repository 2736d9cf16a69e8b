"""Residual, Hyper-Connection (HC) and Manifold-Constrained Hyper-Connection (mHC) wrappers.

Every connection wraps a block F: [..., C] -> [..., C] and maps a streams tensor
x: [..., n, C] to [..., n, C] (the plain residual has n = 1):

    out[..., i, :] = sum_j H_res[i, j] x[..., j, :] + H_post[i] F(sum_j H_pre[j] x[..., j, :])

    h = embed(tokens)                       # [B, T, C]
    x = expand_streams(h, n)                # [B, T, n, C]
    for conn in connections: x = conn(x)    # each wraps one attention or MLP block
    h = reduce_streams(x)                   # [B, T, C]

Initialisation. All three start as the Pre-Norm residual network built from the same blocks:
`expand_streams` copies h into every stream, and each connection's initial maps keep equal
streams equal while adding F(h) once: H_pre sums to 1, H_post is all ones, H_res has rows
summing to 1. The dynamic parts start at zero (HC's W, mHC's phi), so the network computes
exactly the residual network's function, and `reduce_streams` (the mean) returns it.
Symmetry is broken by which stream each layer reads, so the streams separate as soon as
training moves the maps:
- HC (HC paper, Eq. 14): layer k reads stream k mod n (H_pre = e_k), H_post = 1, H_res = I,
  and the scales s_alpha, s_beta start at 0.01.
- mHC: H_pre = sigmoid(b_pre) = e_k / 2 + 1 / (2n) (half on stream k mod n, half spread),
  H_post = 2 sigmoid(0) = 1, H_res = sinkhorn(b_res) = I / 2 + J / (2n) (the same split:
  half kept, half averaged), and the gates alpha_pre, alpha_post, alpha_res start at 0.01 (the
  paper's value). For n = 4 every initial weight (0.625, 0.125) is exact in binary, so fp32
  rounding adds no bias. For n = 1, H_pre cannot reach 1 through a sigmoid: it starts at 0.99.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable

import torch
from torch import nn

from torch_mhc import ops as _ops
from torch_mhc.runtime import diagnostics as _diag
from torch_mhc.runtime import recompute as _recompute

__all__ = [
    "Residual",
    "HyperConnection",
    "ManifoldHyperConnection",
    "expand_streams",
    "reduce_streams",
    "make_connection",
    "param_groups",
    "CONNECTION_KINDS",
]

# the core kinds, then mHC's successors (torch_mhc.connections.successors)
CONNECTION_KINDS = ("residual", "hc", "mhc", "mhc-lite", "kromhc", "mhc-static-res")


def _count(value, owner: str, name: str, least: int) -> int:
    """value as an int >= least (numpy integers included, bools not), else a clear error."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(
            f"{owner} expects {name} to be an int, got {value!r} ({type(value).__name__})"
        )
    value = operator.index(value)
    if value < least:
        raise ValueError(f"{owner} expects {name} >= {least}, got {value}")
    return value


def expand_streams(h: torch.Tensor, n: int) -> torch.Tensor:
    """[..., C] -> [..., n, C]: every stream starts as a copy of h (a broadcast view)."""
    n = _count(n, "expand_streams", "n", 1)
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"expand_streams expects a tensor [..., C], got {type(h).__name__}")
    if h.dim() < 1:
        raise ValueError("expand_streams expects a tensor [..., C], got a scalar")
    return h.unsqueeze(-2).expand(*h.shape[:-1], n, h.shape[-1])


def reduce_streams(x: torch.Tensor) -> torch.Tensor:
    """[..., n, C] -> [..., C]: the mean of the streams.

    The HC paper sums the streams; the mean differs by the factor n, which the final norm of
    a Pre-Norm network removes, and it makes an initialised network equal to the residual one.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"reduce_streams expects a floating-point streams tensor, got {got}")
    if x.dim() < 2:
        raise ValueError(
            f"reduce_streams expects a streams tensor [..., n, C], got {tuple(x.shape)}"
        )
    return x.mean(dim=-2)


class _Connection(nn.Module):
    """Shared checks and the branch call; subclasses define `maps`."""

    kind = ""

    def __init__(
        self,
        dim: int,
        streams: int,
        branch: Callable,
        check_finite: bool = False,
        impl: str = "auto",
    ):
        super().__init__()
        dim = _count(dim, type(self).__name__, "dim", 1)
        streams = _count(streams, type(self).__name__, "streams", 1)
        if not callable(branch):
            raise TypeError(f"{type(self).__name__} expects a callable branch, got {branch!r}")
        self.dim, self.streams, self.branch = dim, streams, branch
        self.check_finite = check_finite
        # Op implementation (torch_mhc.ops): "auto" picks by device and dtype at each call.
        self.impl = _ops.check_impl_name(impl)

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{type(self).__name__} expects a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(
                f"{type(self).__name__} expects a floating-point streams tensor, got {x.dtype}"
            )
        if x.dim() < 2 or x.shape[-2] != self.streams or x.shape[-1] != self.dim:
            raise ValueError(
                f"{type(self).__name__} expects a streams tensor of shape "
                f"[..., {self.streams}, {self.dim}] (n={self.streams}, C={self.dim}), "
                f"got {tuple(x.shape)}"
            )

    def _check_maps(self, *maps: torch.Tensor) -> None:
        for name, m in zip(("H_pre", "H_post", "H_res"), maps, strict=True):
            self._check_finite(name, m)

    def _check_finite(self, what: str, t: torch.Tensor) -> None:
        if not torch.isfinite(t).all():
            raise FloatingPointError(
                f"{type(self).__name__}(layer {getattr(self, 'layer_index', '?')}): "
                f"{what} contains NaN or Inf"
            )

    def _check_branch_output(self, f) -> None:
        if not isinstance(f, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__}: the branch must return a tensor [..., {self.dim}], "
                f"got {type(f).__name__}"
            )
        if self.check_finite:
            self._check_finite("the branch output", f)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self._check_input(x)
        if self.check_finite:
            self._check_finite("the input streams", x)
        # expand_streams' broadcast view: copy once here rather than once inside every op.
        x = x if x.is_contiguous() else x.contiguous()
        if _recompute.ACTIVE is not None and torch.is_grad_enabled():
            return _recompute.ACTIVE.run(self, x, args, kwargs)
        h_in, state = self.mix_in(x)
        f = self.branch(h_in, *args, **kwargs)
        self._check_branch_output(f)
        return self.mix_out(x, f, state)

    def mix_in(self, x: torch.Tensor):
        """Maps and pre-aggregation: x [..., n, C] -> (h_in [..., C], state for mix_out)."""
        ops = _ops.get_impl(self.impl, x.device, x.dtype)
        h_pre, h_post, h_res, h_in, x_link = self._maps_and_input(ops, x)
        if self.check_finite:
            self._check_maps(h_pre, h_post, h_res)
        if _diag.ACTIVE is not None and not _diag.in_backward():  # a replay recorded already
            _diag.ACTIVE.record(self, h_res, x=x, h_pre=h_pre, h_post=h_post)
        return h_in, (ops, h_post, h_res, x_link)

    def mix_out(self, x: torch.Tensor, f: torch.Tensor, state) -> torch.Tensor:
        """Post-and-merge: H_res x + H_post^T f -> [..., n, C]."""
        ops, h_post, h_res, x_link = state
        if x_link is not None:  # x's gradient through the merge joins the maps' one dx
            return ops.post_merge(x_link, f, h_post, h_res, linked=True)
        return ops.post_merge(x, f, h_post, h_res)

    def _maps_and_input(self, ops, x: torch.Tensor):
        """(H_pre, H_post, H_res, branch input, x_link or None) under implementation ops."""
        raise NotImplementedError

    def no_weight_decay(self) -> set[str]:
        """Names (relative to this module) of the static maps and gates."""
        return set()

    def reset_parameters(self) -> None:
        """Give this connection's own parameters their documented initial values (the branch
        is left alone: it has its own). For a model built on the meta device and then moved
        with `to_empty`, and for parameters sharded by FSDP2 or TP (DTensors)."""

    def extra_repr(self) -> str:
        return f"dim={self.dim}, streams={self.streams}"


class Residual(_Connection):
    """The plain residual x + F(x) on a single stream: x [..., 1, C]."""

    kind = "residual"

    def __init__(self, dim: int, branch: Callable, layer_index: int = 0):
        super().__init__(dim, 1, branch)
        self.layer_index = _count(layer_index, "Residual", "layer_index", 0)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self._check_input(x)
        f = self.branch(x.squeeze(-2), *args, **kwargs)
        self._check_branch_output(f)
        return x + f.unsqueeze(-2)


class HyperConnection(_Connection):
    """Hyper-Connections (Zhu et al., arXiv 2409.19606), static or dynamic.

    Parameters in this library's convention (see functional.maps.hc_maps): static_pre = A_m,
    static_post = B, static_res = A_r^T; w = [W_beta | W_m | W_r] of shape [C, 2 + n].
    """

    kind = "hc"

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
        layer_index = _count(layer_index, "HyperConnection", "layer_index", 0)
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
        _assign(self.static_pre, torch.eye(n)[k])
        _assign(self.static_post, torch.ones(n))
        _assign(self.static_res, torch.eye(n))
        scale = 0.01 if self.dynamic else 0.0
        if self.w is not None:
            _assign(self.w, torch.zeros(self.dim, 2 + n))
        _assign(self.s_alpha, torch.full((1,), scale))
        _assign(self.s_beta, torch.full((1,), scale))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints written before the scales became [1] hold them as 0-dim tensors.
        for name in ("s_alpha", "s_beta"):
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                state_dict[prefix + name] = value.reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def maps(self, x: torch.Tensor, with_pre: bool = False):
        """H_pre, H_post, H_res; with_pre=True appends the branch input sum_j H_pre[j] x[j]
        (one fused op where the implementation has one)."""
        ops = _ops.get_impl(self.impl, x.device, x.dtype)
        return (ops.hc_maps_pre if with_pre else ops.hc_maps)(*self._map_args(x))

    def _map_args(self, x: torch.Tensor) -> tuple:
        return (
            x, self.w, self.s_alpha.view(()), self.s_beta.view(()),
            self.static_pre, self.static_post, self.static_res, self.norm_eps,
        )

    def _maps_and_input(self, ops, x: torch.Tensor):
        if ops.links:  # x_link None: no single node was made, the merge runs unlinked
            return ops.hc_maps_pre(*self._map_args(x), link=True)
        return (*ops.hc_maps_pre(*self._map_args(x)), None)

    def no_weight_decay(self) -> set[str]:
        names = {"static_pre", "static_post", "static_res"}
        return names | ({"s_alpha", "s_beta"} if self.dynamic else set())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layer_index={self.layer_index}, dynamic={self.dynamic}"


class ManifoldHyperConnection(_Connection):
    """Manifold-Constrained Hyper-Connections (Xie et al., arXiv 2512.24880), Eq. 7-9.

    Parameters: phi [n*C, n*n + 2n] (the RMSNorm weight folded in), the gates
    alpha = (alpha_pre, alpha_post, alpha_res), the static biases b_pre [n], b_post [n],
    b_res [n, n]. `norm_eps`, `pre_eps` and `sinkhorn_eps` exist for DeepSeek-V4
    compatibility (integrations.deepseek_v4); the paper's algorithm has pre_eps = sinkhorn_eps = 0.
    """

    kind = "mhc"

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
        if not isinstance(sinkhorn_iters, int) or sinkhorn_iters < 1:
            raise ValueError(f"sinkhorn_iters must be >= 1, got {sinkhorn_iters!r}")
        n = self.streams
        layer_index = _count(layer_index, type(self).__name__, "layer_index", 0)
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
        _assign(self.phi, torch.zeros(self.phi.shape))
        _assign(self.alpha, torch.full((3,), self.gate_init))
        _assign(self.b_pre, _pre_bias(n, self.layer_index))
        _assign(self.b_post, torch.zeros(n))
        _assign(self.b_res, _res_bias(n, self.res_init_diag))

    def maps(self, x: torch.Tensor, with_pre: bool = False):
        """H_pre, H_post, H_res; with_pre=True appends the branch input sum_j H_pre[j] x[j]
        (one fused op where the implementation has one)."""
        ops = _ops.get_impl(self.impl, x.device, x.dtype)
        return (ops.mhc_maps_pre if with_pre else ops.mhc_maps)(*self._map_args(x))

    def _map_args(self, x: torch.Tensor) -> tuple:
        return (
            x, self.phi, self.alpha, self.b_pre, self.b_post, self.b_res,
            self.sinkhorn_iters, self.norm_eps, self.sinkhorn_eps, self.pre_eps,
        )

    def _maps_and_input(self, ops, x: torch.Tensor):
        if ops.links:
            return ops.mhc_maps_pre(*self._map_args(x), link=True)
        return (*ops.mhc_maps_pre(*self._map_args(x)), None)

    def no_weight_decay(self) -> set[str]:
        return {"alpha", "b_pre", "b_post", "b_res"}

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, layer_index={self.layer_index}, "
            f"sinkhorn_iters={self.sinkhorn_iters}"
        )


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    """param <- value (the full tensor, built on the CPU), in param's dtype and device.

    A DTensor parameter (FSDP2, TP) takes its own shard of value: every rank builds the same
    full value, so no rank needs to send anything (src_data_rank=None). A meta parameter stays
    meta (copying into it does nothing).
    """
    with torch.no_grad():
        if param.is_meta:
            return
        value = value.to(device=param.device, dtype=param.dtype)
        if _is_dtensor(param):
            from torch.distributed.tensor import distribute_tensor

            value = distribute_tensor(
                value, param.device_mesh, param.placements, src_data_rank=None
            )
        param.copy_(value)


def _is_dtensor(t: torch.Tensor) -> bool:
    # Checked by name first: importing torch.distributed.tensor for a plain tensor costs time.
    if type(t).__name__ != "DTensor":
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _pre_bias(n: int, layer_index: int) -> torch.Tensor:
    """b_pre with sigmoid(b_pre) = e_{k mod n} / 2 + 1 / (2n), which sums to 1."""
    p = torch.full((n,), 0.5 / n, dtype=torch.float64)
    p[layer_index % n] += 0.5
    return torch.logit(p.clamp(max=0.99)).float()


def _res_bias(n: int, diag: float) -> torch.Tensor:
    """b_res whose Sinkhorn projection is diag on the diagonal and equal elsewhere."""
    if n == 1:
        return torch.zeros(1, 1)
    return torch.eye(n) * math.log(diag * (n - 1) / (1.0 - diag))


def make_connection(
    kind: str, dim: int, streams: int, layer_index: int, branch: Callable, **kwargs
) -> nn.Module:
    """Build a connection from a string: one of CONNECTION_KINDS.

    `streams` is ignored for "residual" (always one stream); kwargs go to the class.
    """
    if kind == "residual":
        if kwargs:
            raise TypeError(
                f"make_connection: the residual takes no connection options, got "
                f"{sorted(kwargs)}"
            )
        return Residual(dim, branch, layer_index=layer_index)
    if kind == "hc":
        return HyperConnection(dim, streams, layer_index, branch, **kwargs)
    if kind == "mhc":
        return ManifoldHyperConnection(dim, streams, layer_index, branch, **kwargs)
    if kind in CONNECTION_KINDS:  # mhc-lite, kromhc, mhc-static-res
        from torch_mhc.connections.successors import make_variant

        return make_variant(kind, dim, streams, layer_index, branch, **kwargs)
    raise ValueError(f"unknown connection kind {kind!r}; expected one of {CONNECTION_KINDS}")


def param_groups(
    model: nn.Module, weight_decay: float = 0.1, extra_no_decay: Iterable[str] = ()
) -> list[dict]:
    """AdamW parameter groups: connection static maps and gates without weight decay.

    Also exempt (the usual practice for transformers): every parameter with fewer than two
    dimensions (biases, norm weights) and names listed in extra_no_decay.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"param_groups expects an nn.Module (the model; wrap a list of modules in "
            f"nn.ModuleList), got {type(model).__name__}"
        )
    no_decay_ids = set()
    for module in model.modules():
        if isinstance(module, _Connection):
            for name in module.no_weight_decay():
                no_decay_ids.add(id(getattr(module, name)))
    extra = set(extra_no_decay)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in no_decay_ids or p.dim() < 2 or name in extra:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
