"""Triton kernels of the mHC ops, forward and backward; launched by ops/triton/ops.py.

Layouts (all contiguous, T tokens after flattening the leading dimensions, K = n*C,
M = n*n + 2n):
    x [T, n, C] (read as [T, K] by the map kernels), f [T, C], out [T, n, C]
    h_pre, h_post [T, n], h_res [T, n, n]   (float32)
    phi [K, M], columns: pre (n), post (n), res (n*n, row-major)
    logits [T, M] = (x @ phi) / r, r [T] the RMS of each token's x   (float32)
    scratch [T, 2*ITERS, NP] (float32): Sinkhorn's normalisers, written and read by one
    backward program (see below)
    parts [T, S, M], ss [T, S] (float32): the forward's partial x @ phi and sums of squares
    of S splits of K; dz [T, M], coef [T] (float32): the backward's dL/d(x @ phi) and r's
    coefficient of x

mHC's successors (section (e)) take the same layouts with M = 2n + R: phi's columns pre (n),
post (n), then their R res logits, and no scratch.

Every kernel loads its inputs, computes in float32 and casts on store, so fp16/bf16 streams
get fp32 arithmetic. Streams are padded to NP = a power of two >= max(n, 4) inside the map
kernels (tl.dot needs 16 columns); padded lanes are masked.

The map kernels keep the M logit columns in two tiles: the "res" tile [BLOCK_T, NP*NP]
holds H_res's logits at q = i*NP + j, so that reshaping it to [BLOCK_T, NP, NP] gives
Sinkhorn its matrices without register shuffles; the "pp" tile [BLOCK_T, PW] holds logits
columns 0 .. 2n-1 (pre, then post) as they are, PW = max(16, next power of two >= 2n).
Each tile is one tl.dot against the matching columns of phi. For the successors the res tile
is [BLOCK_T, RW], their R res logits as they are, RW = max(16, next power of two >= R): the
matmul kernels take R and RW as constexprs (_res_columns; R = -1, the default, is mHC's tile).

Sinkhorn runs per token on the [NP, NP] matrix in registers (paper Eq. 9, eps as DeepSeek-V4).
Its backward is the exact reverse of the unrolled loop in time linear in the iterations: it
reruns the forward once, writing each step's normaliser vector (NP floats) to scratch, then
(after a barrier: other threads of the program read them) walks the steps backwards. Every
step multiplies rows or columns by a vector, so the step's input is its output times the
stored normaliser, and with w = g * y (the upstream gradient
times the step's output) the reverse of y = m / d along one axis is
    w <- w - sum_axis(w) * y,   y <- y * d.
Counted in O(n^2) passes over a matrix: forward 2*ITERS - 1 normalisations; backward
2*ITERS - 1 recomputed plus 2*ITERS - 1 reversed (ratio 2; per entry, forward 2 operations
per step (add, divide), backward 2 + 3 (add, multiply-add, multiply), ratio 2.5).

Large logits, as torch_mhc.functional.sinkhorn decides (its docstring): a matrix whose logit range
max - min is not <= LINEAR_RANGE (32; NaN counts as far), when eps = 0, is iterated in the
log domain (z <- z - logsumexp(z) along columns, then rows), the same unrolled function
without exp underflowing whole rows to 0 (which would make 0/0). The decision is per token;
a block of tokens runs the log path only if one of its tokens needs it. Its backward is the
same reverse with y = exp(z) and z <- z + lse per step.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Compiled for a GPU: PTX's cvt.rna rounds to TF32; in Triton's interpreter (no inline
# assembly) the same rounding by its bits.
_RNA_ASM: tl.constexpr = tl.constexpr(not triton.knobs.runtime.interpret)


@triton.jit
def _tf32(v):
    """fp32 v rounded to TF32 (10 mantissa bits; to nearest, ties away from zero), so that a
    tf32 tl.dot, which reads only those bits (truncating), gets the rounded value."""
    if _RNA_ASM:
        r = tl.inline_asm_elementwise("cvt.rna.tf32.f32 $0, $1;", "=r,r", [v],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        u = v.to(tl.uint32, bitcast=True)
        r = tl.where(tl.abs(v) < float("inf"),
                     ((u + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True), v)
    return r

# ---------------------------------------------------------------------------------------------
# Helpers: phi's column of each tile position, Sinkhorn forward and backward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _res_columns(N: tl.constexpr, NP: tl.constexpr, R: tl.constexpr = -1, RW: tl.constexpr = 0):
    """Column of phi / logits at each position of the res tile, its mask. R < 0: mHC's n*n
    res logits tiled [NP, NP] (q = i*NP + j); R >= 0: a successor's R res logits, columns
    2n .. 2n+R-1 as they are, in a tile RW wide (module docstring)."""
    if R < 0:
        q = tl.arange(0, NP * NP)
        i = q // NP
        j = q % NP
        col, ok = 2 * N + i * N + j, (i < N) & (j < N)
    else:
        q = tl.arange(0, RW)
        col, ok = 2 * N + q, q < R
    return col, ok


@triton.jit
def _expand(v, AXIS: tl.constexpr):
    """A reduction over AXIS of a [BT, NP, NP] tensor, broadcastable back."""
    return tl.expand_dims(v, AXIS)


@triton.jit
def _col_softmax(h, ok):
    """exp(h - max) / colsum over axis 1 of h [BT, NP, NP]; masked entries are 0."""
    hm = tl.where(ok, h, -1e30)
    mx = tl.max(hm, axis=1)
    e = tl.where(ok, tl.exp(hm - mx[:, None, :]), 0.0)
    s = tl.sum(e, axis=1)
    return e / tl.where(s > 0.0, s, 1.0)[:, None, :]


@triton.jit
def _scratch(scratch_ptr, t, s, NS: tl.constexpr, NP: tl.constexpr):
    """Addresses of normaliser vector s of each token: scratch [T, NS, NP]."""
    return scratch_ptr + (t[:, None] * NS + s) * NP + tl.arange(0, NP)[None, :]


@triton.jit
def _normalise(m, ok, eps, s, scratch_ptr, t, keep, AXIS: tl.constexpr,
               ITERS: tl.constexpr, NP: tl.constexpr, STORE: tl.constexpr):
    """m / (sum over AXIS + eps), a zero denominator left at 1; stores it as step s if STORE."""
    d = tl.sum(m, axis=AXIS) + eps
    d = tl.where(d != 0.0, d, 1.0)  # [BT, NP]
    if STORE:
        tl.store(_scratch(scratch_ptr, t, s, 2 * ITERS, NP), d, mask=keep[:, None])
    return tl.where(ok, m / _expand(d, AXIS), 0.0)


@triton.jit
def _sinkhorn_exp(h, ok, eps, scratch_ptr, t, keep, ITERS: tl.constexpr, NP: tl.constexpr,
                  STORE: tl.constexpr):
    """Paper Eq. 9 on h [BT, NP, NP]: softmax + eps, rows, then (columns, rows) ITERS - 1
    times; step s (1 .. 2*ITERS - 1) normalises rows for odd s, columns for even s."""
    m = tl.where(ok, _col_softmax(h, ok) + eps, 0.0)
    m = _normalise(m, ok, eps, 1, scratch_ptr, t, keep, 2, ITERS, NP, STORE)
    for k in range(1, ITERS):
        m = _normalise(m, ok, eps, 2 * k, scratch_ptr, t, keep, 1, ITERS, NP, STORE)
        m = _normalise(m, ok, eps, 2 * k + 1, scratch_ptr, t, keep, 2, ITERS, NP, STORE)
    return m


@triton.jit
def _lse_step(z, ok, s, scratch_ptr, t, keep, AXIS: tl.constexpr, ITERS: tl.constexpr,
              NP: tl.constexpr, STORE: tl.constexpr):
    """z - logsumexp(z) over AXIS (masked entries -1e30); stores the lse as step s if STORE."""
    mx = tl.max(z, axis=AXIS)
    e = tl.where(ok, tl.exp(z - _expand(mx, AXIS)), 0.0)
    s_ = tl.sum(e, axis=AXIS)
    lse = mx + tl.log(tl.where(s_ > 0.0, s_, 1.0))  # [BT, NP]
    if STORE:
        tl.store(_scratch(scratch_ptr, t, s, 2 * ITERS, NP), lse, mask=keep[:, None])
    return tl.where(ok, z - _expand(lse, AXIS), -1e30)


@triton.jit
def _sinkhorn_log(h, ok, scratch_ptr, t, keep, ITERS: tl.constexpr, NP: tl.constexpr,
                  STORE: tl.constexpr):
    """The same iterates in the log domain: step 2k (columns) and 2k + 1 (rows), k < ITERS.
    Returns the final log-iterate z (masked entries -1e30)."""
    z = tl.where(ok, h, -1e30)
    for k in range(ITERS):
        z = _lse_step(z, ok, 2 * k, scratch_ptr, t, keep, 1, ITERS, NP, STORE)
        z = _lse_step(z, ok, 2 * k + 1, scratch_ptr, t, keep, 2, ITERS, NP, STORE)
    return z


@triton.jit
def _needs_log(h, ok, t_ok, log_range):
    """[BT]: the tokens whose logit range is not <= log_range (iterated in the log domain)."""
    hi = tl.max(tl.max(tl.where(ok, h, -1e30), axis=2), axis=1)
    lo = tl.min(tl.min(tl.where(ok, h, 1e30), axis=2), axis=1)
    return t_ok & ((hi - lo <= log_range) == 0)


@triton.jit
def _sinkhorn_fwd(h, ok, t, t_ok, eps, log_range, scratch_ptr, ITERS: tl.constexpr,
                  NP: tl.constexpr, LOG_OK: tl.constexpr, STORE: tl.constexpr):
    """Sinkhorn of each token's h [BT, NP, NP]; the log domain for the tokens that need it
    (only when LOG_OK, i.e. eps = 0). With STORE, the normalisers go to scratch."""
    if LOG_OK:
        big = _needs_log(h, ok, t_ok, log_range)
    else:
        big = t < 0  # no token
    m = _sinkhorn_exp(h, ok, eps, scratch_ptr, t, t_ok & (big == 0), ITERS, NP, STORE)
    if LOG_OK:
        if tl.max(big.to(tl.int32), axis=0) > 0:
            z = _sinkhorn_log(h, ok, scratch_ptr, t, big, ITERS, NP, STORE)
            m = tl.where(big[:, None, None], tl.where(ok, tl.exp(z), 0.0), m)
    return m


@triton.jit
def _reverse_step(w, y, v, ok, AXIS: tl.constexpr, LOG: tl.constexpr):
    """Undo one step of output y: w <- w - sum_axis(w) y; y <- its input (v the normaliser,
    or for LOG, y holds z and v the lse). Returns (w, y or z)."""
    if LOG:
        e = tl.where(ok, tl.exp(y), 0.0)
        w = w - _expand(tl.sum(w, axis=AXIS), AXIS) * e
        y = tl.where(ok, y + _expand(v, AXIS), -1e30)
    else:
        w = w - _expand(tl.sum(w, axis=AXIS), AXIS) * y
        y = y * _expand(v, AXIS)
    return w, y


@triton.jit
def _load_step(scratch_ptr, t, keep, s, ITERS: tl.constexpr, NP: tl.constexpr):
    return tl.load(_scratch(scratch_ptr, t, s, 2 * ITERS, NP), mask=keep[:, None], other=1.0)


@triton.jit
def _reverse(w, y, ok, scratch_ptr, t, keep, FIRST: tl.constexpr, ITERS: tl.constexpr,
             NP: tl.constexpr, LOG: tl.constexpr):
    """Walk steps 2*ITERS - 1 down to FIRST (rows odd, columns even) from w = g * y."""
    for kk in range(ITERS):
        k = ITERS - 1 - kk
        w, y = _reverse_step(w, y, _load_step(scratch_ptr, t, keep, 2 * k + 1, ITERS, NP),
                             ok, 2, LOG)
        if 2 * k >= FIRST:
            w, y = _reverse_step(w, y, _load_step(scratch_ptr, t, keep, 2 * k, ITERS, NP),
                                 ok, 1, LOG)
    return w, y


@triton.jit
def _sinkhorn_bwd(h, g, ok, t, t_ok, eps, log_range, scratch_ptr, ITERS: tl.constexpr,
                  NP: tl.constexpr, LOG_OK: tl.constexpr):
    """dL/dh for _sinkhorn_fwd given dL/dout g [BT, NP, NP]: the exact reverse of the unrolled
    loop, linear in ITERS (module docstring). Recomputes the forward once into scratch."""
    if LOG_OK:
        big = _needs_log(h, ok, t_ok, log_range)
    else:
        big = t < 0  # no token
    keep = t_ok & (big == 0)
    y = _sinkhorn_exp(h, ok, eps, scratch_ptr, t, keep, ITERS, NP, True)
    # The reverse reads what other threads of this program wrote: make it visible to them.
    tl.debug_barrier()
    w, y = _reverse(tl.where(ok, g * y, 0.0), y, ok, scratch_ptr, t, keep, 1, ITERS, NP, False)
    # y is back to softmax + eps; w = g_0 * y with g_0 the gradient of the softmax's output.
    p0 = _col_softmax(h, ok)
    g0 = tl.where(ok & (y > 0.0), w / tl.where(y > 0.0, y, 1.0), 0.0)
    dh = tl.where(ok, p0 * (g0 - tl.sum(g0 * p0, axis=1)[:, None, :]), 0.0)
    if LOG_OK:
        if tl.max(big.to(tl.int32), axis=0) > 0:
            z = _sinkhorn_log(h, ok, scratch_ptr, t, big, ITERS, NP, True)
            tl.debug_barrier()
            e = tl.where(ok, tl.exp(z), 0.0)
            w_log, z = _reverse(tl.where(ok, g * e, 0.0), z, ok, scratch_ptr, t, big, 0, ITERS,
                                NP, True)
            dh = tl.where(big[:, None, None], w_log, dh)
    return dh


# ---------------------------------------------------------------------------------------------
# (a) mHC maps
#
# The forward is two kernels: mhc_xphi_kernel, the matmul x @ phi and the sum of squares over
# one token block and one split of K (grid: token blocks x K splits), writing fp32 partial
# sums; then mhc_maps_fwd_kernel, per token block, adds the splits in a fixed order (no
# atomics: bitwise reproducible) and computes RMS, gates and Sinkhorn. The backward mirrors
# it: mhc_maps_bwd_kernel (Sinkhorn's backward, the gates', dz and r's coefficient, no phi),
# mhc_dx_kernel (dx = dz @ phi^T + coef * x over token blocks x K splits; every dx element is
# one program's, so nothing is reduced across programs), mhc_dphi_kernel (x^T dz).
#
# Why split: every token block of the matmul kernels reads all of phi [K, M]. Keeping the
# matmul apart from Sinkhorn lets it take larger token blocks (phi read fewer times: the
# Sinkhorn epilogue is what holds registers), and splitting K lets few tokens (decoding)
# spread over many programs instead of walking all of K on one SM. The plans choose
# BLOCK_T and the splits from T and n (ops/triton/ops.py, _k_splits).
# ---------------------------------------------------------------------------------------------


@triton.jit
def _gate_params(alpha_ptr, b_pre_ptr, b_post_ptr, b_res_ptr, res_col, res_ok,
                 N: tl.constexpr, PW: tl.constexpr, R: tl.constexpr = -1):
    """Per pp column: alpha and bias of its gate, whether it is pre; alpha_res, res biases.
    R = 0 (no res logits): alpha holds two gates, alpha_res is 0 and b_res is not read."""
    p = tl.arange(0, PW)
    is_pre = p < N
    a_pp = tl.where(is_pre, tl.load(alpha_ptr).to(tl.float32),
                    tl.load(alpha_ptr + 1).to(tl.float32))
    b_pp = tl.where(is_pre, tl.load(b_pre_ptr + p, mask=is_pre, other=0.0),
                    tl.load(b_post_ptr + (p - N), mask=(p >= N) & (p < 2 * N), other=0.0))
    b_res = tl.load(b_res_ptr + (res_col - 2 * N), mask=res_ok, other=0.0).to(tl.float32)
    return p, is_pre, a_pp, b_pp.to(tl.float32), \
        tl.load(alpha_ptr + 2).to(tl.float32) if R != 0 else 0.0, b_res


@triton.jit
def mhc_xphi_kernel(
    x_ptr, phi_ptr, parts_ptr, ss_ptr, T, K, k_per_split,
    N: tl.constexpr, NP: tl.constexpr, PW: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    R: tl.constexpr = -1, RW: tl.constexpr = 0,
):
    """One token block, one split of K (k_per_split a multiple of BLOCK_K): partial x @ phi
    into parts [T, S, M] and partial sums of squares into ss [T, S] (float32; S =
    num_programs(1)). R, RW: the res logits' layout (_res_columns; mHC's by default)."""
    M: tl.constexpr = N * N + 2 * N if R < 0 else 2 * N + R
    NQ: tl.constexpr = NP * NP if R < 0 else RW
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = t < T
    split = tl.program_id(1).to(tl.int64)
    res_col, res_ok = _res_columns(N, NP, R, RW)
    p = tl.arange(0, PW)
    pp_ok = p < 2 * N

    acc_res = tl.zeros([BLOCK_T, NQ], dtype=tl.float32)
    acc_pp = tl.zeros([BLOCK_T, PW], dtype=tl.float32)
    ss = tl.zeros([BLOCK_T], dtype=tl.float32)
    k_begin = split * k_per_split
    for k0 in range(0, k_per_split, BLOCK_K):
        k = k_begin + k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        xk = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)  # [BT, BK]
        ss += tl.sum(xk * xk, axis=1)
        w_res = tl.load(phi_ptr + k[:, None] * M + res_col[None, :],
                        mask=k_ok[:, None] & res_ok[None, :], other=0.0).to(tl.float32)
        w_pp = tl.load(phi_ptr + k[:, None] * M + p[None, :],
                       mask=k_ok[:, None] & pp_ok[None, :], other=0.0).to(tl.float32)
        acc_res = tl.dot(xk, w_res, acc_res, input_precision=PRECISION)
        acc_pp = tl.dot(xk, w_pp, acc_pp, input_precision=PRECISION)

    row = t * tl.num_programs(1) + split  # [BT] rows of parts [T * S, M] and ss [T * S]
    tl.store(parts_ptr + row[:, None] * M + res_col[None, :], acc_res,
             mask=t_ok[:, None] & res_ok[None, :])
    tl.store(parts_ptr + row[:, None] * M + p[None, :], acc_pp,
             mask=t_ok[:, None] & pp_ok[None, :])
    tl.store(ss_ptr + row, ss, mask=t_ok)


@triton.jit
def _sum_splits(parts_ptr, ss_ptr, t, t_ok, S, res_col, res_ok, p, pp_ok,
                N: tl.constexpr, NP: tl.constexpr, PW: tl.constexpr, BLOCK_T: tl.constexpr,
                UNROLL: tl.constexpr, R: tl.constexpr = -1, RW: tl.constexpr = 0):
    """x @ phi's two tiles and the sum of squares: the S splits added in order 0 .. S-1
    (UNROLL loads in flight per step; a split past S adds masked zeros)."""
    M: tl.constexpr = N * N + 2 * N if R < 0 else 2 * N + R
    NQ: tl.constexpr = NP * NP if R < 0 else RW
    acc_res = tl.zeros([BLOCK_T, NQ], dtype=tl.float32)
    acc_pp = tl.zeros([BLOCK_T, PW], dtype=tl.float32)
    ss = tl.zeros([BLOCK_T], dtype=tl.float32)
    for s0 in range(0, S, UNROLL):
        for j in tl.static_range(UNROLL):
            row = t * S + (s0 + j)  # [BT] rows of parts [T * S, M], int64 as t
            m = t_ok & (row < t * S + S)  # split s0 + j < S, written on tensors
            acc_res += tl.load(parts_ptr + row[:, None] * M + res_col[None, :],
                               mask=m[:, None] & res_ok[None, :], other=0.0)
            acc_pp += tl.load(parts_ptr + row[:, None] * M + p[None, :],
                              mask=m[:, None] & pp_ok[None, :], other=0.0)
            ss += tl.load(ss_ptr + row, mask=m, other=0.0)
    return acc_res, acc_pp, ss


@triton.jit
def mhc_maps_fwd_kernel(
    parts_ptr, ss_ptr, alpha_ptr, b_pre_ptr, b_post_ptr, b_res_ptr,
    h_pre_ptr, h_post_ptr, h_res_ptr, logits_ptr, r_ptr,
    T, K, S, norm_eps, sk_eps, pre_eps, log_range,
    N: tl.constexpr, NP: tl.constexpr, PW: tl.constexpr, ITERS: tl.constexpr,
    LOG_OK: tl.constexpr, BLOCK_T: tl.constexpr, UNROLL: tl.constexpr,
):
    """Per token block: the splits' sums, then RMS, logits, gates and Sinkhorn."""
    M: tl.constexpr = N * N + 2 * N
    NQ: tl.constexpr = NP * NP
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = t < T
    res_col, res_ok = _res_columns(N, NP)
    p = tl.arange(0, PW)
    pp_ok = p < 2 * N
    acc_res, acc_pp, ss = _sum_splits(parts_ptr, ss_ptr, t, t_ok, S, res_col, res_ok, p, pp_ok,
                                      N, NP, PW, BLOCK_T, UNROLL)

    r = tl.sqrt(ss / K + norm_eps)  # [BT], RMS over n*C; divide after the matmul
    l_res = acc_res / r[:, None]  # [BT, NQ]
    l_pp = acc_pp / r[:, None]  # [BT, PW]
    m_res = t_ok[:, None] & res_ok[None, :]
    tl.store(r_ptr + t, r, mask=t_ok)
    tl.store(logits_ptr + t[:, None] * M + res_col[None, :], l_res, mask=m_res)
    tl.store(logits_ptr + t[:, None] * M + p[None, :], l_pp, mask=t_ok[:, None] & pp_ok[None, :])

    p, is_pre, a_pp, b_pp, a_res, b_res = _gate_params(alpha_ptr, b_pre_ptr, b_post_ptr,
                                                       b_res_ptr, res_col, res_ok, N, PW)
    # Pre and post gates: pp column p < n is H_pre[p], n <= p < 2n is H_post[p - n].
    sig = tl.sigmoid(l_pp * a_pp[None, :] + b_pp[None, :])
    tl.store(h_pre_ptr + t[:, None] * N + p[None, :], sig + pre_eps,
             mask=t_ok[:, None] & is_pre[None, :])
    tl.store(h_post_ptr + t[:, None] * N + (p - N)[None, :], 2.0 * sig,
             mask=t_ok[:, None] & (pp_ok & ~is_pre)[None, :])

    # Residual map: Sinkhorn on [BT, NP, NP] (no scratch: STORE is off).
    h = tl.reshape(l_res * a_res + b_res[None, :], [BLOCK_T, NP, NP])
    ok = tl.reshape(m_res, [BLOCK_T, NP, NP])
    hr = _sinkhorn_fwd(h, ok, t, t_ok, sk_eps, log_range, r_ptr, ITERS, NP, LOG_OK, False)
    tl.store(h_res_ptr + t[:, None] * (N * N) + (res_col - 2 * N)[None, :],
             tl.reshape(hr, [BLOCK_T, NQ]), mask=m_res)


@triton.jit
def _gates_bwd(l_pp, a_pp, b_pp, p, is_pre, pp_ok, t, t_ok, m_pp, g_pre_ptr, g_post_ptr,
               N: tl.constexpr):
    """dL/dgate-logits of the pp tile [BT, PW]: H_pre = sigmoid(g) (+ a constant),
    H_post = 2 sigmoid(g), from their upstream gradients [T, n]."""
    sig = tl.sigmoid(l_pp * a_pp[None, :] + b_pp[None, :])
    g_pp = tl.load(g_pre_ptr + t[:, None] * N + p[None, :], mask=t_ok[:, None] & is_pre[None, :],
                   other=0.0) + \
        tl.load(g_post_ptr + t[:, None] * N + (p - N)[None, :],
                mask=t_ok[:, None] & (pp_ok & ~is_pre)[None, :], other=0.0)
    return tl.where(m_pp, g_pp * sig * (1.0 - sig) * tl.where(is_pre, 1.0, 2.0)[None, :], 0.0)


@triton.jit
def _store_grads(dgate_res, dgate_pp, l_res, l_pp, a_res, a_pp, r, K, t, t_ok, res_col, p,
                 m_res, m_pp, dgate_ptr, dz_ptr, coef_ptr, M: tl.constexpr,
                 PRECISION: tl.constexpr):
    """The maps backward's outputs from dL/dgate-logits (res tile [BT, NQ], pp tile [BT, PW]):
    dgate [T, M]; then, as logits = z / r with r = sqrt(mean(x^2) + eps), dz = dlogits / r
    [T, M] and r's share of dx, coef * x with coef = -sum(dlogits * logits) / (K r^2) [T]."""
    tl.store(dgate_ptr + t[:, None] * M + res_col[None, :], dgate_res, mask=m_res)
    tl.store(dgate_ptr + t[:, None] * M + p[None, :], dgate_pp, mask=m_pp)
    dl_res = dgate_res * a_res
    dl_pp = dgate_pp * a_pp[None, :]
    coef = -(tl.sum(dl_res * l_res, axis=1) + tl.sum(dl_pp * l_pp, axis=1)) / (K * r * r)
    dz_res = dl_res / r[:, None]
    dz_pp = dl_pp / r[:, None]
    if PRECISION == "tf32":  # dz feeds tf32 dots in mhc_dx_kernel and mhc_dphi_kernel: round it
        dz_res = _tf32(dz_res)
        dz_pp = _tf32(dz_pp)
    tl.store(dz_ptr + t[:, None] * M + res_col[None, :], dz_res, mask=m_res)
    tl.store(dz_ptr + t[:, None] * M + p[None, :], dz_pp, mask=m_pp)
    tl.store(coef_ptr + t, coef, mask=t_ok)


@triton.jit
def mhc_maps_bwd_kernel(
    alpha_ptr, b_pre_ptr, b_post_ptr, b_res_ptr, logits_ptr, r_ptr,
    g_pre_ptr, g_post_ptr, g_res_ptr,
    dgate_ptr, dz_ptr, coef_ptr, scratch_ptr,
    T, K, sk_eps, log_range,
    N: tl.constexpr, NP: tl.constexpr, PW: tl.constexpr, ITERS: tl.constexpr,
    LOG_OK: tl.constexpr, BLOCK_T: tl.constexpr, PRECISION: tl.constexpr,
):
    """Per token block: dL/dgate-logits, dz = dL/d(x @ phi) and r's coefficient.

    Writes dgate [T, M] (the host sums it and dgate * logits over tokens for the biases and
    gates), dz [T, M] (for dx = dz phi^T + coef x and dphi = x^T dz) and coef [T].
    """
    M: tl.constexpr = N * N + 2 * N
    NQ: tl.constexpr = NP * NP
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = t < T
    res_col, res_ok = _res_columns(N, NP)
    p, is_pre, a_pp, b_pp, a_res, b_res = _gate_params(alpha_ptr, b_pre_ptr, b_post_ptr,
                                                       b_res_ptr, res_col, res_ok, N, PW)
    pp_ok = p < 2 * N
    m_res = t_ok[:, None] & res_ok[None, :]
    m_pp = t_ok[:, None] & pp_ok[None, :]

    l_res = tl.load(logits_ptr + t[:, None] * M + res_col[None, :], mask=m_res, other=0.0)
    l_pp = tl.load(logits_ptr + t[:, None] * M + p[None, :], mask=m_pp, other=0.0)
    r = tl.load(r_ptr + t, mask=t_ok, other=1.0)

    # Gates: H_pre = sigmoid(g) + pre_eps, H_post = 2 sigmoid(g).
    dgate_pp = _gates_bwd(l_pp, a_pp, b_pp, p, is_pre, pp_ok, t, t_ok, m_pp, g_pre_ptr,
                          g_post_ptr, N)

    # Residual map: Sinkhorn backward on [BT, NP, NP].
    h = tl.reshape(l_res * a_res + b_res[None, :], [BLOCK_T, NP, NP])
    ok = tl.reshape(m_res, [BLOCK_T, NP, NP])
    g_res = tl.load(g_res_ptr + t[:, None] * (N * N) + (res_col - 2 * N)[None, :], mask=m_res,
                    other=0.0)
    dh = _sinkhorn_bwd(h, tl.reshape(g_res, [BLOCK_T, NP, NP]), ok, t, t_ok, sk_eps, log_range,
                       scratch_ptr, ITERS, NP, LOG_OK)
    dgate_res = tl.reshape(dh, [BLOCK_T, NQ])
    _store_grads(dgate_res, dgate_pp, l_res, l_pp, a_res, a_pp, r, K, t, t_ok, res_col, p,
                 m_res, m_pp, dgate_ptr, dz_ptr, coef_ptr, M, PRECISION)


@triton.jit
def mhc_dx_kernel(
    x_ptr, phi_ptr, dz_ptr, coef_ptr, dx_ptr, T, K, k_per_split,
    N: tl.constexpr, NP: tl.constexpr, PW: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    R: tl.constexpr = -1, RW: tl.constexpr = 0, ADD: tl.constexpr = False,
):
    """dx = dz @ phi^T + coef * x for one token block over one split of K (R, RW: as
    mhc_xphi_kernel's). ADD: dx += ..., in place: dx holds the merge's and the aggregation's
    shares (merge_dx_kernel's MODE 2), and the sum is x's whole gradient through a connection
    (ops/triton/ops.py (f))."""
    M: tl.constexpr = N * N + 2 * N if R < 0 else 2 * N + R
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = t < T
    res_col, res_ok = _res_columns(N, NP, R, RW)
    p = tl.arange(0, PW)
    pp_ok = p < 2 * N
    dz_res = tl.load(dz_ptr + t[:, None] * M + res_col[None, :],
                     mask=t_ok[:, None] & res_ok[None, :], other=0.0)  # [BT, NQ]
    dz_pp = tl.load(dz_ptr + t[:, None] * M + p[None, :],
                    mask=t_ok[:, None] & pp_ok[None, :], other=0.0)  # [BT, PW]
    coef = tl.load(coef_ptr + t, mask=t_ok, other=0.0)

    k_begin = tl.program_id(1).to(tl.int64) * k_per_split
    for k0 in range(0, k_per_split, BLOCK_K):
        k = k_begin + k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        # phi's columns, transposed: [NQ, BK] and [PW, BK]
        wt_res = tl.load(phi_ptr + k[None, :] * M + res_col[:, None],
                         mask=res_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        wt_pp = tl.load(phi_ptr + k[None, :] * M + p[:, None],
                        mask=pp_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        m_xk = t_ok[:, None] & k_ok[None, :]
        offs = t[:, None] * K + k[None, :]
        xk = tl.load(x_ptr + offs, mask=m_xk, other=0.0).to(tl.float32)
        dxk = coef[:, None] * xk
        if ADD:
            dxk += tl.load(dx_ptr + offs, mask=m_xk, other=0.0).to(tl.float32)
        dxk = tl.dot(dz_res, wt_res, dxk, input_precision=PRECISION)
        dxk = tl.dot(dz_pp, wt_pp, dxk, input_precision=PRECISION)
        tl.store(dx_ptr + offs, dxk.to(dx_ptr.dtype.element_ty), mask=m_xk)


@triton.jit
def mhc_dphi_kernel(
    x_ptr, dz_ptr, dphi_ptr, T, K, tokens_per_split,
    N: tl.constexpr, NP: tl.constexpr, PW: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    R: tl.constexpr = -1, RW: tl.constexpr = 0,
):
    """Partial dphi = x^T dz over one split of the tokens: dphi_ptr is [splits, K, M] (R, RW:
    as mhc_xphi_kernel's)."""
    M: tl.constexpr = N * N + 2 * N if R < 0 else 2 * N + R
    NQ: tl.constexpr = NP * NP if R < 0 else RW
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < K
    split = tl.program_id(1)
    res_col, res_ok = _res_columns(N, NP, R, RW)
    p = tl.arange(0, PW)
    pp_ok = p < 2 * N
    acc_res = tl.zeros([BLOCK_K, NQ], dtype=tl.float32)
    acc_pp = tl.zeros([BLOCK_K, PW], dtype=tl.float32)
    t_begin = split * tokens_per_split
    for t0 in range(0, tokens_per_split, BLOCK_T):
        t = (t_begin + t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        t_ok = (t < T) & (t0 + tl.arange(0, BLOCK_T) < tokens_per_split)
        xt = tl.load(x_ptr + t[None, :] * K + k[:, None], mask=k_ok[:, None] & t_ok[None, :],
                     other=0.0).to(tl.float32)  # [BK, BT]
        dz_res = tl.load(dz_ptr + t[:, None] * M + res_col[None, :],
                         mask=t_ok[:, None] & res_ok[None, :], other=0.0)
        dz_pp = tl.load(dz_ptr + t[:, None] * M + p[None, :],
                        mask=t_ok[:, None] & pp_ok[None, :], other=0.0)
        acc_res = tl.dot(xt, dz_res, acc_res, input_precision=PRECISION)
        acc_pp = tl.dot(xt, dz_pp, acc_pp, input_precision=PRECISION)
    out = dphi_ptr + split.to(tl.int64) * K * M + k[:, None].to(tl.int64) * M
    tl.store(out + res_col[None, :], acc_res, mask=k_ok[:, None] & res_ok[None, :])
    tl.store(out + p[None, :], acc_pp, mask=k_ok[:, None] & pp_ok[None, :])


# ---------------------------------------------------------------------------------------------
# (e) mHC's successors' maps (functional.successors.variant_maps)
#
# The successors keep mHC's read and write maps and replace Sinkhorn by a closed form of R res
# logits, columns 2n .. 2n+R-1 of phi (R: n! for mHC-lite, log2 n for KromHC, 0 for a static
# H_res). The matmul kernels above serve them unchanged, given R and the res tile's width RW
# (_res_columns); what differs is the per-token step: variant_maps_fwd_kernel and
# variant_maps_bwd_kernel below, in place of mhc_maps_fwd_kernel and mhc_maps_bwd_kernel.
# KIND: 1 mHC-lite, 2 KromHC, 0 the identity (a static H_res, and KromHC at n = 1: R = 0).
#
# H_res is built in float64 and rounded once, as functional.successors.variant_res builds it
# (n! or log2 n weights per token: negligible work). Its [BLOCK_T, NP*NP] tile holds entry
# (i, j) at q = i*NP + j, as mHC's.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _lite_hits(perm_ptr, k, i, j, N: tl.constexpr):
    """P_k at each (i, j) of the H_res tile: True where j = p_k(i); perm [R, N] (int32) holds
    p_k(i), the permutations in itertools.permutations order."""
    return j == tl.load(perm_ptr + k * N + i, mask=i < N, other=-1)


@triton.jit
def _column(v, cols, k):
    """Column k of v [BT, RW] as [BT] (a masked sum: one nonzero term)."""
    return tl.sum(tl.where(cols[None, :] == k, v, 0.0), axis=1)


@triton.jit
def _krom_factor(a, cols, i, j, k: tl.constexpr, R: tl.constexpr):
    """KromHC's factor k at each (i, j) of the H_res tile [BT, NQ]: a_k where bit k of i and
    j agree (bit 0 the most significant of R), 1 - a_k where they differ; and the sign +1 / -1
    of d factor / d a_k."""
    a_k = _column(a, cols, k)[:, None]
    same = (((i ^ j) >> (R - 1 - k)) & 1) == 0
    return tl.where(same[None, :], a_k, 1.0 - a_k), tl.where(same, 1.0, -1.0)


@triton.jit
def _variant_weights(z, res_ok, KIND: tl.constexpr):
    """The float64 weights of the res logits z [BT, RW] (float32): softmax(z) for mHC-lite,
    sigmoid(z) for KromHC; masked columns 0."""
    if KIND == 1:
        zw = tl.where(res_ok[None, :], z.to(tl.float64), -1e300)
        mx = tl.max(zw, axis=1)
        e = tl.where(res_ok[None, :], tl.exp(zw - mx[:, None]), 0.0)
        a = e / tl.sum(e, axis=1)[:, None]
    else:
        zw = tl.where(res_ok[None, :], z.to(tl.float64), 0.0)
        a = tl.where(res_ok[None, :], tl.sigmoid(zw), 0.0)
    return a


@triton.jit
def _variant_res(z, res_ok, perm_ptr, N: tl.constexpr, NP: tl.constexpr, R: tl.constexpr,
                 RW: tl.constexpr, KIND: tl.constexpr, BLOCK_T: tl.constexpr):
    """H_res [BT, NP*NP] (float64) from the gated res logits z [BT, RW]: sum_k softmax(z)_k P_k
    (mHC-lite), the Kronecker product of the factors (KromHC), or the identity."""
    q = tl.arange(0, NP * NP)
    i = q // NP
    j = q % NP
    cols = tl.arange(0, RW)
    if KIND == 1:
        a = _variant_weights(z, res_ok, KIND)
        h = tl.zeros([BLOCK_T, NP * NP], dtype=tl.float64)
        for k in range(R):
            hit = _lite_hits(perm_ptr, k, i, j, N)
            h += tl.where(hit[None, :], _column(a, cols, k)[:, None], 0.0)
    elif KIND == 2:
        a = _variant_weights(z, res_ok, KIND)
        h = tl.full([BLOCK_T, NP * NP], 1.0, dtype=tl.float64)
        for k in tl.static_range(R):
            factor, _ = _krom_factor(a, cols, i, j, k, R)
            h *= factor
    else:
        h = tl.where((i == j)[None, :], tl.full([BLOCK_T, NP * NP], 1.0, dtype=tl.float64), 0.0)
    return h


@triton.jit
def _variant_res_bwd(z, res_ok, g, perm_ptr, N: tl.constexpr, NP: tl.constexpr,
                     R: tl.constexpr, RW: tl.constexpr, KIND: tl.constexpr,
                     BLOCK_T: tl.constexpr):
    """dL/dz [BT, RW] (float32) from dL/dH_res g [BT, NP*NP] (float32, padded entries 0), in
    float64: mHC-lite dz = a (da - sum(a da)) with da_k = <g, P_k>; KromHC dz_k = a_k (1 - a_k)
    sum_ij g_ij sign_k(i, j) prod_{l != k} factor_l(i, j)."""
    q = tl.arange(0, NP * NP)
    i = q // NP
    j = q % NP
    cols = tl.arange(0, RW)
    gw = g.to(tl.float64)
    dz = tl.zeros([BLOCK_T, RW], dtype=tl.float64)
    if KIND == 1:
        a = _variant_weights(z, res_ok, KIND)
        da = tl.zeros([BLOCK_T, RW], dtype=tl.float64)
        for k in range(R):
            hit = _lite_hits(perm_ptr, k, i, j, N)
            da_k = tl.sum(tl.where(hit[None, :], gw, 0.0), axis=1)  # [BT]
            da = tl.where(cols[None, :] == k, da_k[:, None], da)
        dz = a * (da - tl.sum(a * da, axis=1)[:, None])
    elif KIND == 2:
        a = _variant_weights(z, res_ok, KIND)
        for k in tl.static_range(R):
            others = tl.full([BLOCK_T, NP * NP], 1.0, dtype=tl.float64)
            for k2 in tl.static_range(R):
                if k2 != k:
                    factor, _ = _krom_factor(a, cols, i, j, k2, R)
                    others *= factor
            _, sign = _krom_factor(a, cols, i, j, k, R)
            a_k = _column(a, cols, k)
            dz_k = a_k * (1.0 - a_k) * tl.sum(gw * sign[None, :] * others, axis=1)
            dz = tl.where(cols[None, :] == k, dz_k[:, None], dz)
    return tl.where(res_ok[None, :], dz, 0.0).to(tl.float32)


@triton.jit
def variant_maps_fwd_kernel(
    parts_ptr, ss_ptr, alpha_ptr, b_pre_ptr, b_post_ptr, b_res_ptr, perm_ptr,
    h_pre_ptr, h_post_ptr, h_res_ptr, logits_ptr, r_ptr,
    T, K, S, norm_eps,
    N: tl.constexpr, NP: tl.constexpr, PW: tl.constexpr, R: tl.constexpr, RW: tl.constexpr,
    KIND: tl.constexpr, BLOCK_T: tl.constexpr, UNROLL: tl.constexpr,
):
    """Per token block: the splits' sums (mhc_xphi_kernel's parts), then RMS, logits, gates
    (H_pre = sigmoid, H_post = 2 sigmoid) and the kind's H_res (float64, rounded once).
    logits [T, 2n + R], r [T]; b_res_ptr and perm_ptr are not read where unused (R = 0, not
    mHC-lite)."""
    M: tl.constexpr = 2 * N + R
    NQ: tl.constexpr = NP * NP
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = t < T
    res_col, res_ok = _res_columns(N, NP, R, RW)
    p = tl.arange(0, PW)
    pp_ok = p < 2 * N
    acc_res, acc_pp, ss = _sum_splits(parts_ptr, ss_ptr, t, t_ok, S, res_col, res_ok, p, pp_ok,
                                      N, NP, PW, BLOCK_T, UNROLL, R, RW)

    r = tl.sqrt(ss / K + norm_eps)  # [BT], RMS over n*C; divide after the matmul
    l_res = acc_res / r[:, None]  # [BT, RW]
    l_pp = acc_pp / r[:, None]  # [BT, PW]
    m_res = t_ok[:, None] & res_ok[None, :]
    tl.store(r_ptr + t, r, mask=t_ok)
    tl.store(logits_ptr + t[:, None] * M + res_col[None, :], l_res, mask=m_res)
    tl.store(logits_ptr + t[:, None] * M + p[None, :], l_pp, mask=t_ok[:, None] & pp_ok[None, :])

    p, is_pre, a_pp, b_pp, a_res, b_res = _gate_params(alpha_ptr, b_pre_ptr, b_post_ptr,
                                                       b_res_ptr, res_col, res_ok, N, PW, R)
    sig = tl.sigmoid(l_pp * a_pp[None, :] + b_pp[None, :])
    tl.store(h_pre_ptr + t[:, None] * N + p[None, :], sig, mask=t_ok[:, None] & is_pre[None, :])
    tl.store(h_post_ptr + t[:, None] * N + (p - N)[None, :], 2.0 * sig,
             mask=t_ok[:, None] & (pp_ok & ~is_pre)[None, :])

    hr = _variant_res(l_res * a_res + b_res[None, :], res_ok, perm_ptr, N, NP, R, RW, KIND,
                      BLOCK_T)  # [BT, NQ] float64
    q = tl.arange(0, NQ)
    i = q // NP
    j = q % NP
    tl.store(h_res_ptr + t[:, None] * (N * N) + (i * N + j)[None, :], hr.to(tl.float32),
             mask=t_ok[:, None] & ((i < N) & (j < N))[None, :])


@triton.jit
def variant_maps_bwd_kernel(
    alpha_ptr, b_pre_ptr, b_post_ptr, b_res_ptr, perm_ptr, logits_ptr, r_ptr,
    g_pre_ptr, g_post_ptr, g_res_ptr, dgate_ptr, dz_ptr, coef_ptr, T, K,
    N: tl.constexpr, NP: tl.constexpr, PW: tl.constexpr, R: tl.constexpr, RW: tl.constexpr,
    KIND: tl.constexpr, BLOCK_T: tl.constexpr, PRECISION: tl.constexpr,
):
    """Per token block: dgate [T, M], dz [T, M] and coef [T] as mhc_maps_bwd_kernel writes
    them, with the kind's H_res backward (float64) in place of Sinkhorn's."""
    M: tl.constexpr = 2 * N + R
    NQ: tl.constexpr = NP * NP
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = t < T
    res_col, res_ok = _res_columns(N, NP, R, RW)
    p, is_pre, a_pp, b_pp, a_res, b_res = _gate_params(alpha_ptr, b_pre_ptr, b_post_ptr,
                                                       b_res_ptr, res_col, res_ok, N, PW, R)
    pp_ok = p < 2 * N
    m_res = t_ok[:, None] & res_ok[None, :]
    m_pp = t_ok[:, None] & pp_ok[None, :]

    l_res = tl.load(logits_ptr + t[:, None] * M + res_col[None, :], mask=m_res, other=0.0)
    l_pp = tl.load(logits_ptr + t[:, None] * M + p[None, :], mask=m_pp, other=0.0)
    r = tl.load(r_ptr + t, mask=t_ok, other=1.0)

    # Gates: H_pre = sigmoid(g), H_post = 2 sigmoid(g).
    dgate_pp = _gates_bwd(l_pp, a_pp, b_pp, p, is_pre, pp_ok, t, t_ok, m_pp, g_pre_ptr,
                          g_post_ptr, N)

    # Residual map: the kind's closed-form backward.
    q = tl.arange(0, NQ)
    i = q // NP
    j = q % NP
    g_res = tl.load(g_res_ptr + t[:, None] * (N * N) + (i * N + j)[None, :],
                    mask=t_ok[:, None] & ((i < N) & (j < N))[None, :], other=0.0)
    dgate_res = tl.where(m_res, _variant_res_bwd(l_res * a_res + b_res[None, :], res_ok, g_res,
                                                 perm_ptr, N, NP, R, RW, KIND, BLOCK_T), 0.0)
    _store_grads(dgate_res, dgate_pp, l_res, l_pp, a_res, a_pp, r, K, t, t_ok, res_col, p,
                 m_res, m_pp, dgate_ptr, dz_ptr, coef_ptr, M, PRECISION)


# ---------------------------------------------------------------------------------------------
# (b) pre-aggregation
# ---------------------------------------------------------------------------------------------


@triton.jit
def pre_fwd_kernel(
    x_ptr, h_ptr, out_ptr, T, C,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """out[t, c] = sum_j h[t, j] x[t, j, c]; grid (token blocks, channel blocks).

    One [BLOCK_T, BLOCK_C] row of x at a time, so the sum over j is a chain of multiply-adds
    in registers: reducing a [BT, NP, BC] tile over its middle axis instead crosses warps
    (shared memory and barriers; a quarter of a copy's bandwidth on an H200)."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok, c_ok = t < T, c < C
    mtc = t_ok[:, None] & c_ok[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(N):
        hj = tl.load(h_ptr + t * N + j, mask=t_ok, other=0.0).to(tl.float32)  # [BT]
        xj = tl.load(x_ptr + (t[:, None] * N + j) * C + c[None, :], mask=mtc,
                     other=0.0).to(tl.float32)  # [BT, BC]
        acc += hj[:, None] * xj
    tl.store(out_ptr + t[:, None] * C + c[None, :], acc.to(out_ptr.dtype.element_ty), mask=mtc)


@triton.jit
def pre_bwd_kernel(
    x_ptr, h_ptr, da_ptr, dx_ptr, dh_ptr, T, C,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    WRITE_DX: tl.constexpr = True,
):
    """dx[t, j, c] = h[t, j] da[t, c]; dh[t, j] = sum_c x[t, j, c] da[t, c] (loop over C).
    WRITE_DX False: dh only (dx_ptr None: merge_dx_kernel's MODE 2 writes dx's share)."""
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
        if WRITE_DX:
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


# The merge's backward is two kernels. dx and df are sums over the n input streams for every
# channel (merge_dx_kernel: a grid over tokens and channels, as the forward); dH_post and
# dH_res are sums over the channels for every token (merge_dh_kernel: each program loops over
# C). One program doing both reduced [BT, NP, BC] tiles across warps n + 2 times per channel
# block: 2.7% of a copy's bandwidth on an H200. Apart, merge_dx_kernel has no loop and
# merge_dh_kernel's loop waits at no block-wide barrier (counted in the PTX by
# tests/ops/test_triton_aot.py); the price is g read twice.


@triton.jit
def merge_dx_kernel(
    h_post_ptr, h_res_ptr, g_ptr, dx_ptr, df_ptr, T, C, h_pre_ptr, da_ptr,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    MODE: tl.constexpr = 0,
):
    """dx[t, j] = sum_i H_res[t, i, j] g[t, i]; df[t] = sum_i H_post[t, i] g[t, i]; grid
    (token blocks, channel blocks). MODE 0: both (h_pre_ptr, da_ptr None); 1: df only
    (dx_ptr None: the merge's backward under fused_dx); 2: dx plus the aggregation's share
    H_pre[t, j] da[t] (h_post_ptr, df_ptr None: the first of the fused maps backward's
    dx, which mhc_dx_kernel then adds its share to)."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, NP)
    t3, j3, c3 = t[:, None, None], j[None, :, None], c[None, None, :]
    t_ok, j_ok, c_ok = t3 < T, j3 < N, c3 < C
    dx = tl.zeros([BLOCK_T, NP, BLOCK_C], dtype=tl.float32)
    df = tl.zeros([BLOCK_T, 1, BLOCK_C], dtype=tl.float32)
    if MODE == 2:
        h_pre = tl.load(h_pre_ptr + t3 * N + j3, mask=t_ok & j_ok, other=0.0).to(tl.float32)
        da = tl.load(da_ptr + t3 * C + c3, mask=t_ok & c_ok, other=0.0).to(tl.float32)
        dx = h_pre * da  # [BT, NP, BC]
    for i in tl.static_range(N):
        gi = tl.load(g_ptr + (t3 * N + i) * C + c3, mask=t_ok & c_ok,
                     other=0.0).to(tl.float32)  # [BT, 1, BC]
        if MODE != 1:
            h_row = tl.load(h_res_ptr + (t3 * N + i) * N + j3, mask=t_ok & j_ok,
                            other=0.0).to(tl.float32)  # [BT, NP, 1] = H_res[t, i, :]
            dx += h_row * gi
        if MODE != 2:
            hp = tl.load(h_post_ptr + t3 * N + i, mask=t_ok, other=0.0).to(tl.float32)
            df += hp * gi  # hp [BT, 1, 1]
    if MODE != 1:
        tl.store(dx_ptr + (t3 * N + j3) * C + c3, dx.to(dx_ptr.dtype.element_ty),
                 mask=t_ok & j_ok & c_ok)
    if MODE != 2:
        tl.store(df_ptr + t3 * C + c3, df.to(df_ptr.dtype.element_ty), mask=t_ok & c_ok)


@triton.jit
def merge_dh_kernel(
    x_ptr, f_ptr, g_ptr, dh_post_ptr, dh_res_ptr, T, C,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Program (token block, j), j the fastest of a one-dimensional grid (a grid's second
    axis holds at most 65535 blocks): dH_res[t, :, j] = sum_c g[t, :, c] x[t, j, c] for
    j < n, dH_post[t, :] = sum_c g[t, :, c] f[t, c] for j = n. The n + 1 programs of a token
    block are neighbours, so g's re-reads come from L2.

    Products accumulate elementwise over the channel blocks and are summed over C once, at
    the end. The row v (x[t, j] or f[t]) is loaded through pointers spanning the whole
    [BT, NP, BC] tile (the same address for every i) so that it has g's layout: loaded as a
    [BT, 1, BC] row, its broadcast went through shared memory in every iteration."""
    pid = tl.program_id(0)
    jj = pid % (N + 1)
    t = ((pid // (N + 1)) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    i = tl.arange(0, NP)
    t3, i3 = t[:, None, None], i[None, :, None]
    t_ok, i_ok = t3 < T, i3 < N
    z3 = i3 * 0
    is_x, is_f = z3 + jj < N, z3 + jj == N  # [1, NP, 1]: masks as tensors
    acc = tl.zeros([BLOCK_T, NP, BLOCK_C], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        c3 = (c0 + tl.arange(0, BLOCK_C))[None, None, :]
        c_ok = c3 < C
        g = tl.load(g_ptr + (t3 * N + i3) * C + c3, mask=t_ok & i_ok & c_ok,
                    other=0.0).to(tl.float32)  # [BT, NP, BC]
        v = tl.load(x_ptr + (t3 * N + jj) * C + c3 + z3, mask=t_ok & c_ok & is_x,
                    other=0.0).to(tl.float32) \
            + tl.load(f_ptr + t3 * C + c3 + z3, mask=t_ok & c_ok & is_f,
                      other=0.0).to(tl.float32)  # [BT, NP, BC], equal along NP
        acc += g * v
    d = tl.sum(acc, axis=2, keep_dims=True)  # [BT, NP, 1]
    tl.store(dh_res_ptr + (t3 * N + i3) * N + jj, d, mask=t_ok & i_ok & is_x)
    tl.store(dh_post_ptr + t3 * N + i3, d, mask=t_ok & i_ok & is_f)


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
    logits_ptr, out_ptr, T, eps, log_range,
    N: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr, LOG_OK: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    h, offs, ok = _load_matrices(logits_ptr, t, t < T, N, NP)
    p = _sinkhorn_fwd(h, ok, t, t < T, eps, log_range, out_ptr, ITERS, NP, LOG_OK, False)
    tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def sinkhorn_bwd_kernel(
    logits_ptr, g_ptr, dlogits_ptr, scratch_ptr, T, eps, log_range,
    N: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr, LOG_OK: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    h, offs, ok = _load_matrices(logits_ptr, t, t < T, N, NP)
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    dh = _sinkhorn_bwd(h, g, ok, t, t < T, eps, log_range, scratch_ptr, ITERS, NP, LOG_OK)
    tl.store(dlogits_ptr + offs, dh.to(dlogits_ptr.dtype.element_ty), mask=ok)
