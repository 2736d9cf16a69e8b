"""The `cpu` implementation: the reference maths tuned for the CPU, same results to rounding.

Measured on a 2-core x86 CPU (benchmarks/NOTES_ops.md has the numbers and commands), the
overhead of a connection is memory traffic over [T, n, C] tensors and the two skinny
matmuls with phi, so everything here is about fewer passes and fewer saved tensors:

- Native loops (ops/cpu/native.c, built or found in the cache by the first native op) for
  contiguous float32 and bfloat16 CPU tensors with n <= 8, registered as custom ops:
  maps forward = x @ phi, the RMS, gates, Sinkhorn and the pre-aggregation in one pass per
  tile of tokens; maps backward = the aggregation's dH_pre, gates' and Sinkhorn's backward,
  dphi and dx in one pass; post-merge forward and backward. The autograd Functions call
  them through native_call: directly in plain eager mode, as the custom ops wherever
  something must see them (a compile trace, a dispatch mode, the profiler).
- One gradient write for x per connection. mhc_maps_pre(..., fused_dx=True) returns
  x_for_merge, a view of x made by the maps node; post_merge(x_for_merge, ...,
  fused_dx=True) hands its upstream gradient g to x_for_merge unchanged, and the maps'
  backward adds H_res^T g to its own dx (coef x + dz phi^T + H_pre[j] da) and <g_i, x_j> to
  H_res's gradient, so the merge's backward does not read x. ManifoldHyperConnection uses
  this pair (Ops.fused_dx).
- The backward saves only x, phi, the logits and the RMS (M + 1 numbers per token besides
  x); Sinkhorn recomputes its iterates from the n x n logits.
- HC's dynamic maps (hc_maps) use the native rows kernels: every stream row's logits
  x_j @ W in one pass over x, divided by the row's RMS afterwards (the reordering mHC uses),
  and a backward that writes dx = dz W^T + coef x once (a HyperConnection's forward +
  backward on [2048, 4, 512] streams: 97.9 ms with torch's per-stream RMSNorm and skinny
  matmuls, 22.6 ms with these; benchmarks/NOTES_ops.md). hc_maps_pre(..., fused_dx=True) makes
  HC's maps, aggregation and (through x_for_merge) merge one gradient write for x, as mHC's:
  its backward (NativeOps.hc_bwd) adds H_pre[j] da and H_res^T g to the rows' dx.
- Without autograd (decode under no_grad / inference_mode) mhc_maps_pre and post_merge call
  the native loops directly, skipping the autograd Function and the custom-op dispatch,
  in the caller's shapes, with phi's padded float32 copy cached while the parameters are
  unchanged; a merge of a few tokens keeps its output in cache (ordinary stores).
- Without a C compiler, with TORCH_MHC_NATIVE=0, for other dtypes or n > 8, the same
  autograd Functions run on torch ops (token-last Sinkhorn on [n, n, T], batched matmuls).

Dtypes follow the reference: maps are computed in float32 (float64 stays float64) and
returned in float32; aggregation and merge run in the streams' dtype (the native loops
accumulate in float32 and round once).
"""

from __future__ import annotations

import functools
import math
import weakref

import torch

from torch_mhc.functional import maps as _ref
from torch_mhc.functional.sinkhorn import compute_dtype as _maps_dtype
from torch_mhc.functional.sinkhorn import sinkhorn as _functional_sinkhorn
from torch_mhc.functional.sinkhorn import sinkhorn_backward, sinkhorn_forward
from torch_mhc.ops.checks import (
    check_hc_scalars,
    check_hc_shapes,
    check_maps_scalars,
    check_mhc_shapes,
    check_sinkhorn_scalars,
    first_derivatives_only,
)
from torch_mhc.ops.cpu import native as _native
from torch_mhc.runtime import param_updates

__all__ = ["mhc_maps", "mhc_maps_pre", "hc_maps", "hc_maps_pre", "pre_aggregate", "post_merge",
           "sinkhorn", "use_native", "mhc_tables", "hc_tables", "cached_tables",
           "dispatch_mode_active"]

# mhc_maps_pre(..., fused_dx=True) and post_merge(..., fused_dx=True) exist; see ops/__init__
FUSED_DX = True

# the fused backwards: first derivatives only (checks.first_derivatives_only)
_first_order = first_derivatives_only("cpu")


# ---------------------------------------------------------------------------------------------
# Sinkhorn on token-last matrices m[i, j, t]: functional.sinkhorn's iterations along dims (0, 1)
# ---------------------------------------------------------------------------------------------

TOKEN_LAST_DIMS = (0, 1)  # the matrix axes of a token-last [n, n, T] tensor


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
        out = sinkhorn_forward(h, iters, eps, TOKEN_LAST_DIMS).permute(2, 0, 1)  # [T, n, n]
        return out.reshape(logits.shape).to(logits.dtype)

    @staticmethod
    @_first_order
    @_no_autocast
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        n = h.shape[0]
        g = _to_token_last(grad.reshape(-1, n, n).to(h.dtype))
        dh = sinkhorn_backward(h, g, ctx.iters, ctx.eps, TOKEN_LAST_DIMS).permute(2, 0, 1)
        return dh.reshape(grad.shape).to(grad.dtype), None, None


def sinkhorn(logits: torch.Tensor, iters: int = 20, *, eps: float = 0.0) -> torch.Tensor:
    """Same as torch_mhc.sinkhorn(logits, iters, eps=eps), computed token-last."""
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"sinkhorn expects matrices [..., n, n], got {tuple(logits.shape)}")
    check_sinkhorn_scalars("sinkhorn", iters, eps)
    if torch.compiler.is_compiling():
        # the loop differentiated by autograd, as functional.sinkhorn does under compile (a
        # recomputing autograd function like this one compiled to a zero gradient on torch
        # 2.11); the compiled graph has no use for the token-last layout
        return _functional_sinkhorn(logits, int(iters), eps=float(eps))
    return _Sinkhorn.apply(logits, int(iters), float(eps))


# ---------------------------------------------------------------------------------------------
# (a) mHC maps
# ---------------------------------------------------------------------------------------------


class _MhcMaps(torch.autograd.Function):
    """Maps of x [T, n, C] (any float dtype), in the maps dtype; with_pre=True also returns
    the pre-aggregation a = sum_j H_pre[j] x[j] in x's dtype, and fused_dx=True (with
    with_pre) also returns `x_for_merge`, x itself as a view, for post_merge(...,
    fused_dx=True).

    With the aggregation inside, the backward writes dx once: coef * x + dz @ phi^T (the
    maps' share) + H_pre[j] da (the aggregation's share), instead of autograd adding two
    [T, n, C] gradients. fused_dx extends this to the merge: its backward hands the raw
    upstream gradient g of the merge to x_for_merge instead of computing H_res^T g and
    <g_i, x_j>, and this backward adds H_res^T g to the same dx and <g_i, x_j> to H_res's
    gradient (so x's gradient from the whole connection is one [T, n, C] write, and the
    merge's backward reads g and f, not x).
    """

    @staticmethod
    @_no_autocast
    def forward(ctx, x, phi, alpha, b_pre, b_post, b_res, iters, norm_eps, sk_eps, pre_eps,
                with_pre, fused_dx):
        ctx.set_materialize_grads(False)  # unused outputs' gradients arrive as None
        ctx.iters, ctx.sk_eps, ctx.pre_eps = iters, sk_eps, pre_eps
        ctx.with_pre, ctx.fused_dx = with_pre, fused_dx
        ctx.b_dtypes = (b_pre.dtype, b_post.dtype, b_res.dtype)
        ctx.native = use_native(x)
        if ctx.native:
            ab = _gate_table(alpha, b_pre, b_post, b_res)
            lt, r, h_pre, h_post, h_res, a = native_call(
                "cpu_mhc_maps_fwd", x, padded_table(phi, wide=True), ab, iters, norm_eps,
                sk_eps, pre_eps, with_pre)
            # Saved: the logits [T, M] and the RMS, M + 1 numbers per token besides x.
            ctx.save_for_backward(x, phi, alpha, lt, r, ab)
            maps = (h_pre, h_post, h_res)
        else:
            cdt = _maps_dtype(x.dtype)
            a_rows = _alpha_rows(alpha.to(cdt), x.shape[1])  # [M, 1]: alpha_pre, _post, _res
            b_rows = _bias_rows(b_pre, b_post, b_res, cdt)  # [M, 1]
            maps, a = _maps_forward_torch(ctx, x, phi, alpha, a_rows, b_rows, iters, norm_eps,
                                          sk_eps, pre_eps, with_pre)
        outs = (*maps, a) if with_pre else maps
        return (*outs, x.view_as(x)) if fused_dx else outs

    @staticmethod
    @_first_order
    @_no_autocast
    def backward(ctx, g_pre, g_post, g_res, *more):
        g_a = more[0] if ctx.with_pre else None
        g_merge = more[1] if ctx.fused_dx else None
        if ctx.native:
            return _maps_backward_native(ctx, g_pre, g_post, g_res, g_a, g_merge)
        return _maps_backward_torch(ctx, g_pre, g_post, g_res, g_a, g_merge)


def padded_table(phi: torch.Tensor, wide: bool = False) -> torch.Tensor:
    """phi [K, M] (or HC's W [C, M]) as float32 with its columns zero-padded to whole 8-float
    vectors (native.padded_width), or with wide to whole vectors of the library's widest
    skinny matmul (16 floats where build.py asks for them: Intel's AVX-512, AMD's from Zen 5;
    the training forward's many tokens run faster on the wider vectors, one decoded token on
    the unpadded bytes; native.c's xphi_tile16). The autograd forward pads wide; calls
    without autograd (decoding, a no-grad prefill) share one cached narrow copy."""
    m = phi.shape[1]
    lib = _native.load() if wide else None
    width = lib.skinny_width if lib is not None else 8
    # contiguous: the native loops read rows of [K, Mp]; pad by 0 may return phi's own strides
    return torch.nn.functional.pad(
        phi.to(torch.float32), (0, _native.padded_width(m, width) - m)
    ).contiguous()


def _gate_table(alpha, b_pre, b_post, b_res) -> torch.Tensor:
    """[2, M] float32: each logit row's gate (alpha_pre, alpha_post or alpha_res), then its
    static bias, for the native loops."""
    f32 = torch.float32
    return torch.cat(
        [_alpha_rows(alpha.to(f32), b_pre.shape[0]), _bias_rows(b_pre, b_post, b_res, f32)],
        dim=1,
    ).t().contiguous()


def _parameter_grads(ctx, d_ht: torch.Tensor, lt: torch.Tensor, n: int, alpha_dtype):
    """db_pre, db_post, db_res, dalpha from dL/dH~ and the logits, both [T, M]."""
    d_b = d_ht.sum(dim=0)  # [M]
    d_a_rows = (d_ht * lt).sum(dim=0)  # [M]
    d_alpha = torch.stack(
        [d_a_rows[:n].sum(), d_a_rows[n : 2 * n].sum(), d_a_rows[2 * n :].sum()]
    )
    b_dtypes = ctx.b_dtypes
    return (
        d_alpha.to(alpha_dtype),
        d_b[:n].to(b_dtypes[0]),
        d_b[n : 2 * n].to(b_dtypes[1]),
        d_b[2 * n :].reshape(n, n).to(b_dtypes[2]),
    )


def contiguous_or_none(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype).contiguous()


def _maps_backward_native(ctx, g_pre, g_post, g_res, g_a, g_merge):
    x, phi, alpha, lt, r, ab = ctx.saved_tensors
    n = x.shape[1]
    f32 = torch.float32
    dx, d_ht, d_phi = native_call(
        "cpu_mhc_maps_bwd", x, phi.to(f32), ab, lt, r,
        contiguous_or_none(g_pre, f32), contiguous_or_none(g_post, f32),
        contiguous_or_none(g_res, f32), contiguous_or_none(g_a, x.dtype),
        contiguous_or_none(g_merge, x.dtype), ctx.iters, ctx.sk_eps, ctx.pre_eps,
    )
    return (dx, d_phi.to(phi.dtype), *_parameter_grads(ctx, d_ht, lt, n, alpha.dtype),
            None, None, None, None, None, None)


def _maps_forward_torch(ctx, x, phi, alpha, a_rows, b_rows, iters, norm_eps, sk_eps, pre_eps,
                        with_pre):
    """The maps in torch ops, token-last: one matmul gives the logits transposed [M, T], so
    the gates and Sinkhorn work on contiguous rows of length T."""
    t, n, c = x.shape
    k = n * c
    cdt = a_rows.dtype
    v = x.reshape(t, k).to(cdt)  # [T, K], a view for fp32 streams
    lt = torch.mm(phi.to(cdt).t(), v.t())  # [M, T] = (v @ phi)^T
    r = torch.linalg.vector_norm(v, dim=-1).square_().div_(k).add_(norm_eps).sqrt_()  # [T]
    lt.div_(r)  # divide after the matmul (section 4.3)
    ht = torch.addcmul(b_rows, lt, a_rows)  # [M, T] gate logits H~
    h_pre = torch.sigmoid(ht[:n])  # [n, T]
    if pre_eps:
        h_pre.add_(pre_eps)
    h_post = torch.sigmoid(ht[n : 2 * n]).mul_(2.0)  # [n, T]
    h_res = sinkhorn_forward(ht[2 * n :].reshape(n, n, t), iters, sk_eps,
                             TOKEN_LAST_DIMS)  # [n, n, T]
    # Saved: the logits and the RMS, M + 1 numbers per token besides x and the parameters.
    ctx.save_for_backward(x, phi, alpha, lt, r, ht, a_rows)
    # Token-last results seen as [T, ...]; consumers that need contiguity copy (tiny).
    maps = (h_pre.t(), h_post.t(), h_res.permute(2, 0, 1))
    return maps, (_pre_forward(x, h_pre.t()) if with_pre else None)


def _maps_backward_torch(ctx, g_pre, g_post, g_res, g_a, g_merge):
    x, phi, alpha, lt, r, ht, a_rows = ctx.saved_tensors
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
    h = ht[2 * n :].reshape(n, n, t)
    if g_merge is not None:  # the merge's dH_res = <g_i, x_j>, [T, n, n]
        dh = torch.bmm(g_merge.to(x.dtype), x.transpose(-1, -2)).to(cdt)
        g_res = dh if g_res is None else g_res + dh
    if g_res is not None:
        g = _to_token_last(g_res.to(cdt))
        # The recomputation passes through H_res: kept for the merge's H_res^T g below.
        d_res, h_res = sinkhorn_backward(h, g, ctx.iters, ctx.sk_eps, TOKEN_LAST_DIMS,
                                         with_output=True)
        d_ht[2 * n :] = d_res.reshape(n * n, t)
    params = _parameter_grads(ctx, d_ht.t(), lt.t(), n, alpha.dtype)
    d_lt = d_ht.mul_(a_rows)  # [M, T] dL/dlogits
    # logits = z / r with r = sqrt(mean(v^2) + eps): dL/dv = dz @ phi^T + coef * v.
    coef = (d_lt * lt).sum(dim=0).div_(r.square()).div_(-k)  # [T]
    d_zt = d_lt.div_(r)  # [M, T]
    v = x.reshape(t, k).to(cdt)
    phi_c = phi.to(cdt)
    dv = torch.mm(d_zt.t(), phi_c.t()).addcmul_(v, coef.unsqueeze(-1))  # [T, K]
    dv3 = dv.view(t, n, c)
    if g_a is not None:
        dv3.addcmul_(h_pre.unsqueeze(-1), g_a.to(cdt).unsqueeze(-2))
    if g_merge is not None:  # the merge's H_res^T g
        dv3.baddbmm_(h_res.permute(2, 1, 0), g_merge.to(cdt))  # H_res [n, n, T] as [T, j, i]
    d_phi = torch.mm(d_zt, v).t()  # [K, M]
    return (dv3.to(x.dtype), d_phi.to(phi.dtype), *params,
            None, None, None, None, None, None)


def _pre_forward(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """sum_j h[t, j] x[t, j] for x [T, n, C], h [T, n] (maps dtype), no autograd."""
    return torch.bmm(h.to(x.dtype).unsqueeze(-2), x).squeeze(-2)


def _pre_dh(x: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """dL/dh of the pre-aggregation: <x[t, j], da[t]> -> [T, n] in the maps dtype."""
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
    """Same contract as functional.maps.mhc_maps."""
    check_maps_scalars("mhc_maps", sinkhorn_iters, norm_eps, sinkhorn_eps, pre_eps)
    check_mhc_shapes("mhc_maps", x, phi, alpha, b_pre, b_post, b_res)
    lead, (n, c) = x.shape[:-2], x.shape[-2:]
    h_pre, h_post, h_res = _MhcMaps.apply(
        x.reshape(-1, n, c), phi, alpha, b_pre, b_post, b_res,
        int(sinkhorn_iters), float(norm_eps), float(sinkhorn_eps), float(pre_eps), False, False,
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
    *,
    fused_dx: bool = False,
):
    """mhc_maps plus pre_aggregate(x, H_pre) as one autograd node (one dx in backward).

    fused_dx=True appends x_for_merge (x's values) to pass to post_merge(x_for_merge, ...,
    fused_dx=True) in place of x: the merge's share of x's gradient then joins the same single dx.
    """
    check_maps_scalars("mhc_maps_pre", sinkhorn_iters, norm_eps, sinkhorn_eps, pre_eps)
    check_mhc_shapes("mhc_maps_pre", x, phi, alpha, b_pre, b_post, b_res)
    params = (phi, alpha, b_pre, b_post, b_res)
    if no_autograd(x, *params) and use_native(x):
        # Decoding: the maps in x's leading shape straight from the native loops; x_for_merge
        # is x itself (without autograd there is no gradient to fuse).
        phip, ab = cached_tables(mhc_tables, *params)
        maps = _lib().maps_infer(x.contiguous(), phip, ab, int(sinkhorn_iters),
                                 float(norm_eps), float(sinkhorn_eps), float(pre_eps))
        return (*maps, x) if fused_dx else maps
    lead, (n, c) = x.shape[:-2], x.shape[-2:]
    outs = _MhcMaps.apply(
        x.reshape(-1, n, c), *params,
        int(sinkhorn_iters), float(norm_eps), float(sinkhorn_eps), float(pre_eps), True,
        fused_dx,
    )
    h_pre, h_post, h_res, a = outs[:4]
    maps = (
        h_pre.reshape(*lead, n), h_post.reshape(*lead, n), h_res.reshape(*lead, n, n),
        a.reshape(*lead, c),
    )
    # x_for_merge: the autograd node's view of x
    return (*maps, outs[4].reshape(x.shape)) if fused_dx else maps


# Inference (decode): no autograd graph, so the native loops are called directly, without
# the autograd Function, the custom-op dispatch and the reshapes to [T, ...] and back (most
# of a decode step's connection time at one token), and phi's padded copy is reused while
# the parameters are unchanged.


def no_autograd(*tensors: torch.Tensor) -> bool:
    """No gradient can be needed (no_grad / inference mode, or nothing requires grad) and
    plain_eager(tensors)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return plain_eager(tensors)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain_eager(tensors) -> bool:
    """Every tensor a plain CPU tensor (meta, fake and wrapped tensors have no memory for
    the loops: the custom ops' dispatch takes them), and no torch.compile trace, dispatch
    mode or torch.jit trace running (they must see the custom ops): the native functions
    may be called directly."""
    # is_compiling first: a compile trace then reaches nothing else here (native_call asks
    # the profiler after this, which Dynamo cannot trace)
    if torch.compiler.is_compiling():
        return False
    if not all(type(t) in _PLAIN and t.device.type == "cpu" for t in tensors):
        return False
    return not (dispatch_mode_active() or torch.jit.is_tracing())


def dispatch_mode_active() -> bool:
    """Whether a TorchDispatchMode is active (FakeTensorMode, FlopCounterMode, ...): it must
    see the custom ops, which direct native calls would hide from it (and under
    FakeTensorMode the parameters' tables would be fake, with no memory to read)."""
    return torch._C._len_torch_dispatch_stack() > 0


# id(phi or W) -> (make, weak references to the tensors, their versions, tables); an entry
# leaves with its phi or W.
_param_cache: dict[int, tuple] = {}


def cached_tables(make, *tensors: torch.Tensor) -> tuple:
    """make(*tensors), cached per first tensor (phi, HC's W) while every tensor is the same
    object (a view counts as its base: HC passes s_alpha.view(()) at each call) with the same
    version (an in-place update bumps it, in a view or its base alike) over the same
    storage, and no optimizer has stepped since (a fused one bumps no version:
    runtime.param_updates)."""
    try:  # `param.data = ...` swaps the storage without a new version: both are compared
        versions = [param_updates.current(), *((t._version, t.data_ptr()) for t in tensors)]
    except RuntimeError:  # inference tensors have no version counter: nothing to key on
        return make(*tensors)
    bases = [t if t._base is None else t._base for t in tensors]
    hit = _param_cache.get(id(bases[0]))
    if (hit is not None and hit[0] is make and hit[2] == versions
            and all(r() is b for r, b in zip(hit[1], bases, strict=True))):
        return hit[3]
    tables = make(*tensors)
    ident = id(bases[0])
    refs = [weakref.ref(bases[0], lambda _, ident=ident: _param_cache.pop(ident, None)),
            *[weakref.ref(b) for b in bases[1:]]]
    _param_cache[ident] = (make, refs, versions, tables)
    return tables


def mhc_tables(phi, alpha, b_pre, b_post, b_res, *, wide: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(phi padded [K, Mp], gate table [2, M]) in float32 for the native maps (wide: the
    training forward's padding, padded_table)."""
    return padded_table(phi, wide), _gate_table(alpha, b_pre, b_post, b_res)


def hc_tables(w, s_alpha, s_beta, static_pre, static_post, static_res):
    """(W padded [C, Mp], (s_alpha, s_beta, static_pre, static_post, static_res) as one
    float32 vector) for the native HC maps."""
    scalars = [s_alpha.reshape(1), s_beta.reshape(1), static_pre, static_post,
               static_res.reshape(-1)]
    return padded_table(w), torch.cat([t.to(torch.float32) for t in scalars])


# ---------------------------------------------------------------------------------------------
# (a') HC maps
# ---------------------------------------------------------------------------------------------


class _HcMaps(torch.autograd.Function):
    """functional.maps.hc_maps for x [T, n, C] with a dynamic W [C, n + 2], on the native rows
    kernels: u = (x_j @ W) / rms(x_j) per stream row (= norm(x_j) @ W), d = tanh(u), then the
    maps from d as in the reference. Saves x, the RMS [T n] and u, d [T n, n + 2]."""

    @staticmethod
    @_no_autocast
    def forward(ctx, x, w, s_alpha, s_beta, static_pre, static_post, static_res, norm_eps):
        ctx.set_materialize_grads(False)
        maps, (r, u, d) = _hc_maps_values(
            x, padded_table(w), s_alpha, s_beta, static_pre, static_post, static_res, norm_eps
        )
        ctx.save_for_backward(x, w, s_alpha, s_beta, r, u, d)
        ctx.static_dtypes = (static_pre.dtype, static_post.dtype, static_res.dtype)
        return maps

    @staticmethod
    @_first_order
    @_no_autocast
    def backward(ctx, g_pre, g_post, g_res):
        x, w, s_alpha, s_beta, r, u, d = ctx.saved_tensors
        t, n, c = x.shape
        m, f32 = n + 2, torch.float32
        sa, sb = s_alpha.to(f32), s_beta.to(f32)
        d3 = d.view(t, n, m)
        dd = torch.zeros_like(d3)  # dL/dd [T, n, M]
        d_sa = torch.zeros((), dtype=f32)
        d_sb = torch.zeros((), dtype=f32)
        d_static = [None, None, None]
        if g_post is not None:
            g_post = g_post.to(f32)
            dd[..., 0] = sb * g_post
            d_sb = (g_post * d3[..., 0]).sum()
            d_static[1] = g_post.sum(dim=0).to(ctx.static_dtypes[1])
        if g_pre is not None:
            g_pre = g_pre.to(f32)
            dd[..., 1] = sa * g_pre
            d_sa = d_sa + (g_pre * d3[..., 1]).sum()
            d_static[0] = g_pre.sum(dim=0).to(ctx.static_dtypes[0])
        if g_res is not None:
            g_t = g_res.to(f32).transpose(-1, -2)  # [T, j, i]: stream j's row of d
            dd[..., 2:] = sa * g_t
            d_sa = d_sa + (g_t * d3[..., 2:]).sum()
            d_static[2] = g_res.to(f32).sum(dim=0).to(ctx.static_dtypes[2])
        du = dd.view(t * n, m).mul_(1.0 - d * d)  # dL/du, tanh's derivative
        # u = z / r with r = sqrt(mean(x_j^2) + eps): dL/dx_j = dz W^T + coef x_j.
        coef = (du * u).sum(dim=-1).div_(r.square()).div_(-c)  # [T n]
        dz = torch.nn.functional.pad(du / r.unsqueeze(-1), (0, _native.padded_width(m) - m))
        dx, dw = native_call("cpu_rows_bwd", x.view(t * n, c), w.to(f32).t().contiguous(),
                             dz, coef)
        return (dx.view(t, n, c), dw.to(w.dtype), d_sa.to(s_alpha.dtype),
                d_sb.to(s_beta.dtype), *d_static, None)


_HC_NATIVE_MIN_TOKENS = 16


def _hc_maps_values(x, wp, s_alpha, s_beta, static_pre, static_post, static_res, norm_eps):
    """((H_pre, H_post, H_res), (r, u, d)) for x [T, n, C] and W padded [C, Mp] on the rows
    kernel, keeping what the backward needs."""
    t, n, c = x.shape
    m = n + 2
    z, ss = native_call("cpu_rows_fwd", x.view(t * n, c), wp)
    r = ss.div_(c).add_(norm_eps).sqrt_()  # [T n] the rows' RMS
    u = z[:, :m] / r.unsqueeze(-1)  # [T n, M]
    d = torch.tanh(u)
    maps = _ref.hc_maps_from_tanh(d.view(t, n, m), s_alpha, s_beta, static_pre, static_post,
                                  static_res)
    return maps, (r, u, d)


def hc_maps(
    x: torch.Tensor,
    w: torch.Tensor | None,
    s_alpha: torch.Tensor,
    s_beta: torch.Tensor,
    static_pre: torch.Tensor,
    static_post: torch.Tensor,
    static_res: torch.Tensor,
    norm_eps: float = 1e-6,
):
    """Same contract as functional.maps.hc_maps; dynamic maps of fp32/bf16 streams run on the
    native loops, everything else on the reference. Without autograd (decoding) that is one
    call of native.c's hc_fwd; with autograd, the rows kernels from
    _HC_NATIVE_MIN_TOKENS tokens on and the reference's few torch ops below (the rows
    kernels' fixed cost: one token's maps take 78 us on them and 49 us on the reference's
    ops, 16 tokens 87 and 97 us; n = 4, C = 512, measured without autograd)."""
    check_hc_scalars("hc_maps", norm_eps)
    args = (w, s_alpha, s_beta, static_pre, static_post, static_res)
    check_hc_shapes("hc_maps", x, *args)
    if _hc_native(x, w, 1) and no_autograd(x, *args):
        return _hc_inference(x, args, norm_eps, False)
    if not _hc_native(x, w):
        return _ref.hc_maps(x, *args, norm_eps)
    lead, (n, c) = x.shape[:-2], x.shape[-2:]
    h_pre, h_post, h_res = _HcMaps.apply(x.reshape(-1, n, c).contiguous(), *args,
                                         float(norm_eps))
    return h_pre.view(*lead, n), h_post.view(*lead, n), h_res.view(*lead, n, n)


class _HcMapsPre(torch.autograd.Function):
    """hc_maps and the pre-aggregation a = sum_j H_pre[j] x[j] as one node on the native
    loops, for x [T, n, C] and a dynamic W [C, n + 2]; fused_dx=True also returns
    x_for_merge, as _MhcMaps does. The backward (NativeOps.hc_bwd) writes x's gradient once:
    coef x + dz W^T (the maps' share) + H_pre[j] da (the aggregation's) + H_res^T g (the
    merge's, with fused_dx),
    where separate nodes would write three [T, n, C] gradients and autograd add them up."""

    @staticmethod
    @_no_autocast
    def forward(ctx, x, w, s_alpha, s_beta, static_pre, static_post, static_res, norm_eps,
                fused_dx):
        ctx.set_materialize_grads(False)
        (h_pre, h_post, h_res), (r, u, d) = _hc_maps_values(
            x, padded_table(w), s_alpha, s_beta, static_pre, static_post, static_res, norm_eps
        )
        h_pre, h_res = h_pre.contiguous(), h_res.contiguous()
        a = native_call("cpu_pre_aggregate_fwd", x, h_pre)
        ctx.save_for_backward(x, w, s_alpha, s_beta, r, u, d, h_pre, h_res)
        ctx.static_dtypes = (static_pre.dtype, static_post.dtype, static_res.dtype)
        ctx.fused_dx = fused_dx
        maps = (h_pre, h_post, h_res, a)
        return (*maps, x.view_as(x)) if fused_dx else maps

    @staticmethod
    @_first_order
    @_no_autocast
    def backward(ctx, g_pre, g_post, g_res, g_a, g_merge=None):
        x, w, s_alpha, s_beta, r, u, d, h_pre, h_res = ctx.saved_tensors
        t, n, _ = x.shape
        f32 = torch.float32
        sc = torch.stack([s_alpha.reshape(()), s_beta.reshape(())]).to(f32)
        dx, gtot, dw = native_call(
            "cpu_hc_maps_bwd", x, w.to(f32).t().contiguous(), d, u, r, h_pre, h_res,
            contiguous_or_none(g_pre, f32), contiguous_or_none(g_post, f32),
            contiguous_or_none(g_res, f32), contiguous_or_none(g_a, x.dtype),
            contiguous_or_none(g_merge, x.dtype), sc,
        )
        # The scales' and the static maps' gradients from H_pre's and H_res's totals [T, ...]
        gp, gr = gtot[:, :n], gtot[:, n:].view(t, n, n)
        d3 = d.view(t, n, n + 2)
        d_sa = (gp * d3[..., 1]).sum() + (gr.transpose(-1, -2) * d3[..., 2:]).sum()
        d_sb, d_post = torch.zeros((), dtype=f32), None
        if g_post is not None:
            g_post = g_post.to(f32)
            d_sb, d_post = (g_post * d3[..., 0]).sum(), g_post.sum(dim=0)
        dtypes = ctx.static_dtypes
        return (dx, dw.to(w.dtype), d_sa.to(s_alpha.dtype), d_sb.to(s_beta.dtype),
                gp.sum(dim=0).to(dtypes[0]), None if d_post is None else d_post.to(dtypes[1]),
                gr.sum(dim=0).to(dtypes[2]), None, None)


def _hc_native(x: torch.Tensor, w: torch.Tensor | None,
               min_tokens: int = _HC_NATIVE_MIN_TOKENS) -> bool:
    """Whether HC's dynamic maps of x [..., n, C] run on the native loops (W [C, n + 2],
    at least min_tokens tokens)."""
    return (w is not None and use_native(x) and x.shape[-1] == w.shape[0]
            and w.shape[1] == x.shape[-2] + 2 and math.prod(x.shape[:-2]) >= min_tokens)


def _hc_inference(x, args, norm_eps, with_pre):
    """HC's maps (and the aggregation) of x [..., n, C] without autograd: one native call
    in the caller's shapes (native.c's hc_fwd), W and the scalars cached."""
    wp, p = cached_tables(hc_tables, *args)
    return _lib().hc_infer(x.contiguous(), wp, p, float(norm_eps), with_pre)


def hc_maps_pre(
    x: torch.Tensor,
    w: torch.Tensor | None,
    s_alpha: torch.Tensor,
    s_beta: torch.Tensor,
    static_pre: torch.Tensor,
    static_post: torch.Tensor,
    static_res: torch.Tensor,
    norm_eps: float = 1e-6,
    *,
    fused_dx: bool = False,
):
    """hc_maps plus pre_aggregate(x, H_pre): one autograd node (one dx in backward) where the
    maps run natively with autograd, else the two ops.

    fused_dx=True appends x_for_merge for post_merge(x_for_merge, ..., fused_dx=True), as
    mhc_maps_pre does, or None where no single node was made (the merge then runs on x with
    its own dx).
    """
    check_hc_scalars("hc_maps_pre", norm_eps)
    args = (w, s_alpha, s_beta, static_pre, static_post, static_res)
    check_hc_shapes("hc_maps_pre", x, *args)
    native = _hc_native(x, w, 1)
    if native and no_autograd(x, *args):  # decoding
        maps = _hc_inference(x, args, norm_eps, True)
        return (*maps, None) if fused_dx else maps
    lead, (n, c) = x.shape[:-2], x.shape[-2:]
    if not native or math.prod(lead) < _HC_NATIVE_MIN_TOKENS:  # hc_maps' reference path
        maps = _ref.hc_maps(x, *args, norm_eps)
        a = pre_aggregate(x, maps[0])
        return (*maps, a, None) if fused_dx else (*maps, a)
    outs = _HcMapsPre.apply(x.reshape(-1, n, c).contiguous(), *args, float(norm_eps), fused_dx)
    h_pre, h_post, h_res, a = outs[:4]
    maps = (h_pre.view(*lead, n), h_post.view(*lead, n), h_res.view(*lead, n, n),
            a.view(*lead, c))
    return (*maps, outs[4].view(x.shape)) if fused_dx else maps


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
    @_first_order
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
    """out = H_res x + H_post^T f on x [T, n, C], f [T, C], h_post [T, n], h_res [T, n, n]
    (maps in float32 on the native path, in x's dtype on the torch path).

    fused_dx=True (x and h_res are the x_for_merge and H_res of one
    mhc_maps_pre(..., fused_dx=True)):
    the backward passes its upstream gradient g through to x unchanged and returns no
    gradient for h_res; the maps node that made x_for_merge adds H_res^T g to x's gradient and
    <g_i, x_j> to H_res's, so the merge's backward neither writes dx nor reads x.
    """

    @staticmethod
    @_no_autocast
    def forward(ctx, x, f, h_post, h_res, native, fused_dx):
        ctx.set_materialize_grads(False)
        ctx.native, ctx.fused_dx = native, fused_dx
        ctx.save_for_backward(x, f, h_post, h_res)
        if native:
            return native_call("cpu_post_merge_fwd", x, f, h_post, h_res)
        return torch.bmm(h_res, x).addcmul_(h_post.unsqueeze(-1), f.unsqueeze(-2))

    @staticmethod
    @_first_order
    @_no_autocast
    def backward(ctx, g):
        if g is None:
            return None, None, None, None, None, None
        x, f, h_post, h_res = ctx.saved_tensors
        g = g.to(x.dtype).contiguous()
        if ctx.fused_dx:
            if ctx.native:
                _, df, dh_post, _ = native_call("cpu_post_merge_bwd", x, f, h_post, h_res, g,
                                                True)
            else:
                df = torch.bmm(h_post.unsqueeze(-2), g).squeeze(-2)
                dh_post = _rowdot(g, f)
            return g, df, dh_post, None, None, None
        if ctx.native:
            dx, df, dh_post, dh_res = native_call("cpu_post_merge_bwd", x, f, h_post, h_res,
                                                  g, False)
        else:
            need = ctx.needs_input_grad
            dx = torch.bmm(h_res.transpose(-1, -2), g) if need[0] else None  # H_res^T g
            df = torch.bmm(h_post.unsqueeze(-2), g).squeeze(-2) if need[1] else None
            dh_post = _rowdot(g, f) if need[2] else None  # [T, n]
            dh_res = torch.bmm(g, x.transpose(-1, -2)) if need[3] else None  # [T, n, n]
        return dx, df, dh_post, dh_res, None, None


def _contiguous_in(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t contiguous in dtype (a no-op Tensor.to costs more than the merge of one token)."""
    return t.contiguous() if t.dtype == dtype else t.to(dtype).contiguous()


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_c a[t, i, c] b[t, c] for a [T, n, C], b [T, C] -> [T, n].

    Written as [T, 1, C] @ [T, C, n], which measured three times faster than
    [T, n, C] @ [T, C, 1] on the CPU (the batched matmul then has a long inner loop).
    """
    return torch.bmm(b.unsqueeze(-2), a.transpose(-1, -2)).squeeze(-2)


# The native loops (ops/cpu/native.py) as custom ops, so torch.compile sees opaque calls with
# fake implementations instead of ctypes. Used for contiguous fp32/bf16 CPU tensors when the
# library built; everything else takes the autograd Functions above.


def _lib() -> _native.NativeOps:
    """The loaded native library (only called once _native_available() said yes)."""
    return _native.load()


def _native_available() -> bool:
    """Whether the native library is there: built or found in the cache by the first call
    (not at import)."""
    return _native.load() is not None


# torch.compile calls it once and takes the answer as a constant, so that a first call
# inside a trace does not trace the build and its lock. This is the mark that
# torch.compiler.assume_constant_result sets; set directly because calling that function
# imports torch._dynamo (3.5 s, at import).
_native_available._dynamo_marked_constant = True

# name -> the Python function behind the custom op torch_mhc::name
_IMPLS: dict = {}


def _custom_op(qualname: str, *, mutates_args=()):
    """torch.library.custom_op, keeping the undecorated function for native_call."""
    def register(fn):
        _IMPLS[qualname.split("::")[1]] = fn
        return torch.library.custom_op(qualname, mutates_args=mutates_args)(fn)
    return register


def native_call(name: str, *args):
    """torch.ops.torch_mhc.<name>(*args), or the function behind it called directly where
    nothing needs to see the custom op: no torch.compile trace, dispatch mode (fake tensors,
    FlopCounterMode) or profiler (torch.profiler lists the ops by name) and only plain CPU
    tensors (a meta tensor, a DTensor or other subclass goes through the op's dispatch).
    A connection's forward and backward on 8 tokens took 843 us this way against 1046 us
    through the custom ops (benchmarks/bench_connection_calls.py, one thread, Zen 4,
    2026-12-03)."""
    # plain_eager first: it rules out a compile trace before _profiler_enabled is asked
    if not plain_eager(a for a in args if isinstance(a, torch.Tensor)) \
            or torch.autograd._profiler_enabled():
        return getattr(torch.ops.torch_mhc, name)(*args)
    return _IMPLS[name](*args)


@_custom_op("torch_mhc::cpu_pre_aggregate_fwd", mutates_args=())
def _native_pre_fwd(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return _lib().pre_fwd(x, h)


@_native_pre_fwd.register_fake
def _(x, h):
    return x.new_empty((x.shape[0], x.shape[2]))


@_custom_op("torch_mhc::cpu_pre_aggregate_bwd", mutates_args=())
def _native_pre_bwd(
    x: torch.Tensor, h: torch.Tensor, da: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _lib().pre_bwd(x, h, da)


@_native_pre_bwd.register_fake
def _(x, h, da):
    return torch.empty_like(x), torch.empty_like(h)


def _native_pre_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


@_first_order
def _native_pre_backward(ctx, da):
    x, h = ctx.saved_tensors
    return torch.ops.torch_mhc.cpu_pre_aggregate_bwd(x, h, da.to(x.dtype).contiguous())


_native_pre_fwd.register_autograd(_native_pre_backward, setup_context=_native_pre_setup)


@_custom_op("torch_mhc::cpu_post_merge_fwd", mutates_args=())
def _native_merge_fwd(
    x: torch.Tensor, f: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor
) -> torch.Tensor:
    return _lib().merge_fwd(x, f, h_post, h_res)


@_native_merge_fwd.register_fake
def _(x, f, h_post, h_res):
    return torch.empty_like(x)


@_custom_op("torch_mhc::cpu_post_merge_bwd", mutates_args=())
def _native_merge_bwd(
    x: torch.Tensor, f: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor,
    g: torch.Tensor, fused_dx: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, df, dh_post, dh_res); fused_dx=True leaves dx and dh_res out (empty tensors)."""
    dx, df, dh_post, dh_res = _lib().merge_bwd(x, f, h_post, h_res, g, fused_dx)
    if fused_dx:
        return x.new_empty(0), df, dh_post, h_res.new_empty(0)
    return dx, df, dh_post, dh_res


@_native_merge_bwd.register_fake
def _(x, f, h_post, h_res, g, fused_dx):
    if fused_dx:
        return x.new_empty(0), torch.empty_like(f), torch.empty_like(h_post), h_res.new_empty(0)
    return (torch.empty_like(x), torch.empty_like(f), torch.empty_like(h_post),
            torch.empty_like(h_res))




@_custom_op("torch_mhc::cpu_mhc_maps_fwd", mutates_args=())
def _native_maps_fwd(
    x: torch.Tensor, phip: torch.Tensor, ab: torch.Tensor, iters: int, norm_eps: float,
    sk_eps: float, pre_eps: float, with_pre: bool, res: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lt [T, M], r [T], H_pre, H_post, H_res, a [T, C] or empty): see NativeOps.maps_fwd
    (res: Sinkhorn, or a successor's H_res map, native.RES)."""
    lt, r, h_pre, h_post, h_res, a = _lib().maps_fwd(
        x.contiguous(), phip.contiguous(), ab, iters, norm_eps, sk_eps, pre_eps, with_pre, res
    )
    return lt, r, h_pre, h_post, h_res, (x.new_empty(0) if a is None else a)


@_native_maps_fwd.register_fake
def _(x, phip, ab, iters, norm_eps, sk_eps, pre_eps, with_pre, res=0):
    t, n, c = x.shape
    f32 = dict(dtype=torch.float32, device=x.device)
    return (
        x.new_empty((t, ab.shape[1]), **f32), x.new_empty((t,), **f32),
        x.new_empty((t, n), **f32), x.new_empty((t, n), **f32), x.new_empty((t, n, n), **f32),
        x.new_empty((t, c)) if with_pre else x.new_empty(0),
    )


@_custom_op("torch_mhc::cpu_mhc_maps_bwd", mutates_args=())
def _native_maps_bwd(
    x: torch.Tensor, phi: torch.Tensor, ab: torch.Tensor, lt: torch.Tensor, r: torch.Tensor,
    g_pre: torch.Tensor | None, g_post: torch.Tensor | None, g_res: torch.Tensor | None,
    g_a: torch.Tensor | None, g_merge: torch.Tensor | None, iters: int, sk_eps: float,
    pre_eps: float, res: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dL/dH~ [T, M], dphi [K, M]): see NativeOps.maps_bwd."""
    return _lib().maps_bwd(x.contiguous(), phi, ab, lt, r, g_pre, g_post, g_res, g_a, g_merge,
                            iters, sk_eps, pre_eps, res)


@_native_maps_bwd.register_fake
def _(x, phi, ab, lt, r, g_pre, g_post, g_res, g_a, g_merge, iters, sk_eps, pre_eps, res=0):
    return torch.empty_like(x), torch.empty_like(lt), phi.new_empty(phi.shape)


@_custom_op("torch_mhc::cpu_hc_maps_bwd", mutates_args=())
def _native_hc_bwd(
    x: torch.Tensor, wt: torch.Tensor, d: torch.Tensor, u: torch.Tensor, r: torch.Tensor,
    h_pre: torch.Tensor, h_res: torch.Tensor, g_pre: torch.Tensor | None,
    g_post: torch.Tensor | None, g_res: torch.Tensor | None, g_a: torch.Tensor | None,
    g_merge: torch.Tensor | None, sc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, gtot [T, n + n n], dw [C, M]): see NativeOps.hc_bwd."""
    return _lib().hc_bwd(x.contiguous(), wt, d, u, r, h_pre, h_res, g_pre, g_post, g_res,
                         g_a, g_merge, sc)


@_native_hc_bwd.register_fake
def _(x, wt, d, u, r, h_pre, h_res, g_pre, g_post, g_res, g_a, g_merge, sc):
    t, n, c = x.shape
    return (torch.empty_like(x), x.new_empty((t, n + n * n), dtype=torch.float32),
            wt.new_empty(wt.t().shape))


@_custom_op("torch_mhc::cpu_rows_fwd", mutates_args=())
def _native_rows_fwd(x: torch.Tensor, wp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ wp [R, Mp], sums of squares of x's rows [R]): see NativeOps.rows_fwd."""
    return _lib().rows_fwd(x.contiguous(), wp.contiguous())


@_native_rows_fwd.register_fake
def _(x, wp):
    f32 = dict(dtype=torch.float32, device=x.device)
    return x.new_empty((x.shape[0], wp.shape[1]), **f32), x.new_empty((x.shape[0],), **f32)


@_custom_op("torch_mhc::cpu_rows_bwd", mutates_args=())
def _native_rows_bwd(
    x: torch.Tensor, wt: torch.Tensor, dz: torch.Tensor, coef: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [R, K], dw [K, M]): see NativeOps.rows_bwd."""
    return _lib().rows_bwd(x.contiguous(), wt.contiguous(), dz.contiguous(),
                            coef.contiguous())


@_native_rows_bwd.register_fake
def _(x, wt, dz, coef):
    return torch.empty_like(x), wt.new_empty(wt.t().shape)


def use_native(x: torch.Tensor) -> bool:
    """Whether x [..., n, C] takes the native loops (built library, fp32/bf16, n <= 8)."""
    return _native.supports(x) and _native_available()


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
    if use_native(x):
        h = h_pre.reshape(-1, n).to(torch.float32).contiguous()
        return _native_pre_fwd(x.reshape(-1, n, c).contiguous(), h).reshape(*lead, c)
    h = h_pre.to(x.dtype).reshape(-1, n)
    return _PreAggregate.apply(x.reshape(-1, n, c), h).reshape(*lead, c)


def post_merge(
    x: torch.Tensor, f: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor, *,
    fused_dx: bool = False,
) -> torch.Tensor:
    """H_res x + H_post^T f: [..., n, C], [..., C], [..., n], [..., n, n] -> [..., n, C].

    fused_dx=True: x and h_res are the x_for_merge and H_res of one
    mhc_maps_pre(..., fused_dx=True), and x's and H_res's gradients through the merge are
    left to that node's backward (the same values; one dx write in all).
    """
    _check_streams(x, "post_merge")
    lead, (n, c) = x.shape[:-2], x.shape[-2:]
    if f.shape[:-1] != lead or h_post.shape[:-1] != lead or h_res.shape[:-2] != lead \
            or f.shape[-1] != c or h_post.shape[-1] != n or h_res.shape[-2:] != (n, n):
        _ref.check_merge_shapes(x, f, h_post, h_res)
    native = use_native(x)
    if native and no_autograd(x, f, h_post, h_res):  # decoding: in the callers' shapes
        return _lib().merge_fwd(x.contiguous(), _contiguous_in(f, x.dtype),
                                _contiguous_in(h_post, torch.float32),
                                _contiguous_in(h_res, torch.float32))
    maps_dtype = torch.float32 if native else x.dtype
    args = (
        x.reshape(-1, n, c).contiguous() if native else x.reshape(-1, n, c),
        f.to(x.dtype).reshape(-1, c).contiguous(),
        h_post.reshape(-1, n).to(maps_dtype).contiguous(),
        h_res.reshape(-1, n, n).to(maps_dtype).contiguous(),
    )
    return _PostMerge.apply(*args, native, fused_dx).reshape(x.shape)
