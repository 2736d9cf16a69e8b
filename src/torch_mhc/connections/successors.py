"""mHC's successors: exactly doubly stochastic H_res without Sinkhorn, and a frozen H_res.

All three keep mHC's read and write maps (paper Eq. 7-8, section 4.3 ordering):

    v = flatten(x);  r = sqrt(mean(v^2) + eps);  logits = (v @ phi) / r     # [..., 2n + R]
    H_pre  = sigmoid(alpha_pre * logits[:n] + b_pre)
    H_post = 2 sigmoid(alpha_post * logits[n:2n] + b_post)

and differ in H_res, built from the last R logits z = alpha_res * logits[2n:] + b_res:

- "mhc-lite" (arXiv 2601.05732): H_res = sum_k a_k P_k over all n! permutation matrices,
  a = softmax(z), R = n!. A convex combination of permutations is doubly stochastic exactly
  (Birkhoff), so there is no iteration and no column error. n <= 5 (R = 120); beyond, n!
  logits per token outgrow the rest of the connection and the error says so.
- "kromhc" (arXiv 2601.21579): H_res = A_1 (x) A_2 (x) ... (x) A_m, m = log2 n, each factor
  A_k = a_k I + (1 - a_k) S (S the 2 x 2 swap), a = sigmoid(z), R = m. A Kronecker product
  of doubly stochastic matrices is doubly stochastic exactly. n must be a power of two.
- "mhc-static-res": H_res = I, fixed; R = 0 (no res logits, alpha = (alpha_pre,
  alpha_post)). The identity is the matrix a small-scale speedrun froze H_res to, and the
  only fixed choice that does not contract the streams: a fixed mixing matrix M != a
  permutation composes over L layers to M^L, which for mHC's initial I/2 + J/(2n) tends to
  J/n (every stream the mean: the collapse the diagnostics look for). With I the streams
  differ only through H_pre and H_post, so this kind measures what learning H_res is worth.

Initialisation (each starts as the Pre-Norm residual network, like mHC; see connections.base):
phi = 0, gates alpha = 0.01, H_pre = e_{k mod n} / 2 + 1 / (2n), H_post = 1, and H_res
doubly stochastic, so equal streams stay equal and F(h) is added once:
- mhc-lite: b_res = log(n! + 1) on the identity permutation, 0 elsewhere (up to a common
  shift that makes the difference exact in float32), so
  a_I = 1/2 + 1/(2 n!) and every other a_k = 1/(2 n!): H_res = I/2 + J/(2n), mHC's initial
  H_res exactly (the same start, so any difference comes from the parametrisation).
- kromhc: b_res = log 3, a_k = 3/4: each factor is I/2 + J/4, mHC's initial map for two
  streams ("half kept, half averaged" per factor). mHC's I/2 + J/(2n) is not a Kronecker
  product for n >= 4; per-factor halving gives diagonal (3/4)^m (9/16 for n = 4) and every
  entry a product of 3/4 and 1/4, exact in binary.
- mhc-static-res: H_res = I.

Ops: the maps are the op implementation's variant_maps_pre (torch_mhc.ops), the successor's
counterpart of mhc_maps_pre. On the CPU it is one autograd node on mHC's own native passes
with the kind's closed-form H_res in place of Sinkhorn (one pass over x forward, one
backward writing dx once, with the merge's share through fused_dx as mHC's), and decoding
without autograd takes mHC's two prepared native calls. On triton, mHC's matmul kernels run
with the kind's per-token maps kernel in place of Sinkhorn's (decoding: mHC's prepared
launches, ops/triton/decode.py); inductor composes the reference
maps (functional.successors) with its own aggregation and merge.
"""

from __future__ import annotations

import math
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
)
from torch_mhc.functional.maps import read_write_maps
from torch_mhc.functional.successors import (
    VARIANT_KINDS,
    check_variant,
    kromhc_res,
    kronecker_pattern,
    mhc_lite_res,
    permutation_matrices,
)

__all__ = [
    "VARIANT_KINDS",
    "KromHC",
    "MhcResVariant",
    "MHCLite",
    "MHCStaticRes",
    "make_variant",
]



class MhcResVariant(Connection):
    """mHC with another H_res: mHC's dynamic read/write maps plus `res_count` logits that each
    subclass maps to its own H_res (one base, so the successors differ in H_res only).

    Parameters: phi [n*C, 2n + R], alpha [3] ([2] when R = 0), b_pre [n], b_post [n] and,
    when R > 0, b_res [R].
    """

    def __init__(self, dim: int, streams: int, layer_index: int, branch: Callable,
                 gate_init: float = 0.01, norm_eps: float = 1e-6, check_finite: bool = False,
                 impl: str = "auto"):
        super().__init__(dim, streams, branch, check_finite, impl)
        n = self.streams
        check_mixing_streams(n, type(self).__name__)
        self.check_streams(n)
        r = self.res_count(n)
        layer_index = check_count(layer_index, type(self).__name__, "layer_index", 0)
        norm_eps = check_eps(norm_eps, type(self).__name__, "norm_eps", positive=True)
        gate_init = check_gate(gate_init, type(self).__name__)
        self.layer_index, self.norm_eps, self.gate_init = layer_index, norm_eps, float(gate_init)
        self.phi = nn.Parameter(torch.empty(n * self.dim, 2 * n + r))
        self.alpha = nn.Parameter(torch.empty(3 if r else 2))
        self.b_pre = nn.Parameter(torch.empty(n))
        self.b_post = nn.Parameter(torch.empty(n))
        if r:
            self.b_res = nn.Parameter(torch.empty(r))
        self._init_buffers()
        self.reset_parameters()

    def res_count(self, n: int) -> int:
        """R, the number of res logits per token."""
        raise NotImplementedError

    @classmethod
    def check_streams(cls, n: int) -> None:
        """Raise a ValueError if this kind cannot use n streams."""

    def _init_buffers(self) -> None:
        """Register the constant tensors H_res is built from (non-persistent)."""

    def _res_bias(self) -> torch.Tensor:
        """The initial b_res [R] (see the module docstring)."""
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """Re-apply the documented initialisation (also fills the constant buffers, so a
        module built on the meta device and moved with to_empty() is complete after it;
        DTensor shards take their part, as in connections.base.assign_parameter)."""
        n = self.streams
        self._fill_buffers()
        assign_parameter(self.phi, torch.zeros(self.phi.shape))
        assign_parameter(self.alpha, torch.full(self.alpha.shape, self.gate_init))
        assign_parameter(self.b_pre, pre_bias(n, self.layer_index))
        assign_parameter(self.b_post, torch.zeros(n))  # 2 sigmoid(0) = 1
        if hasattr(self, "b_res"):
            assign_parameter(self.b_res, self._res_bias())

    def _fill_buffers(self) -> None:
        pass

    def res_map(self, z: torch.Tensor) -> torch.Tensor:
        """H_res [..., n, n] from the scaled and biased res logits z [..., R]."""
        raise NotImplementedError

    def res_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """z = alpha_res * logits[2n:] + b_res [..., R] (None without res logits); for the
        health diagnostics (the logits whose exp the map takes)."""
        if not hasattr(self, "b_res"):
            return None
        _, _, rest = read_write_maps(x, self.phi, self.alpha, self.b_pre, self.b_post,
                                     self.norm_eps)
        return rest + self.b_res.to(rest.dtype)

    def maps(self, x: torch.Tensor, with_pre: bool = False):
        """H_pre, H_post, H_res; with_pre=True appends the branch input sum_j H_pre[j] x[j]."""
        ops = _ops.get_impl(self.impl, x.device, x.dtype)
        return (ops.variant_maps_pre if with_pre else ops.variant_maps)(*self.map_args(x))

    def map_args(self, x: torch.Tensor) -> tuple:
        """The arguments of ops.variant_maps (H_res built in float64 and rounded once there:
        functional.successors.variant_res says why)."""
        if self.res_count(self.streams):
            params = self.own_tensors(("phi", "alpha", "b_pre", "b_post", "b_res"))
        else:  # the static H_res has no b_res (asking for it would raise and catch an
            # AttributeError at every call)
            params = (*self.own_tensors(("phi", "alpha", "b_pre", "b_post")), None)
        return (self.kind, x, *params, self.norm_eps)

    def decode_args(self, x: torch.Tensor) -> tuple:
        """map_args without the kind (Ops.decoder takes x first and the kind apart)."""
        return self.map_args(x)[1:]

    def _maps_and_input(self, ops, x: torch.Tensor):
        if ops.fused_dx:
            return ops.variant_maps_pre(*self.map_args(x), fused_dx=True)
        return (*ops.variant_maps_pre(*self.map_args(x)), None)

    def no_weight_decay(self) -> set[str]:
        return {"alpha", "b_pre", "b_post"} | ({"b_res"} if hasattr(self, "b_res") else set())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layer_index={self.layer_index}"


class MHCLite(MhcResVariant):
    """mHC-lite (arXiv 2601.05732): H_res = sum_k softmax(z)_k P_k over all n! permutations."""

    kind = "mhc-lite"
    decode_kind = "mhc-lite"  # decoding: mHC's two prepared native calls (ops/cpu/decode.py)

    def res_count(self, n: int) -> int:
        return math.factorial(n)

    @classmethod
    def check_streams(cls, n: int) -> None:
        check_variant(cls.kind, n)

    def _init_buffers(self) -> None:
        self.register_buffer("perms", permutation_matrices(self.streams), persistent=False)

    def _fill_buffers(self) -> None:
        assign_parameter(self.perms, permutation_matrices(self.streams))

    def _res_bias(self) -> torch.Tensor:
        # identity first: logit log(n! + 1) above the rest, so a_I = 1/2 + 1/(2 n!) and every
        # other a_k = 1/(2 n!). softmax ignores a common shift: the rest get the tiny float32
        # number y = fl(fl(log(n! + 1)) - log(n! + 1)), which makes the float32 difference
        # exact to ~1e-14 (with 0 there, log's rounding moved the off-diagonals one ulp).
        k = math.factorial(self.streams)
        top = torch.tensor(math.log(k + 1), dtype=torch.float32, device="cpu")
        rest = (top.double() - math.log(k + 1)).float()
        return torch.cat([top[None], rest.expand(k - 1)])

    def res_map(self, z: torch.Tensor) -> torch.Tensor:
        return mhc_lite_res(z, self.perms)


class KromHC(MhcResVariant):
    """KromHC (arXiv 2601.21579): H_res = kron(A_1, ..., A_m), A_k = a_k I + (1 - a_k) S."""

    kind = "kromhc"
    decode_kind = "kromhc"  # decoding: mHC's two prepared native calls (ops/cpu/decode.py)

    def res_count(self, n: int) -> int:
        return n.bit_length() - 1

    @classmethod
    def check_streams(cls, n: int) -> None:
        check_variant(cls.kind, n)

    def _init_buffers(self) -> None:
        self.register_buffer("same", kronecker_pattern(self.streams), persistent=False)

    def _fill_buffers(self) -> None:
        assign_parameter(self.same, kronecker_pattern(self.streams))

    def _res_bias(self) -> torch.Tensor:
        return torch.full((self.res_count(self.streams),), math.log(3.0))  # a_k = 3/4

    def res_map(self, z: torch.Tensor) -> torch.Tensor:
        return kromhc_res(z, self.same)

    def res_logits(self, x: torch.Tensor) -> None:
        """None: the factors are sigmoids of one logit each, with no exp over a set of
        logits to underflow (the health diagnostics' logit range does not apply)."""
        return None


class MHCStaticRes(MhcResVariant):
    """mHC with H_res fixed to the identity: only H_pre and H_post are learned."""

    kind = "mhc-static-res"
    decode_kind = "mhc-static-res"  # decoding: mHC's two prepared native calls (ops/cpu/decode.py)

    def res_count(self, n: int) -> int:
        return 0

    def _init_buffers(self) -> None:
        self.register_buffer("h_res", torch.eye(self.streams), persistent=False)

    def _fill_buffers(self) -> None:
        assign_parameter(self.h_res, torch.eye(self.streams))

    def res_map(self, z: torch.Tensor) -> torch.Tensor:
        n = self.streams
        return self.h_res.to(z.dtype).expand(*z.shape[:-1], n, n)


_CLASSES = {cls.kind: cls for cls in (MHCLite, KromHC, MHCStaticRes)}


def make_variant(kind: str, dim: int, streams: int, layer_index: int, branch: Callable,
                 **kwargs) -> MhcResVariant:
    """Build one of VARIANT_KINDS (kwargs: gate_init, norm_eps, check_finite, impl)."""
    if kind not in _CLASSES:
        raise ValueError(f"unknown variant {kind!r}; expected one of {VARIANT_KINDS}")
    return _CLASSES[kind](dim, streams, layer_index, branch, **kwargs)
