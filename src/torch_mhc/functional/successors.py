"""The H_res maps of mHC's successors, in plain torch (autograd differentiates them).

mHC-lite mixes all n! permutation matrices with softmax weights; KromHC takes the Kronecker
product of m = log2 n doubly stochastic 2 x 2 factors. Both are doubly stochastic exactly,
without an iteration; the modules around them are in torch_mhc.connections.successors.
"""

from __future__ import annotations

import itertools

import torch

__all__ = ["kromhc_res", "kronecker_pattern", "mhc_lite_res", "permutation_matrices"]


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
    return (a @ perms.to(a.dtype).flatten(-2)).unflatten(-1, perms.shape[-2:])


def kromhc_res(z: torch.Tensor, same: torch.Tensor) -> torch.Tensor:
    """A_1 (x) ... (x) A_m with A_k = a_k I + (1 - a_k) S, a = sigmoid(z): z [..., m],
    same [m, n, n] (kronecker_pattern) -> [..., n, n]. Entry (i, j) is the product over k of
    a_k where bit k of i and j agree and 1 - a_k where they differ."""
    a = torch.sigmoid(z)[..., :, None, None]  # [..., m, 1, 1]
    s = same.to(a.dtype)
    factors = s * a + (1.0 - s) * (1.0 - a)  # [..., m, n, n]
    if factors.shape[-3] == 0:  # n = 1: the empty product
        return torch.ones(*z.shape[:-1], 1, 1, dtype=z.dtype, device=z.device)
    return factors.prod(dim=-3)
