"""Triton kernels of the mHC ops, forward and backward; launched by ops/triton_ops.py.

Layouts (all contiguous, T tokens after flattening the leading dimensions, K = n*C,
M = n*n + 2n):
    x [T, n, C] (read as [T, K] by the map kernels), f [T, C], out [T, n, C]
    h_pre, h_post [T, n], h_res [T, n, n]   (float32)
    phi [K, M], columns: pre (n), post (n), res (n*n, row-major)
    logits [T, M] = (x @ phi) / r, r [T] the RMS of each token's x   (float32)

Every kernel loads its inputs, computes in float32 and casts on store, so fp16/bf16 streams
get fp32 arithmetic. Streams are padded to NP = a power of two >= max(n, 4) inside the
kernels; padded lanes are masked.

The map kernels keep the M logit columns in two [BLOCK_T, NP*NP] tiles: the "res" tile holds
H_res's logits at q = i*NP + j, the "pp" tile holds pre at q = j (row 0) and post at
q = NP + j (row 1). Each tile is one tl.dot against the matching gather of phi's columns,
and reshaping a tile to [BLOCK_T, NP, NP] gives Sinkhorn its matrices, so no register
shuffles are needed.

Sinkhorn runs per token on the [NP, NP] matrix in registers. Its backward recomputes the
iterates: for each step, from the last to the first, it reruns the forward up to that step
(O(iters^2) small steps, no memory traffic) and applies the exact reverse of that step.
"""

from __future__ import annotations

import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------
# Helpers: phi's column of each tile position, Sinkhorn forward and backward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tile_columns(N: tl.constexpr, NP: tl.constexpr):
    """Column of phi / logits at each position of the res and pp tiles, and their masks."""
    q = tl.arange(0, NP * NP)
    i = q // NP
    j = q % NP
    res_ok = (i < N) & (j < N)
    res_col = 2 * N + i * N + j
    pp_ok = (i < 2) & (j < N)
    pp_col = i * N + j  # row 0: pre (columns 0..n-1), row 1: post (columns n..2n-1)
    return res_col, res_ok, pp_col, pp_ok, i


@triton.jit
def _col_softmax(h, ok):
    """exp(h - max) / colsum over axis 1 of h [BT, NP, NP]; masked entries are 0."""
    hm = tl.where(ok, h, -1e30)
    mx = tl.max(hm, axis=1)
    e = tl.where(ok, tl.exp(hm - mx[:, None, :]), 0.0)
    s = tl.sum(e, axis=1)
    return e / tl.where(s > 0.0, s, 1.0)[:, None, :]


@triton.jit
def _norm_rows(m, eps):
    d = tl.sum(m, axis=2) + eps
    return m / tl.where(d != 0.0, d, 1.0)[:, :, None]


@triton.jit
def _norm_cols(m, eps):
    d = tl.sum(m, axis=1) + eps
    return m / tl.where(d != 0.0, d, 1.0)[:, None, :]


@triton.jit
def _sinkhorn_fwd(h, ok, ITERS: tl.constexpr, eps):
    """Paper Eq. 9 on h [BT, NP, NP] (matrices in axes 1, 2): softmax + eps, rows, then
    (columns, rows) ITERS - 1 times. Padded entries stay 0 and padded sums are never 0 used."""
    m = tl.where(ok, _col_softmax(h, ok) + eps, 0.0)
    m = tl.where(ok, _norm_rows(m, eps), 0.0)
    for _ in range(ITERS - 1):
        m = tl.where(ok, _norm_cols(m, eps), 0.0)
        m = tl.where(ok, _norm_rows(m, eps), 0.0)
    return m


@triton.jit
def _sinkhorn_bwd(h, g, ok, ITERS: tl.constexpr, eps):
    """dL/dh for the forward above, given dL/dout g; exact reverse of the unrolled loop.

    Normalisation steps s = 0 .. 2*ITERS - 2 alternate rows (even s) and columns (odd s).
    Step s maps m to y = m / d with d = sum(m) + eps along its axis, so
    dL/dm = (dL/dy - sum(dL/dy * y)) / d along the same axis.
    """
    p0 = _col_softmax(h, ok)
    n_steps = 2 * ITERS - 1
    for s_rev in range(n_steps):
        s = n_steps - 1 - s_rev
        m = tl.where(ok, p0 + eps, 0.0)  # recompute the input of step s
        for k in range(s):
            if k % 2 == 0:
                m = tl.where(ok, _norm_rows(m, eps), 0.0)
            else:
                m = tl.where(ok, _norm_cols(m, eps), 0.0)
        # Branch-local names: the two branches' denominators have different shapes.
        if s % 2 == 0:
            d_row = tl.sum(m, axis=2) + eps
            d_row = tl.where(d_row != 0.0, d_row, 1.0)[:, :, None]
            y_row = m / d_row
            g = tl.where(ok, (g - tl.sum(g * y_row, axis=2)[:, :, None]) / d_row, 0.0)
        else:
            d_col = tl.sum(m, axis=1) + eps
            d_col = tl.where(d_col != 0.0, d_col, 1.0)[:, None, :]
            y_col = m / d_col
            g = tl.where(ok, (g - tl.sum(g * y_col, axis=1)[:, None, :]) / d_col, 0.0)
    # First step: column softmax (the + eps after it has unit derivative).
    return tl.where(ok, p0 * (g - tl.sum(g * p0, axis=1)[:, None, :]), 0.0)


# ---------------------------------------------------------------------------------------------
# (a) mHC maps
# ---------------------------------------------------------------------------------------------


@triton.jit
def mhc_maps_fwd_kernel(
    x_ptr, phi_ptr, alpha_ptr, b_pre_ptr, b_post_ptr, b_res_ptr,
    h_pre_ptr, h_post_ptr, h_res_ptr, logits_ptr, r_ptr,
    T, K, norm_eps, sk_eps, pre_eps,
    N: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """One pass over x gives x @ phi (two tiles) and the sum of squares; then the maps."""
    M: tl.constexpr = N * N + 2 * N
    NQ: tl.constexpr = NP * NP
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = t < T
    res_col, res_ok, pp_col, pp_ok, row = _tile_columns(N, NP)

    acc_res = tl.zeros([BLOCK_T, NQ], dtype=tl.float32)
    acc_pp = tl.zeros([BLOCK_T, NQ], dtype=tl.float32)
    ss = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        xk = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)  # [BT, BK]
        ss += tl.sum(xk * xk, axis=1)
        w_res = tl.load(phi_ptr + k[:, None] * M + res_col[None, :],
                        mask=k_ok[:, None] & res_ok[None, :], other=0.0).to(tl.float32)
        w_pp = tl.load(phi_ptr + k[:, None] * M + pp_col[None, :],
                       mask=k_ok[:, None] & pp_ok[None, :], other=0.0).to(tl.float32)
        acc_res = tl.dot(xk, w_res, acc_res, input_precision=PRECISION)
        acc_pp = tl.dot(xk, w_pp, acc_pp, input_precision=PRECISION)

    r = tl.sqrt(ss / K + norm_eps)  # [BT], RMS over n*C; divide after the matmul
    l_res = acc_res / r[:, None]  # [BT, NQ]
    l_pp = acc_pp / r[:, None]
    tl.store(r_ptr + t, r, mask=t_ok)
    tl.store(logits_ptr + t[:, None] * M + res_col[None, :], l_res,
             mask=t_ok[:, None] & res_ok[None, :])
    tl.store(logits_ptr + t[:, None] * M + pp_col[None, :], l_pp,
             mask=t_ok[:, None] & pp_ok[None, :])

    a_pre = tl.load(alpha_ptr).to(tl.float32)
    a_post = tl.load(alpha_ptr + 1).to(tl.float32)
    a_res = tl.load(alpha_ptr + 2).to(tl.float32)
    q = tl.arange(0, NQ)
    j = q % NP
    b_pp = tl.where(row == 0, tl.load(b_pre_ptr + j, mask=pp_ok & (row == 0), other=0.0),
                    tl.load(b_post_ptr + j, mask=pp_ok & (row == 1), other=0.0)).to(tl.float32)
    b_res = tl.load(b_res_ptr + (res_col - 2 * N), mask=res_ok, other=0.0).to(tl.float32)

    # Pre and post gates.
    gate = l_pp * tl.where(row == 0, a_pre, a_post)[None, :] + b_pp[None, :]
    sig = tl.sigmoid(gate)
    hp_ptrs = t[:, None] * N + j[None, :]
    tl.store(h_pre_ptr + hp_ptrs, sig + pre_eps, mask=t_ok[:, None] & (pp_ok & (row == 0))[None, :])
    tl.store(h_post_ptr + hp_ptrs, 2.0 * sig, mask=t_ok[:, None] & (pp_ok & (row == 1))[None, :])

    # Residual map: Sinkhorn on [BT, NP, NP].
    h = tl.reshape(l_res * a_res + b_res[None, :], [BLOCK_T, NP, NP])
    ok = tl.reshape(t_ok[:, None] & res_ok[None, :], [BLOCK_T, NP, NP])
    p = tl.reshape(_sinkhorn_fwd(h, ok, ITERS, sk_eps), [BLOCK_T, NQ])
    tl.store(h_res_ptr + t[:, None] * (N * N) + (res_col - 2 * N)[None, :], p,
             mask=t_ok[:, None] & res_ok[None, :])


@triton.jit
def mhc_maps_bwd_kernel(
    x_ptr, phi_ptr, alpha_ptr, b_pre_ptr, b_post_ptr, b_res_ptr, logits_ptr, r_ptr,
    g_pre_ptr, g_post_ptr, g_res_ptr,
    dx_ptr, dgate_ptr, dz_ptr,
    T, K, sk_eps,
    N: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """Per token block: dL/dgate-logits, dz = dL/d(x @ phi), and dx = dz @ phi^T + coef * x.

    Writes dgate [T, M] (the host sums it and dgate * logits over tokens for the biases and
    gates) and dz [T, M] (for dphi = x^T dz, a second kernel).
    """
    M: tl.constexpr = N * N + 2 * N
    NQ: tl.constexpr = NP * NP
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = t < T
    res_col, res_ok, pp_col, pp_ok, row = _tile_columns(N, NP)
    q = tl.arange(0, NQ)
    j = q % NP
    m_res = t_ok[:, None] & res_ok[None, :]
    m_pp = t_ok[:, None] & pp_ok[None, :]
    m_pre = t_ok[:, None] & (pp_ok & (row == 0))[None, :]
    m_post = t_ok[:, None] & (pp_ok & (row == 1))[None, :]

    l_res = tl.load(logits_ptr + t[:, None] * M + res_col[None, :], mask=m_res, other=0.0)
    l_pp = tl.load(logits_ptr + t[:, None] * M + pp_col[None, :], mask=m_pp, other=0.0)
    r = tl.load(r_ptr + t, mask=t_ok, other=1.0)
    a_pre = tl.load(alpha_ptr).to(tl.float32)
    a_post = tl.load(alpha_ptr + 1).to(tl.float32)
    a_res = tl.load(alpha_ptr + 2).to(tl.float32)
    b_pp = tl.where(row == 0, tl.load(b_pre_ptr + j, mask=pp_ok & (row == 0), other=0.0),
                    tl.load(b_post_ptr + j, mask=pp_ok & (row == 1), other=0.0)).to(tl.float32)
    b_res = tl.load(b_res_ptr + (res_col - 2 * N), mask=res_ok, other=0.0).to(tl.float32)

    # Gates: H_pre = sigmoid(g) + pre_eps, H_post = 2 sigmoid(g).
    a_pp = tl.where(row == 0, a_pre, a_post)[None, :]
    sig = tl.sigmoid(l_pp * a_pp + b_pp[None, :])
    hp_ptrs = t[:, None] * N + j[None, :]
    g_pp = tl.load(g_pre_ptr + hp_ptrs, mask=m_pre, other=0.0) + \
        tl.load(g_post_ptr + hp_ptrs, mask=m_post, other=0.0)
    dgate_pp = g_pp * sig * (1.0 - sig) * tl.where(row == 0, 1.0, 2.0)[None, :]
    dgate_pp = tl.where(m_pp, dgate_pp, 0.0)

    # Residual map: Sinkhorn backward on [BT, NP, NP].
    h = tl.reshape(l_res * a_res + b_res[None, :], [BLOCK_T, NP, NP])
    ok = tl.reshape(m_res, [BLOCK_T, NP, NP])
    g_res = tl.load(g_res_ptr + t[:, None] * (N * N) + (res_col - 2 * N)[None, :], mask=m_res,
                    other=0.0)
    dgate_res = tl.reshape(
        _sinkhorn_bwd(h, tl.reshape(g_res, [BLOCK_T, NP, NP]), ok, ITERS, sk_eps),
        [BLOCK_T, NQ],
    )
    tl.store(dgate_ptr + t[:, None] * M + res_col[None, :], dgate_res, mask=m_res)
    tl.store(dgate_ptr + t[:, None] * M + pp_col[None, :], dgate_pp, mask=m_pp)

    # logits = z / r, r = sqrt(mean(x^2) + eps): dz = dlogits / r, and r's share of dx is
    # coef * x with coef = -sum(dlogits * logits) / (K r^2).
    dl_res = dgate_res * a_res
    dl_pp = dgate_pp * a_pp
    coef = -(tl.sum(dl_res * l_res, axis=1) + tl.sum(dl_pp * l_pp, axis=1)) / (K * r * r)
    dz_res = dl_res / r[:, None]
    dz_pp = dl_pp / r[:, None]
    tl.store(dz_ptr + t[:, None] * M + res_col[None, :], dz_res, mask=m_res)
    tl.store(dz_ptr + t[:, None] * M + pp_col[None, :], dz_pp, mask=m_pp)

    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        # phi's columns, transposed: [NQ, BK]
        wt_res = tl.load(phi_ptr + k[None, :] * M + res_col[:, None],
                         mask=res_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        wt_pp = tl.load(phi_ptr + k[None, :] * M + pp_col[:, None],
                        mask=pp_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        m_xk = t_ok[:, None] & k_ok[None, :]
        xk = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=m_xk, other=0.0).to(tl.float32)
        dxk = coef[:, None] * xk
        dxk = tl.dot(dz_res, wt_res, dxk, input_precision=PRECISION)
        dxk = tl.dot(dz_pp, wt_pp, dxk, input_precision=PRECISION)
        tl.store(dx_ptr + t[:, None] * K + k[None, :], dxk.to(dx_ptr.dtype.element_ty), mask=m_xk)


@triton.jit
def mhc_dphi_kernel(
    x_ptr, dz_ptr, dphi_ptr, T, K, tokens_per_split,
    N: tl.constexpr, NP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """Partial dphi = x^T dz over one split of the tokens: dphi_ptr is [splits, K, M]."""
    M: tl.constexpr = N * N + 2 * N
    NQ: tl.constexpr = NP * NP
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < K
    split = tl.program_id(1)
    res_col, res_ok, pp_col, pp_ok, row = _tile_columns(N, NP)
    acc_res = tl.zeros([BLOCK_K, NQ], dtype=tl.float32)
    acc_pp = tl.zeros([BLOCK_K, NQ], dtype=tl.float32)
    t_begin = split * tokens_per_split
    for t0 in range(0, tokens_per_split, BLOCK_T):
        t = (t_begin + t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        t_ok = (t < T) & (t0 + tl.arange(0, BLOCK_T) < tokens_per_split)
        xt = tl.load(x_ptr + t[None, :] * K + k[:, None], mask=k_ok[:, None] & t_ok[None, :],
                     other=0.0).to(tl.float32)  # [BK, BT]
        dz_res = tl.load(dz_ptr + t[:, None] * M + res_col[None, :],
                         mask=t_ok[:, None] & res_ok[None, :], other=0.0)
        dz_pp = tl.load(dz_ptr + t[:, None] * M + pp_col[None, :],
                        mask=t_ok[:, None] & pp_ok[None, :], other=0.0)
        acc_res = tl.dot(xt, dz_res, acc_res, input_precision=PRECISION)
        acc_pp = tl.dot(xt, dz_pp, acc_pp, input_precision=PRECISION)
    out = dphi_ptr + split.to(tl.int64) * K * M + k[:, None].to(tl.int64) * M
    tl.store(out + res_col[None, :], acc_res, mask=k_ok[:, None] & res_ok[None, :])
    tl.store(out + pp_col[None, :], acc_pp, mask=k_ok[:, None] & pp_ok[None, :])


# ---------------------------------------------------------------------------------------------
# (b) pre-aggregation
# ---------------------------------------------------------------------------------------------


@triton.jit
def pre_fwd_kernel(
    x_ptr, h_ptr, out_ptr, T, C,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """out[t, c] = sum_j h[t, j] x[t, j, c]; grid (token blocks, channel blocks)."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    s = tl.arange(0, NP)
    t_ok, c_ok, s_ok = t < T, c < C, s < N
    h = tl.load(h_ptr + t[:, None] * N + s[None, :], mask=t_ok[:, None] & s_ok[None, :],
                other=0.0).to(tl.float32)  # [BT, NP]
    m3 = t_ok[:, None, None] & s_ok[None, :, None] & c_ok[None, None, :]
    x = tl.load(x_ptr + (t[:, None, None] * N + s[None, :, None]) * C + c[None, None, :],
                mask=m3, other=0.0).to(tl.float32)  # [BT, NP, BC]
    out = tl.sum(h[:, :, None] * x, axis=1)
    tl.store(out_ptr + t[:, None] * C + c[None, :], out.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def pre_bwd_kernel(
    x_ptr, h_ptr, da_ptr, dx_ptr, dh_ptr, T, C,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """dx[t, j, c] = h[t, j] da[t, c]; dh[t, j] = sum_c x[t, j, c] da[t, c] (loop over C)."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    s = tl.arange(0, NP)
    t_ok, s_ok = t < T, s < N
    m2 = t_ok[:, None] & s_ok[None, :]
    h = tl.load(h_ptr + t[:, None] * N + s[None, :], mask=m2, other=0.0).to(tl.float32)
    dh = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        c_ok = c < C
        da = tl.load(da_ptr + t[:, None] * C + c[None, :], mask=t_ok[:, None] & c_ok[None, :],
                     other=0.0).to(tl.float32)  # [BT, BC]
        offs = (t[:, None, None] * N + s[None, :, None]) * C + c[None, None, :]
        m3 = m2[:, :, None] & c_ok[None, None, :]
        x = tl.load(x_ptr + offs, mask=m3, other=0.0).to(tl.float32)  # [BT, NP, BC]
        dh += tl.sum(x * da[:, None, :], axis=2)
        dx = h[:, :, None] * da[:, None, :]
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=m3)
    tl.store(dh_ptr + t[:, None] * N + s[None, :], dh, mask=m2)


# ---------------------------------------------------------------------------------------------
# (c) post-and-merge
# ---------------------------------------------------------------------------------------------


@triton.jit
def merge_fwd_kernel(
    x_ptr, f_ptr, h_post_ptr, h_res_ptr, out_ptr, T, C,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """out[t, i] = sum_j h_res[t, i, j] x[t, j] + h_post[t, i] f[t]: reads (n+1)C, writes nC."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    i = tl.arange(0, NP)
    t_ok, c_ok, i_ok = t < T, c < C, i < N
    m2 = t_ok[:, None] & i_ok[None, :]
    mtc = t_ok[:, None] & c_ok[None, :]
    h_post = tl.load(h_post_ptr + t[:, None] * N + i[None, :], mask=m2, other=0.0)
    f = tl.load(f_ptr + t[:, None] * C + c[None, :], mask=mtc, other=0.0).to(tl.float32)
    acc = h_post.to(tl.float32)[:, :, None] * f[:, None, :]  # [BT, NP, BC]
    for j in tl.static_range(N):
        h_col = tl.load(h_res_ptr + (t[:, None] * N + i[None, :]) * N + j, mask=m2, other=0.0)
        xj = tl.load(x_ptr + (t[:, None] * N + j) * C + c[None, :], mask=mtc,
                     other=0.0).to(tl.float32)  # [BT, BC]
        acc += h_col.to(tl.float32)[:, :, None] * xj[:, None, :]
    offs = (t[:, None, None] * N + i[None, :, None]) * C + c[None, None, :]
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty),
             mask=m2[:, :, None] & c_ok[None, None, :])


@triton.jit
def merge_bwd_kernel(
    x_ptr, f_ptr, h_post_ptr, h_res_ptr, g_ptr,
    dx_ptr, df_ptr, dh_post_ptr, dh_res_ptr, T, C,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One pass over g, x, f: dx = H_res^T g, df = H_post^T g, dH_post = g f, dH_res = g x^T."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    i = tl.arange(0, NP)
    t_ok, i_ok = t < T, i < N
    m2 = t_ok[:, None] & i_ok[None, :]
    h_post = tl.load(h_post_ptr + t[:, None] * N + i[None, :], mask=m2, other=0.0).to(tl.float32)
    dh_post = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
    dh_res = tl.zeros([BLOCK_T, NP, NP], dtype=tl.float32)  # [t, i, j]
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        c_ok = c < C
        mtc = t_ok[:, None] & c_ok[None, :]
        m3 = m2[:, :, None] & c_ok[None, None, :]
        g = tl.load(g_ptr + (t[:, None, None] * N + i[None, :, None]) * C + c[None, None, :],
                    mask=m3, other=0.0).to(tl.float32)  # [BT, NP(i), BC]
        f = tl.load(f_ptr + t[:, None] * C + c[None, :], mask=mtc, other=0.0).to(tl.float32)
        dh_post += tl.sum(g * f[:, None, :], axis=2)
        df = tl.sum(h_post[:, :, None] * g, axis=1)
        tl.store(df_ptr + t[:, None] * C + c[None, :], df.to(df_ptr.dtype.element_ty), mask=mtc)
        for j in tl.static_range(N):
            h_col = tl.load(h_res_ptr + (t[:, None] * N + i[None, :]) * N + j, mask=m2,
                            other=0.0).to(tl.float32)  # [BT, NP(i)] = H_res[t, :, j]
            xj = tl.load(x_ptr + (t[:, None] * N + j) * C + c[None, :], mask=mtc,
                         other=0.0).to(tl.float32)  # [BT, BC]
            dxj = tl.sum(h_col[:, :, None] * g, axis=1)  # [BT, BC]
            tl.store(dx_ptr + (t[:, None] * N + j) * C + c[None, :],
                     dxj.to(dx_ptr.dtype.element_ty), mask=mtc)
            col = tl.sum(g * xj[:, None, :], axis=2)  # [BT, NP(i)] = dH_res[t, :, j]
            dh_res += tl.where(i[None, None, :] == j, col[:, :, None], 0.0)
    tl.store(dh_post_ptr + t[:, None] * N + i[None, :], dh_post, mask=m2)
    offs = (t[:, None, None] * N + i[None, :, None]) * N + i[None, None, :]
    tl.store(dh_res_ptr + offs, dh_res, mask=m2[:, :, None] & i_ok[None, None, :])


# ---------------------------------------------------------------------------------------------
# (d) Sinkhorn on its own
# ---------------------------------------------------------------------------------------------


@triton.jit
def _load_matrices(ptr, t, t_ok, N: tl.constexpr, NP: tl.constexpr):
    i = tl.arange(0, NP)
    ok = t_ok[:, None, None] & (i < N)[None, :, None] & (i < N)[None, None, :]
    offs = (t[:, None, None] * N + i[None, :, None]) * N + i[None, None, :]
    return tl.load(ptr + offs, mask=ok, other=0.0).to(tl.float32), offs, ok


@triton.jit
def sinkhorn_fwd_kernel(
    logits_ptr, out_ptr, T, eps,
    N: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    h, offs, ok = _load_matrices(logits_ptr, t, t < T, N, NP)
    p = _sinkhorn_fwd(h, ok, ITERS, eps)
    tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def sinkhorn_bwd_kernel(
    logits_ptr, g_ptr, dlogits_ptr, T, eps,
    N: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    h, offs, ok = _load_matrices(logits_ptr, t, t < T, N, NP)
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    dh = _sinkhorn_bwd(h, g, ok, ITERS, eps)
    tl.store(dlogits_ptr + offs, dh.to(dlogits_ptr.dtype.element_ty), mask=ok)
