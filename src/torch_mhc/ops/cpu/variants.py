"""The `cpu` implementation of mHC's successors' maps (functional.successors.variant_maps_pre).

The successors keep mHC's read and write maps and replace Sinkhorn by a closed form of the
res logits (a softmax mixture of permutations, a Kronecker product of 2 x 2 factors, or the
identity). So they run mHC's own native passes (ops/cpu/native.c's maps_fwd and maps_bwd,
the torch_mhc::cpu_mhc_maps_* ops) with the per-token Sinkhorn step swapped for the kind's
map (the `res` argument, native.RES): forward, x @ phi with the RMS, the gates, H_res and
the pre-aggregation in one pass over x; backward, the aggregation's and the merge's dot
products, the gates' and H_res's backward, dphi and one write of dx in one pass. H_res and
its backward are computed in double and rounded once, as functional.successors builds
them. With fused_dx, as ops.cpu.mhc_maps_pre, x_for_merge hands the merge's upstream
gradient to this node, so x's gradient from the whole connection is one write.

Without the native library, for float64, fp16, n > 8 or more than native.MAX_MAP_LOGITS
logits (mhc-lite at n = 5), the same Function runs on torch ops.
"""

from __future__ import annotations

import functools

import torch

from torch_mhc.functional import successors as _ref
from torch_mhc.functional.sinkhorn import compute_dtype
from torch_mhc.ops.checks import first_derivatives_only
from torch_mhc.ops.cpu import native
from torch_mhc.ops.cpu.ops import (  # (and the torch_mhc::cpu_* ops)
    cached_tables,
    contiguous_or_none,
    native_call,
    no_autograd,
    padded_table,
)

__all__ = ["takes_native", "variant_maps", "variant_maps_pre", "variant_tables"]


def _no_autocast(fn):
    """Run with CPU autocast off: the maps choose their own precision (see ops.cpu)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.autocast("cpu", enabled=False):
            return fn(*args, **kwargs)

    return wrapper


def _native_available() -> bool:
    """Whether the native library is there (built or found in the cache on first use)."""
    return native.load() is not None


# A constant to torch.compile, as ops.cpu's own check: a first call inside a trace must not
# trace the build and its lock (the mark torch.compiler.assume_constant_result sets).
_native_available._dynamo_marked_constant = True


def _use_native(x: torch.Tensor) -> bool:
    return native.supports(x) and _native_available()


def _gate_rows(alpha, b_pre, b_post, b_res, n: int, r: int, dtype):
    """(gate per logit [M], bias per logit [M]) for the logits' order pre, post, res."""
    a = alpha.to(dtype)
    gates = [a[0].expand(n), a[1].expand(n)] + ([a[2].expand(r)] if r else [])
    biases = [b_pre.to(dtype), b_post.to(dtype)] + ([b_res.to(dtype)] if r else [])
    return torch.cat(gates), torch.cat(biases)


def _logits(x: torch.Tensor, phi: torch.Tensor, norm_eps: float):
    """(l [T, M] = (flatten(x) @ phi) / r, r [T]) for x [T, n, C], in the maps dtype."""
    t, n, c = x.shape
    cdt = compute_dtype(x.dtype)
    v = x.reshape(t, n * c).to(cdt)
    r = torch.sqrt(v.square().mean(dim=-1) + norm_eps)
    return (v @ phi.to(cdt)) / r.unsqueeze(-1), r


def _res_forward(kind: str, z: torch.Tensor, n: int):
    """(H_res [T, n, n] in z's dtype, the float64 weights a [T, R] its backward needs) from
    z [T, R]: functional.successors.variant_res's values (built in float64, rounded once)."""
    if kind == "mhc-static-res":
        return _ref.variant_res(kind, z, n).contiguous(), z.new_empty((z.shape[0], 0))
    zw = z.to(torch.float64)
    if kind == "mhc-lite":
        a = torch.softmax(zw, dim=-1)
        perms = _ref.permutation_matrices(n, torch.float64).to(zw.device)  # [R, n, n]
        h = (a @ perms.flatten(-2)).unflatten(-1, (n, n))  # mhc_lite_res's sum, from a
    else:
        a = torch.sigmoid(zw)
        h = _ref.kromhc_res(zw, _ref.kronecker_pattern(n, torch.float64))
    return h.to(z.dtype).contiguous(), a


def _res_backward(kind: str, a: torch.Tensor, g: torch.Tensor, n: int) -> torch.Tensor:
    """dL/dz [T, R] (float64) of H_res = map(z) for dL/dH_res = g [T, n, n], from the
    forward's float64 weights a [T, R] (softmax(z) or sigmoid(z))."""
    g = g.to(torch.float64)
    if kind == "mhc-lite":
        perms = _ref.permutation_matrices(n, torch.float64).to(g.device).flatten(-2)
        da = g.flatten(-2) @ perms.t()  # [T, R]: <g, P_k>
        return a * (da - (a * da).sum(dim=-1, keepdim=True))
    same = _ref.kronecker_pattern(n, torch.float64).to(g.device)  # [m, n, n]
    aa = a[..., None, None]
    factors = same * aa + (1.0 - same) * (1.0 - aa)  # [T, m, n, n]
    m = same.shape[0]
    da = []
    for k in range(m):  # d(entry)/d a_k: the other factors' product, signed by same_k
        others = torch.cat([factors[:, :k], factors[:, k + 1 :]], dim=1).prod(dim=1)
        da.append((g * (2.0 * same[k] - 1.0) * others).sum(dim=(-2, -1)))
    return torch.stack(da, dim=-1) * a * (1.0 - a)


def takes_native(x: torch.Tensor, m: int) -> bool:
    """Whether the native loops take these maps: x supported and M map logits within the
    skinny matmuls' register tiles (mhc-lite at n = 5 has 130: torch ops)."""
    return _use_native(x) and m <= native.MAX_MAP_LOGITS


class _VariantMaps(torch.autograd.Function):
    """variant_maps(_pre) of x [T, n, C]: H_pre, H_post, H_res in the maps dtype, then with
    with_pre the aggregation a [T, C] in x's dtype, then with fused_dx x_for_merge (x as a
    view, for post_merge(..., fused_dx=True), as ops.cpu's mhc_maps_pre)."""

    @staticmethod
    @_no_autocast
    def forward(ctx, kind, x, phi, alpha, b_pre, b_post, b_res, norm_eps, with_pre, fused_dx):
        ctx.set_materialize_grads(False)
        t, n, c = x.shape
        r_count = phi.shape[1] - 2 * n
        ctx.kind, ctx.with_pre, ctx.fused_dx = kind, with_pre, fused_dx
        ctx.native = takes_native(x, phi.shape[1])
        ctx.b_dtypes = (b_pre.dtype, b_post.dtype, None if b_res is None else b_res.dtype)
        if ctx.native:
            phip, ab = variant_tables(phi, alpha, b_pre, b_post, b_res, wide=True)
            lt, r, h_pre, h_post, h_res, a = native_call(
                "cpu_mhc_maps_fwd", x, phip, ab, 1, norm_eps, 0.0, 0.0, with_pre,
                native.RES[kind])
            # Saved: the logits [T, M] and the RMS, as mHC's maps.
            ctx.save_for_backward(x, phi, alpha, lt, r, ab)
        else:
            lt, r = _logits(x, phi, norm_eps)  # [T, M], [T]
            gate, bias = _gate_rows(alpha, b_pre, b_post, b_res, n, r_count, lt.dtype)
            ht = torch.addcmul(bias, lt, gate)  # [T, M] the gated logits
            h_pre = torch.sigmoid(ht[:, :n])
            h_post = torch.sigmoid(ht[:, n : 2 * n]).mul_(2.0)
            h_res, weights = _res_forward(kind, ht[:, 2 * n :], n)  # [T, n, n], [T, R]
            ctx.save_for_backward(x, phi, alpha, lt, r, gate, ht, h_res, weights)
            a = torch.bmm(h_pre.to(x.dtype).unsqueeze(-2), x).squeeze(-2) if with_pre else None
        outs = (h_pre, h_post, h_res, a) if with_pre else (h_pre, h_post, h_res)
        return (*outs, x.view_as(x)) if fused_dx else outs

    @staticmethod
    @first_derivatives_only("cpu")
    @_no_autocast
    def backward(ctx, g_pre, g_post, g_res, *more):
        g_a = more[0] if ctx.with_pre else None
        g_merge = more[1] if ctx.fused_dx else None
        saved = ctx.saved_tensors
        x, phi, alpha, lt, r = saved[:5]
        n = x.shape[1]
        if ctx.native:
            ab = saved[5]
            f32 = torch.float32
            dx, d_ht, d_phi = native_call(
                "cpu_mhc_maps_bwd", x, phi.to(f32), ab, lt, r, contiguous_or_none(g_pre, f32),
                contiguous_or_none(g_post, f32), contiguous_or_none(g_res, f32),
                contiguous_or_none(g_a, x.dtype), contiguous_or_none(g_merge, x.dtype), 1, 0.0,
                0.0, native.RES[ctx.kind])
            d_phi = d_phi.to(phi.dtype)
        else:
            gate, ht, h_res, weights = saved[5:]
            cdt = lt.dtype
            if g_a is not None:  # the aggregation's <x_j, da>, [T, n]
                dots = torch.bmm(g_a.to(x.dtype).unsqueeze(-2), x.transpose(-1, -2))
                g_pre = _plus(g_pre, dots.squeeze(-2), cdt)
            if g_merge is not None:  # the merge's <g_i, x_j>, [T, n, n]
                g_res = _plus(g_res, torch.bmm(g_merge.to(x.dtype), x.transpose(-1, -2)), cdt)
            d_ht = _gates_backward(ctx.kind, ht, weights, g_pre, g_post, g_res, n)
            dx, d_phi = _input_grads(x, phi, lt, r, gate, ht, h_res, d_ht, g_a, g_merge)
        params = _parameter_grads(d_ht, lt, n, alpha.dtype, ctx.b_dtypes)
        return (None, dx, d_phi, *params, None, None, None)


def variant_tables(phi, alpha, b_pre, b_post, b_res=None, *, wide: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(phi padded [K, Mp], gate table [2, M]: each logit's gate, then its bias) in float32,
    the native maps' inputs (ops.cpu.mhc_tables' layout, wide as there; b_res None without
    res logits)."""
    n = b_pre.shape[0]
    gate, bias = _gate_rows(alpha, b_pre, b_post, b_res, n, phi.shape[1] - 2 * n,
                            torch.float32)
    return padded_table(phi, wide), torch.stack([gate, bias]).contiguous()


def _plus(g: torch.Tensor | None, extra: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """g + extra in dtype, either None."""
    if extra is None:
        return g
    extra = extra.to(dtype)
    return extra if g is None else g.to(dtype) + extra


def _gates_backward(kind, ht, weights, g_pre, g_post, g_res, n: int) -> torch.Tensor:
    """dL/dh~ [T, M] of the gated logits h~ from the maps' gradients (any None)."""
    d_ht = torch.zeros_like(ht)
    if g_pre is not None:
        s = torch.sigmoid(ht[:, :n])
        d_ht[:, :n] = g_pre.to(ht.dtype) * s * (1.0 - s)
    if g_post is not None:
        s = torch.sigmoid(ht[:, n : 2 * n])
        d_ht[:, n : 2 * n] = g_post.to(ht.dtype) * 2.0 * s * (1.0 - s)
    if g_res is not None and ht.shape[1] > 2 * n:
        d_ht[:, 2 * n :] = _res_backward(kind, weights, g_res, n).to(ht.dtype)
    return d_ht


def _parameter_grads(d_ht, lg, n: int, alpha_dtype, b_dtypes):
    """dalpha [2] or [3], db_pre [n], db_post [n], db_res [R] or None, from dL/dh~ and the
    logits, both [T, M]."""
    d_b = d_ht.sum(dim=0)  # [M]
    d_a_rows = (d_ht * lg).sum(dim=0)  # [M]
    parts = [d_a_rows[:n].sum(), d_a_rows[n : 2 * n].sum()]
    if b_dtypes[2] is not None:
        parts.append(d_a_rows[2 * n :].sum())
    d_res = None if b_dtypes[2] is None else d_b[2 * n :].to(b_dtypes[2])
    return (torch.stack(parts).to(alpha_dtype), d_b[:n].to(b_dtypes[0]),
            d_b[n : 2 * n].to(b_dtypes[1]), d_res)


def _input_grads(x, phi, lg, r, gate, ht, h_res, d_ht, g_a, g_merge):
    """(dx [T, n, C] in x's dtype, dphi [K, M]): logits = z / r with r = sqrt(mean(v^2) +
    eps), so dL/dv = dz phi^T + coef v, plus the aggregation's H_pre[j] da and the merge's
    H_res^T g."""
    t, n, c = x.shape
    k = n * c
    d_l = d_ht * gate  # [T, M] dL/dlogits
    coef = (d_l * lg).sum(dim=-1).div_(r.square()).div_(-k)  # [T]
    d_z = d_l.div_(r.unsqueeze(-1))  # [T, M]
    h_pre = torch.sigmoid(ht[:, :n])
    cdt = lg.dtype
    v = x.reshape(t, k).to(cdt)
    dv = torch.mm(d_z, phi.to(cdt).t()).addcmul_(v, coef.unsqueeze(-1)).view(t, n, c)
    if g_a is not None:
        dv.addcmul_(h_pre.unsqueeze(-1), g_a.to(cdt).unsqueeze(-2))
    if g_merge is not None:
        dv.baddbmm_(h_res.to(cdt).transpose(-1, -2), g_merge.to(cdt))
    return dv.to(x.dtype), torch.mm(v.t(), d_z).to(phi.dtype)


def _run(kind, x, phi, alpha, b_pre, b_post, b_res, norm_eps, with_pre, fused_dx):
    if x.dim() < 2:
        raise ValueError(f"variant maps expect streams x [..., n, C], got {tuple(x.shape)}")
    n, c = x.shape[-2:]
    _ref.check_variant(kind, n)
    # the native loops read phi's n C rows and the n gates without bounds
    want = {"phi": (phi, (n * c, 2 * n + _ref.res_count(kind, n))), "b_pre": (b_pre, (n,)),
            "b_post": (b_post, (n,))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{kind} with n = {n}, C = {c} expects {name} of shape {shape}, "
                             f"got {tuple(t.shape)}")
    lead = x.shape[:-2]
    params = (phi, alpha, b_pre, b_post, *(() if b_res is None else (b_res,)))
    if with_pre and no_autograd(x, *params) and takes_native(x, phi.shape[1]):
        # No gradient: the maps in x's leading shape straight from the native loops, without
        # the logits the backward would need (as ops.cpu.mhc_maps_pre); the padded tables
        # reused while the parameters are unchanged; x_for_merge is x itself.
        phip, ab = cached_tables(variant_tables, *params)
        maps = native.load().maps_infer(x.contiguous(), phip, ab, 1, float(norm_eps), 0.0, 0.0,
                                        native.RES[kind])
        return (*maps, x) if fused_dx else maps
    outs = _VariantMaps.apply(kind, x.reshape(-1, n, c).contiguous(), phi, alpha, b_pre,
                              b_post, b_res, float(norm_eps), with_pre, fused_dx)
    maps = [outs[0].reshape(*lead, n), outs[1].reshape(*lead, n),
            outs[2].reshape(*lead, n, n)]
    if with_pre:
        maps.append(outs[3].reshape(*lead, c))
    if fused_dx:
        maps.append(outs[-1].reshape(x.shape))
    return tuple(maps)


def variant_maps(kind, x, phi, alpha, b_pre, b_post, b_res=None, norm_eps=1e-6):
    """Same contract as functional.successors.variant_maps."""
    return _run(kind, x, phi, alpha, b_pre, b_post, b_res, norm_eps, False, False)


def variant_maps_pre(kind, x, phi, alpha, b_pre, b_post, b_res=None, norm_eps=1e-6, *,
                     fused_dx=False):
    """variant_maps plus pre_aggregate(x, H_pre) as one autograd node (one dx in backward);
    fused_dx=True appends x_for_merge for post_merge(x_for_merge, ..., fused_dx=True)."""
    return _run(kind, x, phi, alpha, b_pre, b_post, b_res, norm_eps, True, fused_dx)
