"""The H_res maps of mHC's successors, in plain torch (autograd differentiates them).

mHC-lite mixes all n! permutation matrices with softmax weights; KromHC takes the Kronecker
product of m = log2 n doubly stochastic 2 x 2 factors. Both are doubly stochastic exactly,
without an iteration; the modules around them are in torch_mhc.connections.successors.

variant_maps / variant_maps_pre are the successors' whole maps (mHC's H_pre and H_post, the
kind's H_res) as one op, the definition that the ops implementations (torch_mhc.ops) match.
"""

from __future__ import annotations

import itertools
import math

import torch

from .maps import pre_aggregate, read_write_maps

__all__ = [
    "MHC_LITE_MAX_STREAMS",
    "VARIANT_KINDS",
    "check_variant",
    "kromhc_res",
    "kronecker_pattern",
    "mhc_lite_res",
    "permutation_matrices",
    "res_count",
    "variant_maps",
    "variant_maps_pre",
    "variant_res",
]

VARIANT_KINDS = ("mhc-lite", "kromhc", "mhc-static-res")
# n! logits per token: 120 at n = 5; beyond, they outgrow the rest of the connection.
MHC_LITE_MAX_STREAMS = 5
_FACTORIALS = tuple(math.factorial(k) for k in range(MHC_LITE_MAX_STREAMS + 1))


def permutation_matrices(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """All n! permutation matrices [n!, n, n], identity first: P_k[i, p_k(i)] = 1, so
    (P_k x)_i = x_{p_k(i)} (itertools.permutations order)."""
    perms = torch.tensor(list(itertools.permutations(range(n))), dtype=torch.long)  # [n!, n]
    return torch.nn.functional.one_hot(perms, n).to(dtype)


def kronecker_pattern(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """same[k, i, j] = 1 where bit k of i equals bit k of j (bit 0 the most significant, as
    torch.kron(A_1, A_2) indexes): [m, n, n] with m = log2 n."""
    m = n.bit_length() - 1
    idx = torch.arange(n)
    bits = (idx[:, None] >> torch.arange(m - 1, -1, -1)) & 1  # [n, m]
    return (bits.T[:, :, None] == bits.T[:, None, :]).to(dtype)


def mhc_lite_res(z: torch.Tensor, perms: torch.Tensor) -> torch.Tensor:
    """sum_k softmax(z)_k P_k: z [..., n!], perms [n!, n, n] -> [..., n, n]."""
    a = torch.softmax(z, dim=-1)
    return (a @ perms.to(a.device, a.dtype).flatten(-2)).unflatten(-1, perms.shape[-2:])


def kromhc_res(z: torch.Tensor, same: torch.Tensor) -> torch.Tensor:
    """A_1 (x) ... (x) A_m with A_k = a_k I + (1 - a_k) S, a = sigmoid(z): z [..., m],
    same [m, n, n] (kronecker_pattern) -> [..., n, n]. Entry (i, j) is the product over k of
    a_k where bit k of i and j agree and 1 - a_k where they differ."""
    a = torch.sigmoid(z)[..., :, None, None]  # [..., m, 1, 1]
    s = same.to(a.device, a.dtype)
    factors = s * a + (1.0 - s) * (1.0 - a)  # [..., m, n, n]
    if factors.shape[-3] == 0:  # n = 1: the empty product
        return torch.ones(*z.shape[:-1], 1, 1, dtype=z.dtype, device=z.device)
    return factors.prod(dim=-3)


def check_variant(kind: str, n: int) -> None:
    """Raise a ValueError if `kind` is not a successor or cannot use n streams."""
    if kind not in VARIANT_KINDS:
        raise ValueError(f"unknown variant {kind!r}; expected one of {VARIANT_KINDS}")
    if n < 1:
        raise ValueError(f"{kind} needs n >= 1 streams, got {n}")
    if kind == "mhc-lite" and n > MHC_LITE_MAX_STREAMS:
        raise ValueError(
            f"mhc-lite mixes all n! permutation matrices and supports n <= "
            f"{MHC_LITE_MAX_STREAMS} streams ({math.factorial(MHC_LITE_MAX_STREAMS)} "
            f"logits per token); got n = {n} ({math.factorial(n):,} permutations)"
        )
    if kind == "kromhc" and n & (n - 1):
        lo = 1 << (n.bit_length() - 1)
        raise ValueError(
            f"kromhc builds H_res as a Kronecker product of 2 x 2 factors and needs n a "
            f"power of two (1, 2, 4, 8, ...); got n = {n} (nearest: {lo} or {2 * lo})"
        )


def res_count(kind: str, n: int) -> int:
    """R, the res logits per token: n! (mhc-lite), log2 n (kromhc), 0 (mhc-static-res)."""
    check_variant(kind, n)
    if kind == "mhc-lite":
        # A table, not math.factorial: where torch.compile has made the stream dimension
        # dynamic (it does after recompiling for another n) n is a SymInt, which
        # math.factorial cannot take and indexing specializes on.
        return _FACTORIALS[n]
    # int(): under torch.jit.trace a shape read from a tensor is a traced value, not an int
    return int(n).bit_length() - 1 if kind == "kromhc" else 0


def variant_res(kind: str, z: torch.Tensor, n: int) -> torch.Tensor:
    """H_res [..., n, n] of kind from the scaled and biased res logits z [..., R], in z's dtype.

    Built in float64 and rounded once (n! or m numbers per token: negligible work): in
    float32 mHC-lite's 24-term mixtures sum rows to 1 - 6e-8 at init, a bias that compounds
    over depth; rounded once, the initial entries are exact (0.625, 0.125; 9/16 ...).
    """
    if kind == "mhc-static-res":
        return torch.eye(n, dtype=z.dtype, device=z.device).expand(*z.shape[:-1], n, n)
    wide = torch.float32 if z.device.type == "mps" else torch.float64  # MPS: no float64
    # Built per call (microseconds at n <= 5), not cached: torch.compile traces it to a constant
    table = (permutation_matrices if kind == "mhc-lite" else kronecker_pattern)(n, wide)
    table = table.to(z.device)
    res = mhc_lite_res if kind == "mhc-lite" else kromhc_res
    return res(z.to(wide), table).to(z.dtype)


def variant_maps(kind, x, phi, alpha, b_pre, b_post, b_res=None, norm_eps=1e-6):
    """H_pre [..., n], H_post [..., n], H_res [..., n, n] of an mHC successor.

    x: [..., n, C]; phi: [n*C, 2n + R] (R = res_count(kind, n)); alpha: [3] ([2] when R = 0);
    b_pre, b_post: [n]; b_res: [R] or None when R = 0. Maps in float32 (float64 stays float64).
    """
    n = x.shape[-2]
    check_variant(kind, n)
    h_pre, h_post, rest = read_write_maps(x, phi, alpha, b_pre, b_post, norm_eps)
    z = rest + b_res.to(rest.dtype) if b_res is not None else rest  # [..., R]
    return h_pre, h_post, variant_res(kind, z, n)


def variant_maps_pre(kind, x, phi, alpha, b_pre, b_post, b_res=None, norm_eps=1e-6):
    """variant_maps plus the branch input pre_aggregate(x, H_pre) [..., C]."""
    maps = variant_maps(kind, x, phi, alpha, b_pre, b_post, b_res, norm_eps)
    return (*maps, pre_aggregate(x, maps[0]))
