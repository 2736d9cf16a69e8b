"""Sinkhorn-Knopp projection onto the doubly stochastic matrices (mHC paper, Eq. 9).

    M = exp(H~ - max(H~))                      # per matrix, the shift cancels below
    repeat `iters` times:  M <- M / colsum(M);  M <- M / rowsum(M)

What holds after `iters` iterations. The last step normalises rows, so every row sums to 1
up to rounding (measured <= 2.4e-7 in float32, 4.4e-16 in float64). The entries are >= 0, so
every column sum lies in [0, n] and |column sum - 1| <= n - 1, and that is the only bound
that holds for every input: columns converge towards 1 at a rate set by the spread
S = max - min of the matrix's logits, not by rounding (float64 gives the same errors). The
iteration is a geometric contraction whose ratio is bounded by tanh(S / 2) (Birkhoff-Hopf:
exp(H~)'s projective diameter is <= 2 S), fast for small S and no guarantee once S is tens.
Where exp(H~) is nearly zero in places the error decays like 1 / iters instead: for
[[0, 0], [0, -S]] with S >= 32 it is 1 / (2 iters + 1) (1/41 after 20 iterations). Measured
max |column sum - 1| after 20 iterations over 10,000 4 x 4 matrices of logits uniform on
[0, S], float32 (tests/functional/test_sinkhorn.py): 1.2e-7 (rounding) for S = 1, 3.1e-4
for S = 4, 0.026 for S = 8, 0.26 for S = 32, 1.0 for S = 64, 1.98 for S = 100 and 2.0 for
S = 200, while the median matrix's error stays below 0.05 up to S = 200. The backward
gain of a projected map (its largest column sum) therefore deviates from 1 by up to this
column error (the paper's observation), which the connection health reports per layer
(runtime.diagnostics, max_abs_colsum_error).

Finite wherever the exact answer is. In float32 the direct iteration underflows when a
matrix's logits are far apart: for [[100, 100], [-100, -100]] the first column step gives
[[1, 1], [e^-200, e^-200]] = [[1, 1], [0, 0]] and the row step then divides 0 by 0, while
the exact answer is 0.5 everywhere. (A row shift is not an invariance of the finite unrolled
loop, since the first column step sees it; so the cure is to avoid the underflow, not to
shift.) Every implementation (this module, functional.maps, ops.cpu and its native loops,
ops.triton) therefore picks, per matrix, one of two evaluations of the SAME unrolled
function, and differentiates the one it picked exactly:

    linear domain   when  max(H~) - min(H~) <= LINEAR_RANGE (= 32) and for eps > 0:
                    the iteration above (column softmax, then divisions);
    log domain      otherwise: Z = H~, then 2 iters times Z <- Z - logsumexp(Z) along
                    columns, then rows; the result is exp(Z). Its backward, with
                    G' = G * exp(Z_final), runs the steps in reverse:
                    G' <- G' - exp(Z_step) * sum(G') along that step's axis.

Why 32: after any normalisation the iterate is diag(a) exp(H~) diag(b) with the ratios of a
(or b) bounded by exp(range), so every entry is >= exp(-2 range) / n: >= 2e-30 for range 32
and n <= 64, far above float32's smallest normal number (1.2e-38, so flush-to-zero modes do
not matter), with eight orders of magnitude left for the backward's divisions by these
entries. Measured against a float64 log-domain evaluation on random and two-level logits
(n = 2..16, ranges up to 45): the linear float32 result stays finite and is as accurate as
the log-domain float32 one, forward (<= 8e-7) and backward. With eps > 0 (DeepSeek-V4's
variant) every denominator is >= eps, so the linear domain never divides by zero and is
always used. The common case (trained mHC logits span a few units) costs one min/max per
matrix more than the linear domain alone.

The autograd function saves only the input logits (n^2 numbers per matrix, not
iters * n^2): backward recomputes the iterates and runs the exact reverse of the unrolled
loop, so its gradient equals autograd through the loop. Under torch.compile (and torch.func
transforms) autograd runs through the loop itself instead: the same gradient, without the
autograd function, whose compiled backward torch 2.11 got wrong (`sinkhorn` says how). An
optional implicit gradient (differentiating the fixed point instead of the iterations) is
provided as an approximation that becomes exact as the iterates converge.

`eps` > 0 reproduces DeepSeek-V4's variant: `softmax + eps` as the first column step and
`+ eps` in every later denominator. With eps = 0 the two are identical: the first column
normalisation of exp(H~) is a column softmax.

All arithmetic runs in float32 (float64 stays float64); the result has the input's dtype.
`sinkhorn_forward` / `sinkhorn_backward` take the axes of the matrices (ops.cpu runs them on
token-last [n, n, T] tensors), and are the only torch definition of the iterations.
"""

from __future__ import annotations

import math

import torch

__all__ = ["LINEAR_RANGE", "compute_dtype", "func_transform_active", "sinkhorn",
           "sinkhorn_backward", "sinkhorn_forward", "sinkhorn_unrolled"]

LINEAR_RANGE = 32.0  # per matrix, max - min of the logits iterated in the linear domain

# The axes (i, j) of the matrices in a tensor: rows are indexed along i, columns along j.
# A column step sums over i, a row step over j.
Dims = tuple[int, int]


def _check(logits: torch.Tensor, iters: int, eps: float = 0.0) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"sinkhorn expects a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"sinkhorn expects a floating-point tensor, got dtype {logits.dtype}")
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(
            f"sinkhorn expects square matrices of shape [..., n, n], got {tuple(logits.shape)}"
        )
    if isinstance(iters, bool) or not isinstance(iters, int):  # True would run once
        raise TypeError(f"sinkhorn expects iters to be an int, got {iters!r} "
                        f"({type(iters).__name__})")
    if iters < 1:
        raise ValueError(f"sinkhorn expects iters >= 1, got {iters!r}")
    # A negative eps can zero a row's or column's denominator; an infinite one makes every
    # entry inf / inf = NaN.
    if not (eps >= 0.0 and math.isfinite(eps)):
        raise ValueError(f"sinkhorn expects a finite eps >= 0, got {eps!r}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype maps and Sinkhorn are computed in: float32, float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def sinkhorn_unrolled(logits: torch.Tensor, iters: int = 20, eps: float = 0.0) -> torch.Tensor:
    """Eq. 9 written as plain torch ops in the linear domain; autograd differentiates through
    every iteration. The textbook definition the fast paths are tested against on logits
    whose range is small (it underflows to NaN where the module docstring says). [..., n, n]
    """
    _check(logits, iters, eps)
    m = logits.to(compute_dtype(logits.dtype))
    m = torch.softmax(m, dim=-2) + eps  # exp(H~ - max) / colsum: the first column step
    m = m / (m.sum(dim=-1, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
    return m.to(logits.dtype)


def _step_axes(iters: int, dims: Dims) -> list[int]:
    """The summed axis of each of the 2 iters normalisations: columns first."""
    return [dims[0], dims[1]] * iters


def _linear_iterates(h: torch.Tensor, iters: int, eps: float, dims: Dims, keep: bool):
    """The linear-domain loop on h; returns (output, p0, [(axis, step output, denominator)])
    with the steps kept only when keep (the backward's recomputation)."""
    p0 = torch.softmax(h, dim=dims[0])  # the first column step
    m = p0 + eps if eps else p0  # the keep path never writes in place
    steps = []
    for axis in _step_axes(iters, dims)[1:]:
        d = m.sum(dim=axis, keepdim=True)
        if eps:
            d = d.add_(eps)
        if keep:
            m = m / d
            steps.append((axis, m, d))
        else:
            m = m.div_(d)
    return m, p0, steps


def _linear_backward(h, g, iters, eps, dims):
    """Exact reverse of the linear-domain loop, recomputed from h: (dL/dh, the loop's output)."""
    _, p0, steps = _linear_iterates(h, iters, eps, dims, keep=True)
    # Each step is y = m / d with d the sum of m along one axis (plus eps), so
    # dL/dm = (dL/dy - sum_axis(dL/dy * y)) / d.
    for axis, y, d in reversed(steps):
        g = (g - (g * y).sum(dim=axis, keepdim=True)) / d
    # First step: column softmax (the +eps after it has unit derivative).
    return p0 * (g - (g * p0).sum(dim=dims[0], keepdim=True)), steps[-1][1]


def _log_iterates(h: torch.Tensor, iters: int, dims: Dims, keep: bool):
    """The log-domain loop: (exp of the final Z, [(axis, exp of each step's Z)] if keep)."""
    z, steps = h, []
    for axis in _step_axes(iters, dims):
        z = torch.log_softmax(z, dim=axis)  # z - logsumexp(z), max subtracted first
        if keep:
            steps.append((axis, z.exp()))
    return z.exp(), steps


def _log_backward(h, g, iters, dims):
    """Exact reverse of the log-domain loop: Z' = Z - logsumexp(Z) has the adjoint
    dZ = dZ' - softmax(Z) sum(dZ'), with softmax(Z) = exp(Z'). Returns (dL/dh, the output)."""
    out, steps = _log_iterates(h, iters, dims, keep=True)
    g = g * out  # through exp
    for axis, p in reversed(steps):
        g = g - p * g.sum(dim=axis, keepdim=True)
    return g, out


_interpreter = torch._C._functorch.peek_interpreter_stack  # innermost transform, or None


def func_transform_active() -> bool:
    """Whether a torch.func transform (vmap, grad, jacrev, ...) runs the caller: its wrapped
    tensors have no data to branch on nor memory for a kernel to read, and it takes no
    autograd.Function without rules of its own. The interpreter stack is read first (one C
    call, for hot paths); under Dynamo it reads as a transform, and is_compiling answers."""
    return _interpreter() is not None and not torch.compiler.is_compiling()


def _data_free(t: torch.Tensor) -> bool:
    """Whether to compute without data-dependent branches or shapes: under torch.compile,
    and where the data cannot be read (meta tensors, FakeTensorMode's fakes, other
    subclasses, torch.func's transformed tensors); every matrix then runs both domains and
    the mask picks."""
    return (torch.compiler.is_compiling() or type(t) is not torch.Tensor or t.is_meta
            or func_transform_active())


def _far(h: torch.Tensor, eps: float, dims: Dims) -> torch.Tensor | None:
    """Mask of the matrices to iterate in the log domain (size 1 along dims), or None
    when all take the linear domain; always a mask where _data_free."""
    if eps:
        return None
    spread = h.amax(dim=dims, keepdim=True) - h.amin(dim=dims, keepdim=True)
    far = ~(spread <= LINEAR_RANGE)  # NaN logits count as far
    if _data_free(far) or bool(far.any()):
        return far
    return None


def _far_index(far: torch.Tensor, dims: Dims) -> torch.Tensor:
    """Indices of the far matrices among h's matrices in [..., n, n] order."""
    return far.movedim(dims, (-2, -1)).reshape(-1).nonzero().squeeze(1)


def _take(t: torch.Tensor, index: torch.Tensor, dims: Dims) -> torch.Tensor:
    """The matrices of t at index, as [F, n, n]."""
    moved = t.movedim(dims, (-2, -1))
    return moved.reshape(-1, *moved.shape[-2:])[index]


def _put(t: torch.Tensor, index: torch.Tensor, dims: Dims, values: torch.Tensor):
    """t with its matrices at index replaced by values [F, n, n] (a new tensor)."""
    moved = t.movedim(dims, (-2, -1))
    flat = moved.reshape(-1, *moved.shape[-2:]).clone()
    flat[index] = values
    return flat.reshape(moved.shape).movedim((-2, -1), dims)


def sinkhorn_forward(h: torch.Tensor, iters: int, eps: float = 0.0,
                     dims: Dims = (-2, -1), differentiable: bool = False) -> torch.Tensor:
    """Eq. 9 on the matrices of h (compute dtype) along dims, each in its domain (module
    docstring). No autograd (the loop divides in place): pair with sinkhorn_backward, or
    pass differentiable=True for a loop autograd can run through. The far matrices enter the
    linear loop as zeros (the uniform matrix: no 0 / 0) and their log-domain values replace
    them; eager runs the log domain on those matrices only, a compiled graph (and meta or
    fake tensors) on all (no data-dependent shapes)."""
    far = _far(h, eps, dims)
    keep = differentiable  # the loop that keeps its steps writes nothing in place
    if far is None:
        return _linear_iterates(h, iters, eps, dims, keep=keep)[0]
    out = _linear_iterates(torch.where(far, 0.0, h), iters, eps, dims, keep=keep)[0]
    if _data_free(far):
        log_out = _log_iterates(torch.where(far, h, 0.0), iters, dims, keep=False)[0]
        return torch.where(far, log_out, out)
    index = _far_index(far, dims)
    log_out = _log_iterates(_take(h, index, dims), iters, (-2, -1), keep=False)[0]
    return _put(out, index, dims, log_out)


def sinkhorn_backward(h: torch.Tensor, g: torch.Tensor, iters: int, eps: float = 0.0,
                      dims: Dims = (-2, -1), with_output: bool = False):
    """dL/dh for the upstream gradient g of sinkhorn_forward(h, iters, eps, dims): the exact
    reverse of the unrolled loop each matrix ran, recomputing the iterates. with_output:
    (dL/dh, sinkhorn_forward(h, ...)), the output the recomputation passes through anyway."""
    far = _far(h, eps, dims)
    if far is None:
        grad, out = _linear_backward(h, g, iters, eps, dims)
    elif _data_free(far):
        grad, out = _linear_backward(torch.where(far, 0.0, h), g, iters, eps, dims)
        log_grad, log_out = _log_backward(torch.where(far, h, 0.0), g, iters, dims)
        grad, out = torch.where(far, log_grad, grad), torch.where(far, log_out, out)
    else:
        grad, out = _linear_backward(torch.where(far, 0.0, h), g, iters, eps, dims)
        index = _far_index(far, dims)
        log_grad, log_out = _log_backward(_take(h, index, dims), _take(g, index, dims), iters,
                                          (-2, -1))
        grad = _put(grad, index, dims, log_grad)
        out = _put(out, index, dims, log_out) if with_output else out
    return (grad, out) if with_output else grad


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
        x = logits.to(compute_dtype(logits.dtype))
        out = sinkhorn_forward(x, iters, eps)
        ctx.iters, ctx.eps, ctx.implicit = iters, eps, implicit
        # Saved: the n x n input (or output for the implicit gradient), never the iterates.
        ctx.save_for_backward(out if implicit else logits)
        return out.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (saved,) = ctx.saved_tensors
        cdt = compute_dtype(saved.dtype)
        g = grad_out.to(cdt)
        if ctx.implicit:
            grad_in = _backward_implicit(saved.to(cdt), g)
        else:
            grad_in = sinkhorn_backward(saved.to(cdt), g, ctx.iters, ctx.eps)
        return grad_in.to(grad_out.dtype), None, None, None


def _sinkhorn_log(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Every matrix in the log domain, autograd through the loop."""
    z = logits.to(compute_dtype(logits.dtype))
    return _log_iterates(z, iters, (-2, -1), keep=False)[0].to(logits.dtype)


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
        log_domain: iterate every matrix on log M with logsumexp (autograd through the
            loop). The same function as the default path, which already takes the log
            domain for the matrices whose logits span more than LINEAR_RANGE.
        implicit_grad: differentiate the fixed point instead of the unrolled loop. An
            approximation: exact only when the iterates have converged. Under torch.compile
            it still runs through the autograd function, whose compiled backward gave zero
            gradients on torch 2.11 in its default mode (the implicit one was not tried
            there) and right ones on 2.13; the default gradient does not use it there.
    Returns:
        A tensor of logits' shape and dtype, entries >= 0, whose rows sum to 1 up to
        rounding; the columns' distance from 1 depends on the logits' spread (module
        docstring: below 1e-6 for spreads <= 1, up to n - 1 for spreads of 100 and more).
    """
    _check(logits, iters, eps)
    if log_domain:
        if eps != 0.0 or implicit_grad:
            raise ValueError("log_domain=True supports neither eps != 0 nor implicit_grad")
        return _sinkhorn_log(logits, iters)
    transform = func_transform_active()
    if transform or (torch.compiler.is_compiling() and not implicit_grad):
        # No autograd.Function there: the same loop, each matrix in its domain,
        # differentiated by autograd through it (the iterates are kept for backward, where
        # _Sinkhorn recomputes them; a compiled graph keeps or recomputes them as its
        # partitioner decides). Under torch.compile this is also a matter of correctness:
        # Dynamo of torch 2.11 traced _Sinkhorn's backward to zero gradients, with every
        # backend, on CUDA and CPU alike (2026-12-04, an H200 machine; torch 2.13 traced it
        # right).
        if implicit_grad:
            raise RuntimeError("sinkhorn(implicit_grad=True) does not run under torch.func "
                               "transforms (vmap, grad, ...); use the default gradient")
        x = logits.to(compute_dtype(logits.dtype))
        return sinkhorn_forward(x, iters, float(eps), differentiable=True).to(logits.dtype)
    return _Sinkhorn.apply(logits, iters, float(eps), bool(implicit_grad))
