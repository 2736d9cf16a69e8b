"""Sinkhorn-Knopp projection onto the doubly stochastic matrices (mHC paper, Eq. 9).

    M = exp(H~ - max(H~))                      # per matrix, the shift cancels below
    repeat `iters` times:  M <- M / colsum(M);  M <- M / rowsum(M)

Rows therefore sum to 1 exactly and columns approximately (the paper's observation that the
backward gain of a projected map deviates slightly from 1).

The autograd function saves only the input logits (n^2 numbers per matrix, not
iters * n^2): backward recomputes the iterates and runs the exact reverse of the unrolled
loop, so its gradient equals autograd through the loop. An optional implicit gradient
(differentiating the fixed point instead of the iterations) is provided as an approximation
that becomes exact as the iterates converge.

`eps` > 0 reproduces DeepSeek-V4's variant: `softmax + eps` as the first column step and
`+ eps` in every later denominator. With eps = 0 the two are identical: the first column
normalisation of exp(H~) is a column softmax.

All arithmetic runs in float32 (float64 stays float64); the result has the input's dtype.
"""

from __future__ import annotations

import torch

__all__ = ["sinkhorn", "sinkhorn_unrolled"]


def _check(logits: torch.Tensor, iters: int) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"sinkhorn expects a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"sinkhorn expects a floating-point tensor, got dtype {logits.dtype}")
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(
            f"sinkhorn expects square matrices of shape [..., n, n], got {tuple(logits.shape)}"
        )
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"sinkhorn expects iters >= 1, got {iters!r}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def sinkhorn_unrolled(logits: torch.Tensor, iters: int = 20, eps: float = 0.0) -> torch.Tensor:
    """Eq. 9 written as plain torch ops; autograd differentiates through every iteration.

    This is the definition the fast paths are tested against. logits: [..., n, n].
    """
    _check(logits, iters)
    m = logits.to(_compute_dtype(logits.dtype))
    m = torch.softmax(m, dim=-2) + eps  # exp(H~ - max) / colsum: the first column step
    m = m / (m.sum(dim=-1, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
    return m.to(logits.dtype)


def _forward_iterates(x: torch.Tensor, iters: int, eps: float):
    """Run Eq. 9 on x (compute dtype) and keep what the reverse pass needs.

    Returns the output and, per normalisation step, (output of the step, its denominator).
    """
    p0 = torch.softmax(x, dim=-2)
    m = p0 + eps
    steps = []
    for k in range(iters):
        if k > 0:
            d = m.sum(dim=-2, keepdim=True) + eps  # [..., 1, n]
            m = m / d
            steps.append((m, d))
        d = m.sum(dim=-1, keepdim=True) + eps  # [..., n, 1]
        m = m / d
        steps.append((m, d))
    return m, p0, steps


def _backward_unrolled(x: torch.Tensor, grad: torch.Tensor, iters: int, eps: float):
    """Exact reverse of the unrolled iterations, recomputed from the input."""
    _, p0, steps = _forward_iterates(x, iters, eps)
    g = grad
    # Each step is y = m / d with d the sum of m along one axis (plus eps), so
    # dL/dm = (dL/dy - sum_axis(dL/dy * y)) / d.
    for i in range(len(steps) - 1, -1, -1):
        y, d = steps[i]
        axis = -1 if d.shape[-1] == 1 else -2
        g = (g - (g * y).sum(dim=axis, keepdim=True)) / d
    # First step: column softmax (the +eps after it has unit derivative).
    return p0 * (g - (g * p0).sum(dim=-2, keepdim=True))


def _backward_implicit(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Gradient of the exact fixed point P = diag(u) exp(X) diag(v), evaluated at p.

    With P doubly stochastic, dP = P * (dX + a 1^T + 1 b^T) for the scaling perturbations
    a, b fixed by the row and column constraints. The adjoint gives
    dL/dX = P * (G - alpha 1^T - 1 beta^T), where
        alpha + P beta = rowsum(P * G),   P^T alpha + beta = colsum(P * G).
    Eliminating alpha: (I - P^T P) beta = colsum(P*G) - P^T rowsum(P*G). The system is
    singular along beta = 1 (alpha = -1 compensates); adding 1 1^T / n pins that direction.
    """
    n = p.shape[-1]
    pg = p * grad
    r = pg.sum(dim=-1)  # [..., n]
    c = pg.sum(dim=-2)  # [..., n]
    eye = torch.eye(n, dtype=p.dtype, device=p.device)
    a = eye - p.transpose(-1, -2) @ p + 1.0 / n
    rhs = c - (p.transpose(-1, -2) @ r.unsqueeze(-1)).squeeze(-1)
    beta = torch.linalg.solve(a, rhs)
    alpha = r - (p @ beta.unsqueeze(-1)).squeeze(-1)
    return p * (grad - alpha.unsqueeze(-1) - beta.unsqueeze(-2))


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, iters, eps, implicit):
        x = logits.to(_compute_dtype(logits.dtype))
        out, _, _ = _forward_iterates(x, iters, eps)
        ctx.iters, ctx.eps, ctx.implicit = iters, eps, implicit
        # Saved: the n x n input (or output for the implicit gradient), never the iterates.
        ctx.save_for_backward(out if implicit else logits)
        return out.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (saved,) = ctx.saved_tensors
        cdt = _compute_dtype(saved.dtype)
        g = grad_out.to(cdt)
        if ctx.implicit:
            grad_in = _backward_implicit(saved.to(cdt), g)
        else:
            grad_in = _backward_unrolled(saved.to(cdt), g, ctx.iters, ctx.eps)
        return grad_in.to(grad_out.dtype), None, None, None


def _sinkhorn_log(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Eq. 9 in the log domain: the same iterates, never forming exp of a large logit."""
    z = logits.to(_compute_dtype(logits.dtype))
    for _ in range(iters):
        z = z - torch.logsumexp(z, dim=-2, keepdim=True)
        z = z - torch.logsumexp(z, dim=-1, keepdim=True)
    return z.exp().to(logits.dtype)


def sinkhorn(
    logits: torch.Tensor,
    iters: int = 20,
    *,
    eps: float = 0.0,
    log_domain: bool = False,
    implicit_grad: bool = False,
) -> torch.Tensor:
    """Project logits [..., n, n] onto (nearly) doubly stochastic matrices, paper Eq. 9.

    Args:
        logits: unnormalised H~, any leading dimensions. bf16/fp16 are computed in fp32.
        iters: number of (column, row) normalisation pairs; the paper uses 20.
        eps: DeepSeek-V4's additive epsilon (0 for the paper's algorithm).
        log_domain: iterate on log M with logsumexp (autograd through the loop). The
            same function as the default path; use it when logits are large and fp32
            exp/normalise would lose the small entries to underflow.
        implicit_grad: differentiate the fixed point instead of the unrolled loop. An
            approximation: exact only when the iterates have converged.
    Returns:
        A tensor of logits' shape and dtype whose rows sum to 1 and columns to about 1.
    """
    _check(logits, iters)
    if log_domain:
        if eps != 0.0 or implicit_grad:
            raise ValueError("log_domain=True supports neither eps != 0 nor implicit_grad")
        return _sinkhorn_log(logits, iters)
    return _Sinkhorn.apply(logits, iters, float(eps), bool(implicit_grad))
