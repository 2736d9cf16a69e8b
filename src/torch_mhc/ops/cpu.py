"""The `cpu` implementation: the reference maths tuned for the CPU, same results to rounding.

Measured on a 2-core x86 CPU (benchmarks/NOTES_ops.md has the numbers and commands), the
overhead of a connection is memory traffic over [T, n, C] tensors, so everything here is
about fewer passes and fewer saved tensors:

- Map computation (autograd Function): one matmul gives the logits transposed, [M, T] with
  M = n*n + 2n, so the per-token epilogue (gates, Sinkhorn) works on rows of length T.
  Sinkhorn on [n, n, T] ("token-last") normalises with reductions over the outer axes, about
  ten times faster in torch than on [T, n, n]. The backward is written by hand and saves
  only x, phi, the logits and the RMS (M + 1 numbers per token besides x); Sinkhorn
  recomputes its iterates from the n x n logits.
- Pre-aggregation, post-merge and the maps' input gradient dx = coef * x + dz @ phi^T run
  as native loops (ops/cpu_native.py, C built on first import) registered as custom ops,
  for contiguous float32 and bfloat16 CPU tensors: one pass per op, bf16 converted in
  registers. Without a C compiler, or with TORCH_MHC_NATIVE=0, or for other dtypes, they
  are autograd Functions over batched matmuls (no [T, n, C] temporaries in the merge).

Dtypes follow the reference: maps are computed in float32 (float64 stays float64) and
returned in float32; aggregation and merge run in the streams' dtype (the native loops
accumulate in float32 and round once).
"""

from __future__ import annotations

import functools

import torch

from . import cpu_native as _native
from . import reference as _ref

__all__ = ["mhc_maps", "mhc_maps_pre", "hc_maps", "pre_aggregate", "post_merge", "sinkhorn"]

hc_maps = _ref.hc_maps  # HC's maps are a few small ops; nothing to fuse on the CPU


def _maps_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# Sinkhorn on token-last matrices m[i, j, t]
# ---------------------------------------------------------------------------------------------


def _sinkhorn_fwd_tl(h: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Paper Eq. 9 on h [n, n, T]: column softmax (+ eps), rows, then (columns, rows)
    iters - 1 times, in place on the softmax's output (h is not modified)."""
    m = torch.softmax(h, dim=0)  # the first column step
    if eps:
        m.add_(eps)
    for k in range(iters):
        if k:
            m.div_(m.sum(dim=0, keepdim=True).add_(eps) if eps else m.sum(dim=0, keepdim=True))
        m.div_(m.sum(dim=1, keepdim=True).add_(eps) if eps else m.sum(dim=1, keepdim=True))
    return m


def _sinkhorn_bwd_tl(h: torch.Tensor, g: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Exact reverse of the unrolled loop on token-last h, g [n, n, T]; recomputes iterates."""
    p0 = torch.softmax(h, dim=0)
    m = p0 + eps if eps else p0
    steps = []  # (axis, output of the step, its denominator)
    for k in range(iters):
        for axis in ((0, 1) if k else (1,)):
            d = m.sum(dim=axis, keepdim=True)
            if eps:
                d = d + eps
            m = m / d
            steps.append((axis, m, d))
    # Each step is y = m / d with d the sum of m along `axis`: dL/dm = (g - sum(g * y)) / d.
    for axis, y, d in reversed(steps):
        g = (g - (g * y).sum(dim=axis, keepdim=True)) / d
    return p0 * (g - (g * p0).sum(dim=0, keepdim=True))  # column softmax


def _to_token_last(m: torch.Tensor) -> torch.Tensor:
    """[T, n, n] -> contiguous [n, n, T]."""
    return m.permute(1, 2, 0).contiguous()



def _no_autocast(fn):
    """Run an autograd Function's forward/backward with CPU autocast off: the ops choose
    their own precision (maps in fp32, streams in their dtype), as they do without it."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.autocast("cpu", enabled=False):
            return fn(*args, **kwargs)

    return wrapper


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    @_no_autocast
    def forward(ctx, logits, iters, eps):
        cdt = _maps_dtype(logits.dtype)
        n = logits.shape[-1]
        h = _to_token_last(logits.reshape(-1, n, n).to(cdt))  # [n, n, T]
        ctx.save_for_backward(h)
        ctx.iters, ctx.eps = iters, eps
        out = _sinkhorn_fwd_tl(h, iters, eps).permute(2, 0, 1)  # [T, n, n]
        return out.reshape(logits.shape).to(logits.dtype)

    @staticmethod
    @_no_autocast
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        n = h.shape[0]
        g = _to_token_last(grad.reshape(-1, n, n).to(h.dtype))
        dh = _sinkhorn_bwd_tl(h, g, ctx.iters, ctx.eps).permute(2, 0, 1)
        return dh.reshape(grad.shape).to(grad.dtype), None, None


def sinkhorn(logits: torch.Tensor, iters: int = 20, *, eps: float = 0.0) -> torch.Tensor:
    """Same as torch_mhc.sinkhorn(logits, iters, eps=eps), computed token-last."""
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"sinkhorn expects matrices [..., n, n], got {tuple(logits.shape)}")
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"sinkhorn expects iters >= 1, got {iters!r}")
    return _Sinkhorn.apply(logits, iters, float(eps))


# ---------------------------------------------------------------------------------------------
# (a) mHC maps
# ---------------------------------------------------------------------------------------------


class _MhcMaps(torch.autograd.Function):
    """Maps of x [T, n, C] (any float dtype), in the maps dtype; with_pre=True also returns
    the pre-aggregation a = sum_j H_pre[j] x[j] in x's dtype.

    With the aggregation inside, the backward writes dx once: coef * x + dz @ phi^T (the
    maps' share) + H_pre[j] da (the aggregation's share), instead of autograd adding two
    [T, n, C] gradients.
    """

    @staticmethod
    @_no_autocast
    def forward(ctx, x, phi, alpha, b_pre, b_post, b_res, iters, norm_eps, sk_eps, pre_eps,
                with_pre):
        t, n, c = x.shape
        k = n * c
        cdt = _maps_dtype(x.dtype)
        v = x.reshape(t, k).to(cdt)  # [T, K], a view for fp32 streams
        phi_c = phi.to(cdt)
        # Logits transposed, [M, T]: the epilogue then works on contiguous rows of length T.
        lt = torch.mm(phi_c.t(), v.t())  # [M, T] = (v @ phi)^T
        r = torch.linalg.vector_norm(v, dim=-1).square_().div_(k).add_(norm_eps).sqrt_()  # [T]
        lt.div_(r)  # divide after the matmul (section 4.3)
        a_rows = _alpha_rows(alpha.to(cdt), n)  # [M, 1]: alpha_pre, alpha_post, alpha_res
        b_rows = _bias_rows(b_pre, b_post, b_res, cdt)  # [M, 1]
        ht = torch.addcmul(b_rows, lt, a_rows)  # [M, T] gate logits H~
        h_pre = torch.sigmoid(ht[:n])  # [n, T]
        if pre_eps:
            h_pre.add_(pre_eps)
        h_post = torch.sigmoid(ht[n : 2 * n]).mul_(2.0)  # [n, T]
        h_res = _sinkhorn_fwd_tl(ht[2 * n :].reshape(n, n, t), iters, sk_eps)  # [n, n, T]
        # Saved: the logits and the RMS, M + 1 numbers per token besides x and the parameters.
        ctx.save_for_backward(x, phi, alpha, lt, r, ht, a_rows)
        ctx.iters, ctx.sk_eps, ctx.pre_eps = iters, sk_eps, pre_eps
        ctx.b_dtypes = (b_pre.dtype, b_post.dtype, b_res.dtype)
        # Token-last results seen as [T, ...]; consumers that need contiguity copy (tiny).
        maps = (h_pre.t(), h_post.t(), h_res.permute(2, 0, 1))
        if not with_pre:
            return maps
        return (*maps, _pre_forward(x, h_pre.t()))

    @staticmethod
    @_no_autocast
    def backward(ctx, g_pre, g_post, g_res, g_a=None):
        x, phi, alpha, lt, r, ht, a_rows = ctx.saved_tensors
        b_dtypes = ctx.b_dtypes
        t, n, c = x.shape
        k = n * c
        cdt = lt.dtype
        s = torch.sigmoid(ht[: 2 * n])  # [2n, T]: pre rows, then post rows
        h_pre = s[:n].t() + ctx.pre_eps  # [T, n]
        if g_a is not None:  # the aggregation's share of dL/dH_pre
            dh = _pre_dh(x, g_a)
            g_pre = dh if g_pre is None else g_pre + dh
        d_ht = torch.zeros_like(ht)  # [M, T] dL/dH~
        ds = s * (1.0 - s)
        if g_pre is not None:
            d_ht[:n] = g_pre.t() * ds[:n]
        if g_post is not None:
            d_ht[n : 2 * n] = g_post.t() * ds[n:] * 2.0
        if g_res is not None:
            g = _to_token_last(g_res.to(cdt))
            h = ht[2 * n :].reshape(n, n, t)
            d_ht[2 * n :] = _sinkhorn_bwd_tl(h, g, ctx.iters, ctx.sk_eps).reshape(n * n, t)
        d_b = d_ht.sum(dim=1)  # [M]
        d_a_rows = (d_ht * lt).sum(dim=1)  # [M]
        d_alpha = torch.stack(
            [d_a_rows[:n].sum(), d_a_rows[n : 2 * n].sum(), d_a_rows[2 * n :].sum()]
        )
        d_lt = d_ht.mul_(a_rows)  # [M, T] dL/dlogits
        # logits = z / r with r = sqrt(mean(v^2) + eps): dL/dv = dz @ phi^T + coef * v.
        coef = (d_lt * lt).sum(dim=0).div_(r.square()).div_(-k)  # [T]
        d_zt = d_lt.div_(r)  # [M, T]
        v = x.reshape(t, k).to(cdt)
        phi_c = phi.to(cdt)
        if _use_native(x):  # one pass: x (and da) in, dx out in x's dtype
            ga = None if g_a is None else g_a.to(x.dtype).contiguous()
            dx = torch.ops.torch_mhc.cpu_maps_dx(
                x.contiguous(), d_zt.t().contiguous(), phi_c.t().contiguous(), coef,
                h_pre.to(torch.float32).contiguous(), ga,
            )
        else:
            dv = torch.mm(d_zt.t(), phi_c.t()).addcmul_(v, coef.unsqueeze(-1))  # [T, K]
            if g_a is not None:
                dv.view(t, n, c).addcmul_(h_pre.unsqueeze(-1), g_a.to(cdt).unsqueeze(-2))
            dx = dv.reshape(t, n, c).to(x.dtype)
        d_phi = torch.mm(d_zt, v).t()  # [K, M]
        return (
            dx,
            d_phi.to(phi.dtype),
            d_alpha.to(alpha.dtype),
            d_b[:n].to(b_dtypes[0]),
            d_b[n : 2 * n].to(b_dtypes[1]),
            d_b[2 * n :].reshape(n, n).to(b_dtypes[2]),
            None, None, None, None, None,
        )


def _pre_forward(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """sum_j h[t, j] x[t, j] for x [T, n, C], h [T, n] (maps dtype), no autograd."""
    if _use_native(x):
        return torch.ops.torch_mhc.cpu_pre_aggregate_fwd(
            x.contiguous(), h.to(torch.float32).contiguous()
        )
    return torch.bmm(h.to(x.dtype).unsqueeze(-2), x).squeeze(-2)


def _pre_dh(x: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """dL/dh of the pre-aggregation: <x[t, j], da[t]> -> [T, n] in the maps dtype."""
    if _use_native(x):
        return torch.ops.torch_mhc.cpu_pre_aggregate_dh(x.contiguous(), da.to(x.dtype).contiguous())
    return _rowdot(x, da.to(x.dtype)).to(_maps_dtype(x.dtype))


def _alpha_rows(alpha: torch.Tensor, n: int) -> torch.Tensor:
    """[3] -> [M, 1]: alpha_pre on n rows, alpha_post on n rows, alpha_res on n*n rows."""
    return torch.cat([alpha[0].expand(n), alpha[1].expand(n), alpha[2].expand(n * n)]).unsqueeze(-1)


def _bias_rows(b_pre, b_post, b_res, dtype) -> torch.Tensor:
    """The static biases as one column [M, 1] in the logits' row order."""
    return torch.cat([b_pre.to(dtype), b_post.to(dtype), b_res.reshape(-1).to(dtype)]).unsqueeze(-1)


def mhc_maps(
    x: torch.Tensor,
    phi: torch.Tensor,
    alpha: torch.Tensor,
    b_pre: torch.Tensor,
    b_post: torch.Tensor,
    b_res: torch.Tensor,
    sinkhorn_iters: int = 20,
    norm_eps: float = 1e-6,
    sinkhorn_eps: float = 0.0,
    pre_eps: float = 0.0,
):
    """Same contract as ops.reference.mhc_maps."""
    lead, (n, c) = x.shape[:-2], x.shape[-2:]
    h_pre, h_post, h_res = _MhcMaps.apply(
        x.reshape(-1, n, c), phi, alpha, b_pre, b_post, b_res,
        int(sinkhorn_iters), float(norm_eps), float(sinkhorn_eps), float(pre_eps), False,
    )
    return h_pre.reshape(*lead, n), h_post.reshape(*lead, n), h_res.reshape(*lead, n, n)


def mhc_maps_pre(
    x: torch.Tensor,
    phi: torch.Tensor,
    alpha: torch.Tensor,
    b_pre: torch.Tensor,
    b_post: torch.Tensor,
    b_res: torch.Tensor,
    sinkhorn_iters: int = 20,
    norm_eps: float = 1e-6,
    sinkhorn_eps: float = 0.0,
    pre_eps: float = 0.0,
):
    """mhc_maps plus pre_aggregate(x, H_pre) as one autograd node (one dx in backward)."""
    lead, (n, c) = x.shape[:-2], x.shape[-2:]
    h_pre, h_post, h_res, a = _MhcMaps.apply(
        x.reshape(-1, n, c), phi, alpha, b_pre, b_post, b_res,
        int(sinkhorn_iters), float(norm_eps), float(sinkhorn_eps), float(pre_eps), True,
    )
    return (
        h_pre.reshape(*lead, n), h_post.reshape(*lead, n), h_res.reshape(*lead, n, n),
        a.reshape(*lead, c),
    )


# ---------------------------------------------------------------------------------------------
# (b) pre-aggregation and (c) post-and-merge
# ---------------------------------------------------------------------------------------------


class _PreAggregate(torch.autograd.Function):
    """a = sum_j H_pre[j] x[j] on x [T, n, C], h [T, n] (h already in x's dtype)."""

    @staticmethod
    @_no_autocast
    def forward(ctx, x, h):
        h3 = h.unsqueeze(-2).contiguous()  # [T, 1, n]
        ctx.save_for_backward(x, h3)
        return torch.bmm(h3, x).squeeze(-2)  # [T, C]

    @staticmethod
    @_no_autocast
    def backward(ctx, grad):
        x, h3 = ctx.saved_tensors
        dx = dh = None
        if ctx.needs_input_grad[0]:
            dx = h3.transpose(-1, -2) * grad.unsqueeze(-2)  # [T, n, C], the outer product
        if ctx.needs_input_grad[1]:
            dh = _rowdot(x, grad)  # [T, n]
        return dx, dh


class _PostMerge(torch.autograd.Function):
    """out = H_res x + H_post^T f on x [T, n, C], f [T, C], h_post [T, n], h_res [T, n, n]."""

    @staticmethod
    @_no_autocast
    def forward(ctx, x, f, h_post, h_res):
        n = x.shape[1]
        hh = torch.cat([h_res, h_post.unsqueeze(-1)], dim=-1)  # [T, n, n + 1]: [H_res | H_post]
        ctx.save_for_backward(x, f, hh)
        out = torch.bmm(hh[..., :n], x)  # [T, n, C]
        return out.addcmul_(hh[..., n:], f.unsqueeze(-2))  # + H_post f, in place

    @staticmethod
    @_no_autocast
    def backward(ctx, grad):
        x, f, hh = ctx.saved_tensors
        n = x.shape[1]
        dx = df = dh_post = dh_res = None
        # dx as its own contiguous tensor (not a slice of a [T, n + 1, C] product): autograd
        # then sums the three gradients of x in place instead of copying.
        if ctx.needs_input_grad[0]:
            dx = torch.bmm(hh[..., :n].transpose(-1, -2), grad)  # [T, n, C] H_res^T g
        if ctx.needs_input_grad[1]:
            df = torch.bmm(hh[..., n:].transpose(-1, -2), grad).squeeze(-2)  # [T, C] H_post^T g
        if ctx.needs_input_grad[2]:
            dh_post = _rowdot(grad, f)  # [T, n]
        if ctx.needs_input_grad[3]:
            dh_res = torch.bmm(grad, x.transpose(-1, -2))  # [T, n, n]
        return dx, df, dh_post, dh_res


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_c a[t, i, c] b[t, c] for a [T, n, C], b [T, C] -> [T, n].

    Written as [T, 1, C] @ [T, C, n], which measured three times faster than
    [T, n, C] @ [T, C, 1] on the CPU (the batched matmul then has a long inner loop).
    """
    return torch.bmm(b.unsqueeze(-2), a.transpose(-1, -2)).squeeze(-2)


# The native loops (ops/cpu_native.py) as custom ops, so torch.compile sees opaque calls with
# fake implementations instead of ctypes. Used for contiguous fp32/bf16 CPU tensors when the
# library built; everything else takes the autograd Functions above.

_NATIVE = _native.load()


@torch.library.custom_op("torch_mhc::cpu_pre_aggregate_fwd", mutates_args=())
def _native_pre_fwd(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return _NATIVE.pre_fwd(x, h)


@_native_pre_fwd.register_fake
def _(x, h):
    return x.new_empty((x.shape[0], x.shape[2]))


@torch.library.custom_op("torch_mhc::cpu_pre_aggregate_bwd", mutates_args=())
def _native_pre_bwd(
    x: torch.Tensor, h: torch.Tensor, da: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _NATIVE.pre_bwd(x, h, da)


@_native_pre_bwd.register_fake
def _(x, h, da):
    return torch.empty_like(x), torch.empty_like(h)


def _native_pre_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _native_pre_backward(ctx, da):
    x, h = ctx.saved_tensors
    return torch.ops.torch_mhc.cpu_pre_aggregate_bwd(x, h, da.to(x.dtype).contiguous())


_native_pre_fwd.register_autograd(_native_pre_backward, setup_context=_native_pre_setup)


@torch.library.custom_op("torch_mhc::cpu_post_merge_fwd", mutates_args=())
def _native_merge_fwd(
    x: torch.Tensor, f: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor
) -> torch.Tensor:
    return _NATIVE.merge_fwd(x, f, h_post, h_res)


@_native_merge_fwd.register_fake
def _(x, f, h_post, h_res):
    return torch.empty_like(x)


@torch.library.custom_op("torch_mhc::cpu_post_merge_bwd", mutates_args=())
def _native_merge_bwd(
    x: torch.Tensor, f: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor,
    g: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _NATIVE.merge_bwd(x, f, h_post, h_res, g)


@_native_merge_bwd.register_fake
def _(x, f, h_post, h_res, g):
    return (
        torch.empty_like(x), torch.empty_like(f),
        torch.empty_like(h_post), torch.empty_like(h_res),
    )


def _native_merge_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _native_merge_backward(ctx, g):
    x, f, h_post, h_res = ctx.saved_tensors
    return torch.ops.torch_mhc.cpu_post_merge_bwd(
        x, f, h_post, h_res, g.to(x.dtype).contiguous()
    )


_native_merge_fwd.register_autograd(_native_merge_backward, setup_context=_native_merge_setup)


@torch.library.custom_op("torch_mhc::cpu_maps_dx", mutates_args=())
def _native_maps_dx(
    x: torch.Tensor, dz: torch.Tensor, phit: torch.Tensor, coef: torch.Tensor,
    h_pre: torch.Tensor | None, ga: torch.Tensor | None,
) -> torch.Tensor:
    """dx = coef * x + dz @ phi^T (+ h_pre[j] ga on stream j): x [T, n, C], dz [T, M],
    phit [M, n*C], coef [T], h_pre [T, n], ga [T, C]."""
    return _NATIVE.maps_dx(x, dz, phit, coef, h_pre, ga)


@_native_maps_dx.register_fake
def _(x, dz, phit, coef, h_pre, ga):
    return torch.empty_like(x)


@torch.library.custom_op("torch_mhc::cpu_pre_aggregate_dh", mutates_args=())
def _native_pre_dh(x: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """dh[t, j] = <x[t, j], da[t]> in float32 (the pre-aggregation's dL/dH_pre)."""
    return _NATIVE.pre_dh(x, da)


@_native_pre_dh.register_fake
def _(x, da):
    return x.new_empty((x.shape[0], x.shape[1]), dtype=torch.float32)


def _use_native(x: torch.Tensor) -> bool:
    return _NATIVE is not None and _native.supports(x)


def _check_streams(x: torch.Tensor, what: str) -> None:
    if x.dim() < 2:
        raise ValueError(f"{what} expects streams x [..., n, C], got shape {tuple(x.shape)}")


def pre_aggregate(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    """sum_j H_pre[j] x[j]: [..., n, C], [..., n] -> [..., C] in x's dtype."""
    _check_streams(x, "pre_aggregate")
    lead, (n, c) = x.shape[:-2], x.shape[-2:]
    if h_pre.shape != x.shape[:-1]:
        raise ValueError(
            f"pre_aggregate expects h_pre of shape {tuple(x.shape[:-1])}, got {tuple(h_pre.shape)}"
        )
    if _use_native(x):
        h = h_pre.reshape(-1, n).to(torch.float32).contiguous()
        return _native_pre_fwd(x.reshape(-1, n, c).contiguous(), h).reshape(*lead, c)
    h = h_pre.to(x.dtype).reshape(-1, n)
    return _PreAggregate.apply(x.reshape(-1, n, c), h).reshape(*lead, c)


def post_merge(
    x: torch.Tensor, f: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor
) -> torch.Tensor:
    """H_res x + H_post^T f: [..., n, C], [..., C], [..., n], [..., n, n] -> [..., n, C]."""
    _check_streams(x, "post_merge")
    lead, (n, c) = x.shape[:-2], x.shape[-2:]
    expected = {"f": (*lead, c), "h_post": (*lead, n), "h_res": (*lead, n, n)}
    for name, tensor in (("f", f), ("h_post", h_post), ("h_res", h_res)):
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"post_merge expects {name} of shape {expected[name]} for x of shape "
                f"{tuple(x.shape)}, got {tuple(tensor.shape)}"
            )
    if _use_native(x):
        out = _native_merge_fwd(
            x.reshape(-1, n, c).contiguous(),
            f.to(x.dtype).reshape(-1, c).contiguous(),
            h_post.reshape(-1, n).to(torch.float32).contiguous(),
            h_res.reshape(-1, n, n).to(torch.float32).contiguous(),
        )
        return out.reshape(x.shape)
    out = _PostMerge.apply(
        x.reshape(-1, n, c),
        f.to(x.dtype).reshape(-1, c),
        h_post.to(x.dtype).reshape(-1, n),
        h_res.to(x.dtype).reshape(-1, n, n),
    )
    return out.reshape(x.shape)
