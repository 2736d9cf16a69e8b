/* torch_mhc native CPU kernels: the mHC connection's passes over the streams, one loop each.

   Built and loaded by native.py (plain C11 with GCC/Clang vector extensions, no torch
   headers); called through ctypes on contiguous tensors (the two decoding calls at the
   end also through decode_calls.c, a CPython extension). Shapes: x [T, n, C] streams in fp32
   or bf16 (the `bf` flag; bf16 is converted to fp32 in registers and rounded once on store),
   K = n C, maps in fp32, M = 2 n + R map logits per token (pre, post, then the R res logits:
   n n row-major for mHC's Sinkhorn, fewer for its successors, see `res` below),
   Mp = 8 MV >= M the padded width of phi's rows. Every entry point processes the token
   range [t0, t1): native.py splits the tokens over threads.

   Why this shape of code: a connection is a handful of passes over [T, n, C] tensors, so
   the cost is memory traffic plus loop overhead. Each kernel reads every row once, keeps
   per-token partial results in vector registers (loops over n and over the 16-wide vector
   chunks are unrolled for the common n through the WITH_N specialisation), and fuses what
   would otherwise be separate passes:
     maps_fwd   logits x @ phi (a register-tiled skinny matmul) + the RMS + gates + Sinkhorn +
                the pre-aggregation, per tile of tokens while the tile is in cache;
     maps_bwd   the aggregation's dH_pre, the gates' and Sinkhorn's backward, dphi += x^T dz
                and dx = coef x + dz phi^T + H_pre da + H_res^T g_merge in one pass;
     merge_fwd  H_res x + H_post f;  merge_bwd  df, dH_post, and dH_res and dx unless the
                maps' backward takes the merge's gradient (the fused_dx path of ops/cpu/ops.py:
                the maps' backward then computes the merge's dH_res and H_res^T g from the x
                and g it reads anyway, and the merge's backward does not read x);
     rows_fwd / rows_bwd, hc_bwd  the same for HC's maps, per stream row: x_j @ W, and a
                backward whose dx also takes the aggregation's and the merge's shares;
     hc_fwd     HC's maps and aggregation for inference (decoding), one call per step.
   mHC's successors (mHC-lite, KromHC, static H_res) run maps_fwd and maps_bwd too: only
   the per-token step from the res logits to H_res differs (the `res` argument). */

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

typedef uint16_t bf16_t;
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

#define INLINE static inline __attribute__((always_inline))
#define W 16          /* floats per vector chunk */
#define MAX_TILE 8    /* tokens per register tile */
#define MAX_MV 10     /* 8-float vectors per phi row: M = n n + 2 n <= 80, n <= MAXN */
#define MAXN 8        /* streams; native.supports() sends larger n to torch */

/* ---- loads and stores of 16-wide chunks (w < 16 only at a row's tail, zero padded) ---- */

INLINE v16 vzero(void) { return (v16){0}; }
INLINE v16 vload(const float* p) { v16 v; memcpy(&v, p, sizeof v); return v; }
INLINE void vstore(float* p, v16 v) { memcpy(p, &v, sizeof v); }

INLINE float hsum(v16 v) {
    v8 a, b;
    memcpy(&a, &v, 32);
    memcpy(&b, (char*)&v + 32, 32);
    a += b;
    v4 c, d;
    memcpy(&c, &a, 16);
    memcpy(&d, (char*)&a + 16, 16);
    c += d;
    return (c[0] + c[2]) + (c[1] + c[3]);
}

INLINE float bf16_to_f32(bf16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even; a NaN stays a (quiet) NaN. */
INLINE u16x16 f32_to_bf16(v16 v) {
    u32x16 u;
    memcpy(&u, &v, sizeof u);
    const u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const u32x16 nan = (u >> 16) | 0x40u;
    const u32x16 is_nan = (u32x16)((u & 0x7fffffffu) > 0x7f800000u);
    return __builtin_convertvector((nan & is_nan) | (rounded & ~is_nan), u16x16);
}

/* Element i of storage p (fp32 or bf16) as a float. */
INLINE float lds(const void* p, int64_t i, int bf) {
    return bf ? bf16_to_f32(((const bf16_t*)p)[i]) : ((const float*)p)[i];
}

INLINE v16 ldw(const void* p, int64_t i, int w, int bf) {
    if (bf) {
        u16x16 h = {0};
        memcpy(&h, (const bf16_t*)p + i, (size_t)w * 2);
        const u32x16 u = __builtin_convertvector(h, u32x16) << 16;
        v16 f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    if (w == W) return vload((const float*)p + i);
    v16 v = vzero();
    memcpy(&v, (const float*)p + i, (size_t)w * 4);
    return v;
}

INLINE void stw(void* p, int64_t i, v16 v, int w, int bf) {
    if (bf) {
        const u16x16 h = f32_to_bf16(v);
        memcpy((bf16_t*)p + i, &h, (size_t)w * 2);
    } else if (w == W) {
        vstore((float*)p + i, v);
    } else {
        memcpy((float*)p + i, &v, (size_t)w * 4);
    }
}

/* Store a full chunk (w = 16) without reading its cache line first (a streaming store):
   for outputs that are not read again while they would still be in cache. The merge's
   output [T, n, C] is written once and read by the next layer's maps after 16 MB of other
   traffic; with streaming stores, merge forward + the next maps forward took 0.4-0.7 ms
   less (2048 x 4 x 512, fp32; benchmarks/NOTES_ops.md). Falls back to a plain store where
   the ISA has no such store or p is not aligned; callers end with stream_fence(). */
INLINE void stw_stream(void* p, int64_t i, v16 v, int bf) {
#if defined(__AVX512F__)
    if (!bf) {
        float* q = (float*)p + i;
        if (((uintptr_t)q & 63) == 0) {
            __m512 m;
            memcpy(&m, &v, sizeof m);
            _mm512_stream_ps(q, m);
            return;
        }
    }
#endif
#if defined(__AVX__)
    if (bf) {
        bf16_t* q = (bf16_t*)p + i;
        if (((uintptr_t)q & 31) == 0) {
            const u16x16 h = f32_to_bf16(v);
            __m256i m;
            memcpy(&m, &h, sizeof m);
            _mm256_stream_si256((__m256i*)q, m);
            return;
        }
    }
#endif
    stw(p, i, v, W, bf);
}

/* Outputs smaller than this (elements per call's range) take ordinary stores: 1 MiB of
   float32, half of a 2 MiB L2. */
#define STREAM_MIN_FLOATS (1 << 18)

/* Order the streaming stores before whatever the caller does next. */
INLINE void stream_fence(void) {
#if defined(__SSE__)
    _mm_sfence();
#endif
}

/* Ask for rows[row0 .. row0 + rows) at column c of the [*, C] storage p: called with the
   next token's rows while this token's are processed. The passes that read a tensor for the
   first time are bound by memory latency otherwise (the hardware prefetcher alone keeps too
   few of the n interleaved row streams in flight): prefetching one token ahead took 1.7 ms
   off the maps backward and 0.5 ms off the merge backward (2048 x 4 x 512, fp32, out of
   cache; benchmarks/NOTES_ops.md). Prefetches never fault; callers stay inside the tensor. */
INLINE void prefetch_rows(const void* p, int64_t row0, int64_t rows, int64_t C, int64_t c,
                          int bf) {
    const char* b = (const char*)p;
    const int64_t size = bf ? 2 : 4;
    for (int64_t j = 0; j < rows; ++j) __builtin_prefetch(b + ((row0 + j) * C + c) * size);
}

/* for (c = 0; c < C; c += 16) { BODY } with w the chunk's width; BODY is compiled twice: a
   loop over the full chunks (w the constant 16: plain vector loads), then the tail chunk
   after it. With the tail's copy inside the same loop (an if on the width at each chunk),
   its masked loads' temporaries shared the loop with the sums carried across chunks, and GCC
   kept those sums on the stack where they outnumbered the free vector registers (the maps
   backward's 20 dot products at n = 4: each multiply-add with a load and a store beside it);
   with the tail apart, token_dots compiled on its own holds them in registers (inlined into
   a function as large as maps_bwd_body it still did not: see maps_token_dots).
   Without AVX-512 (16 vector registers, two to a 16-float vector) those sums cannot stay in
   registers either way, and the split loops took the maps backward from 11.2 to 14.1 ms
   (T = 2048, n = 4, C = 512, one Zen 4 core built with -mno-avx512f, 2026-12-03): there the
   one loop stays. */
#if defined(__AVX512F__)
#define FOR_CHUNKS(c, w, C, ...)                                                \
    for (int64_t c = 0, c##_end_ = (C); c < c##_end_; c = c##_end_) {           \
        for (; c + W <= c##_end_; c += W) { const int w = W; __VA_ARGS__ }      \
        for (; c < c##_end_; c += W) { const int w = (int)(c##_end_ - c); __VA_ARGS__ } \
    }
#else
#define FOR_CHUNKS(c, w, C, ...)                                          \
    for (int64_t c = 0; c < (C); c += W) {                                \
        if ((C) - c >= W) { const int w = W; __VA_ARGS__ }                \
        else { const int w = (int)((C) - c); __VA_ARGS__ }                \
    }
#endif

/* Call CALL with N_ a compile-time constant for the usual stream counts, so that loops over
   n unroll and small per-token arrays live in registers; other n run the generic code. */
#define WITH_N(n, CALL)                                             \
    switch (n) {                                                    \
        case 1: { enum { N_ = 1 }; CALL; break; }                   \
        case 2: { enum { N_ = 2 }; CALL; break; }                   \
        case 4: { enum { N_ = 4 }; CALL; break; }                   \
        default: { const int64_t N_ = (n); CALL; break; }           \
    }

/* CALL with bf a constant, as in the exported entry points: each dtype's loops apart */
#define FOR_DTYPE(BF, CALL)                                                             \
    do {                                                                                \
        if (BF) { const int bf = 1; CALL; } else { const int bf = 0; CALL; }            \
    } while (0)

/* ---------------------------------------------------------------------------------------
   Post-and-merge
   --------------------------------------------------------------------------------------- */

/* out[t, i] = sum_j h_res[t, i, j] x[t, j] + h_post[t, i] f[t] */
INLINE void merge_fwd_body(const void* x, const void* f, const float* hp, const float* hr,
                           void* out, int64_t t0, int64_t t1, const int64_t n, int64_t C,
                           int bf) {
    /* Streaming stores pay off for outputs the caches would lose anyway; a few tokens'
       (decoding) are read again at once by the next connection. */
    const int stream = (t1 - t0) * n * C >= STREAM_MIN_FLOATS;
    for (int64_t t = t0; t < t1; ++t) {
        const float* hpt = hp + t * n;
        const float* hrt = hr + t * n * n;
        FOR_CHUNKS(c, w, C,
            const v16 fv = ldw(f, t * C + c, w, bf);
            v16 xv[MAXN];
            for (int64_t j = 0; j < n; ++j) xv[j] = ldw(x, (t * n + j) * C + c, w, bf);
            for (int64_t i = 0; i < n; ++i) {
                /* The reference's order: the mixing sum, then + H_post f. */
                v16 acc = hrt[i * n] * xv[0];
                for (int64_t j = 1; j < n; ++j) acc += hrt[i * n + j] * xv[j];
                acc += hpt[i] * fv;
                if (w == W && stream)
                    stw_stream(out, (t * n + i) * C + c, acc, bf);
                else
                    stw(out, (t * n + i) * C + c, acc, w, bf);
            }
        )
    }
    stream_fence();
}

/* df[t] = sum_i h_post[t, i] g[t, i]; dh_post[t, i] = <g[t, i], f[t]>; and, with_x,
   dh_res[t, i, j] = <g[t, i], x[t, j]> and dx[t, j] = sum_i h_res[t, i, j] g[t, i]. Without
   (dx and dhr NULL) is the fused_dx path: the maps' backward, which reads x and g anyway,
   computes H_res^T g and <g_i, x_j> itself, so this pass does not read x. */
INLINE void merge_bwd_pass(const void* x, const void* f, const float* hp, const float* hr,
                           const void* g, void* dx, void* df, float* dhp, float* dhr,
                           int64_t t0, int64_t t1, const int64_t n, int64_t C, const int with_x,
                           int bf) {
    for (int64_t t = t0; t < t1; ++t) {
        const float* hpt = hp + t * n;
        const float* hrt = hr + t * n * n;
        v16 sp[MAXN], sr[MAXN * MAXN];
        for (int64_t i = 0; i < n; ++i) sp[i] = vzero();
        for (int64_t q = 0; q < n * n; ++q) sr[q] = vzero();
        const int ahead = t + 1 < t1;
        FOR_CHUNKS(c, w, C,
            if (ahead) {
                prefetch_rows(f, t + 1, 1, C, c, bf);
                if (with_x) prefetch_rows(x, (t + 1) * n, n, C, c, bf);
                prefetch_rows(g, (t + 1) * n, n, C, c, bf);
            }
            const v16 fv = ldw(f, t * C + c, w, bf);
            v16 gv[MAXN], xv[MAXN];
            for (int64_t i = 0; i < n; ++i) {
                gv[i] = ldw(g, (t * n + i) * C + c, w, bf);
                if (with_x) xv[i] = ldw(x, (t * n + i) * C + c, w, bf);
            }
            if (with_x)
                for (int64_t j = 0; j < n; ++j) {
                    v16 acc = vzero();
                    for (int64_t i = 0; i < n; ++i) acc += hrt[i * n + j] * gv[i];
                    stw(dx, (t * n + j) * C + c, acc, w, bf);
                }
            v16 acc = vzero();
            for (int64_t i = 0; i < n; ++i) {
                acc += hpt[i] * gv[i];
                sp[i] += gv[i] * fv;
                if (with_x)
                    for (int64_t j = 0; j < n; ++j) sr[i * n + j] += gv[i] * xv[j];
            }
            stw(df, t * C + c, acc, w, bf);
        )
        for (int64_t i = 0; i < n; ++i) {
            dhp[t * n + i] = hsum(sp[i]);
            if (with_x)
                for (int64_t j = 0; j < n; ++j) dhr[(t * n + i) * n + j] = hsum(sr[i * n + j]);
        }
    }
}

INLINE void merge_bwd_body(const void* x, const void* f, const float* hp, const float* hr,
                           const void* g, void* dx, void* df, float* dhp, float* dhr,
                           int64_t t0, int64_t t1, const int64_t n, int64_t C, int bf) {
    if (dhr)  /* and dx: both are given, or neither */
        merge_bwd_pass(x, f, hp, hr, g, dx, df, dhp, dhr, t0, t1, n, C, 1, bf);
    else
        merge_bwd_pass(x, f, hp, hr, g, NULL, df, dhp, NULL, t0, t1, n, C, 0, bf);
}

/* ---------------------------------------------------------------------------------------
   Pre-aggregation (standalone: HC, and mHC without the fused maps)
   --------------------------------------------------------------------------------------- */

/* a[t] = sum_j h[t, j] x[t, j] for one token */
INLINE void aggregate_row(const void* x, const float* h, void* a, int64_t t, const int64_t n,
                          int64_t C, int bf) {
    FOR_CHUNKS(c, w, C,
        v16 acc = vzero();
        for (int64_t j = 0; j < n; ++j) acc += h[j] * ldw(x, (t * n + j) * C + c, w, bf);
        stw(a, t * C + c, acc, w, bf);
    )
}

/* For one token, in one pass over its rows: dots[j] = <x[t, j], da[t]> (unless da is NULL)
   and dres[i n + j] = <g[t, i], x[t, j]> (unless g is NULL; the merge's dH_res on the
   fused_dx path). With `ahead`, prefetches token t + 1's rows. */
INLINE void token_dots_pass(const void* x, const void* da, const void* g, float* dots,
                            float* dres, int64_t t, int ahead, const int64_t n, int64_t C,
                            const int with_a, const int with_g, int bf) {
    v16 sa[MAXN], sg[MAXN * MAXN];
    for (int64_t j = 0; j < n; ++j) sa[j] = vzero();
    for (int64_t q = 0; q < n * n; ++q) sg[q] = vzero();
    FOR_CHUNKS(c, w, C,
        if (ahead) {
            if (with_a) prefetch_rows(da, t + 1, 1, C, c, bf);
            if (with_g) prefetch_rows(g, (t + 1) * n, n, C, c, bf);
            prefetch_rows(x, (t + 1) * n, n, C, c, bf);
        }
        const v16 av = with_a ? ldw(da, t * C + c, w, bf) : vzero();
        v16 gv[MAXN];
        if (with_g)
            for (int64_t i = 0; i < n; ++i) gv[i] = ldw(g, (t * n + i) * C + c, w, bf);
        for (int64_t j = 0; j < n; ++j) {
            const v16 xv = ldw(x, (t * n + j) * C + c, w, bf);
            if (with_a) sa[j] += av * xv;
            if (with_g)
                for (int64_t i = 0; i < n; ++i) sg[i * n + j] += gv[i] * xv;
        }
    )
    if (with_a)
        for (int64_t j = 0; j < n; ++j) dots[j] = hsum(sa[j]);
    if (with_g)
        for (int64_t q = 0; q < n * n; ++q) dres[q] = hsum(sg[q]);
}

INLINE void token_dots(const void* x, const void* da, const void* g, float* dots, float* dres,
                       int64_t t, int ahead, const int64_t n, int64_t C, int bf) {
    if (da && g)
        token_dots_pass(x, da, g, dots, dres, t, ahead, n, C, 1, 1, bf);
    else if (da)
        token_dots_pass(x, da, NULL, dots, NULL, t, ahead, n, C, 1, 0, bf);
    else if (g)
        token_dots_pass(x, NULL, g, NULL, dres, t, ahead, n, C, 0, 1, bf);
}

INLINE void pre_fwd_body(const void* x, const float* h, void* a, int64_t t0, int64_t t1,
                         const int64_t n, int64_t C, int bf) {
    for (int64_t t = t0; t < t1; ++t) aggregate_row(x, h + t * n, a, t, n, C, bf);
}

/* dx[t, j] = h[t, j] da[t]; dh[t, j] = <x[t, j], da[t]> */
INLINE void pre_bwd_body(const void* x, const float* h, const void* da, void* dx, float* dh,
                         int64_t t0, int64_t t1, const int64_t n, int64_t C, int bf) {
    for (int64_t t = t0; t < t1; ++t) {
        FOR_CHUNKS(c, w, C,
            const v16 av = ldw(da, t * C + c, w, bf);
            for (int64_t j = 0; j < n; ++j)
                stw(dx, (t * n + j) * C + c, h[t * n + j] * av, w, bf);
        )
        token_dots(x, da, NULL, dh + t * n, NULL, t, t + 1 < t1, n, C, bf);
    }
}

/* ---------------------------------------------------------------------------------------
   Sinkhorn (paper Eq. 9, the same steps as ops/cpu/ops.py's token-last version) on 16 tokens at
   once, one token per vector lane: m[q] holds entry q = i n + j of the 16 matrices. A
   column softmax (+ eps), a row normalisation, then (columns, rows) iters - 1 times; each
   normalisation divides by the sum along its axis (+ eps). Step s of the 2 iters - 1
   normalisations is a row step for even s and a column step for odd s.
   --------------------------------------------------------------------------------------- */

#define G 16  /* tokens per lane group */

/* One normalisation of m [n n] along rows (axis 1) or columns (axis 0), in place; d[n]
   receives the denominators. */
INLINE void normalise(v16* m, v16* d, int axis, int64_t n, float eps) {
    for (int64_t a = 0; a < n; ++a) {
        v16 s = vzero();
        for (int64_t b = 0; b < n; ++b) s += axis ? m[a * n + b] : m[b * n + a];
        d[a] = s + eps;
    }
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j) m[i * n + j] /= d[axis ? i : j];
}

/* m: the column softmax p0 on entry, H_res on exit. */
INLINE void sinkhorn_fwd_lanes(v16* m, int64_t n, int iters, float eps) {
    v16 d[n];
    for (int64_t q = 0; q < n * n; ++q) m[q] += eps;
    for (int64_t s = 0; s < 2 * (int64_t)iters - 1; ++s) normalise(m, d, s % 2 ? 0 : 1, n, eps);
}

/* Exact reverse of the unrolled loop: g [n n] (upstream) becomes dL/dh in place, with
   p0 the column softmax of h; out receives H_res. y [(2 iters - 1) n n] and d
   [(2 iters - 1) n] are scratch for the recomputed iterates. */
INLINE void sinkhorn_bwd_lanes(const v16* p0, v16* g, v16* out, v16* y, v16* d, int64_t n,
                               int iters, float eps) {
    const int64_t nn = n * n, steps = 2 * (int64_t)iters - 1;
    for (int64_t q = 0; q < nn; ++q) y[q] = p0[q] + eps;
    for (int64_t s = 0; s < steps; ++s) {
        if (s) memcpy(y + s * nn, y + (s - 1) * nn, sizeof(v16) * nn);
        normalise(y + s * nn, d + s * n, s % 2 ? 0 : 1, n, eps);
    }
    memcpy(out, y + (steps - 1) * nn, sizeof(v16) * nn);
    /* Each step is y = m / d with d the sum of m along its axis (+ eps):
       dL/dm = (g - sum_axis(g y)) / d. */
    for (int64_t s = steps - 1; s >= 0; --s) {
        const int axis = s % 2 ? 0 : 1;
        const v16* ys = y + s * nn;
        for (int64_t a = 0; a < n; ++a) {
            v16 dot = vzero();
            for (int64_t b = 0; b < n; ++b) {
                const int64_t q = axis ? a * n + b : b * n + a;
                dot += g[q] * ys[q];
            }
            for (int64_t b = 0; b < n; ++b) {
                const int64_t q = axis ? a * n + b : b * n + a;
                g[q] = (g[q] - dot) / d[s * n + a];
            }
        }
    }
    for (int64_t j = 0; j < n; ++j) {  /* the column softmax */
        v16 dot = vzero();
        for (int64_t i = 0; i < n; ++i) dot += g[i * n + j] * p0[i * n + j];
        for (int64_t i = 0; i < n; ++i) g[i * n + j] = p0[i * n + j] * (g[i * n + j] - dot);
    }
}

/* The column softmax of one token's h [n n] into lane u of p0. */
INLINE void column_softmax_lane(const float* h, v16* p0, int u, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
        float mx = h[j];
        for (int64_t i = 1; i < n; ++i) mx = h[i * n + j] > mx ? h[i * n + j] : mx;
        float e[n], s = 0.0f;
        for (int64_t i = 0; i < n; ++i) s += (e[i] = expf(h[i * n + j] - mx));
        for (int64_t i = 0; i < n; ++i) p0[i * n + j][u] = e[i] / s;
    }
}

/* Far matrices (torch_mhc/functional/sinkhorn.py): a token whose n n Sinkhorn logits span more than
   LINEAR_RANGE (or hold a NaN) would underflow to 0 / 0 in the lanes' linear-domain loop; its
   lane runs the uniform matrix instead, and the scalar log-domain loop below computes the
   same unrolled function for it (eps = 0 only: with eps > 0 no denominator is below eps). */
#define LINEAR_RANGE 32.0f

INLINE int far_matrix(const float* h, int64_t nn, float eps) {
    if (eps != 0.0f) return 0;
    float lo = h[0], hi = h[0];
    for (int64_t q = 1; q < nn; ++q) {
        lo = h[q] < lo ? h[q] : lo;
        hi = h[q] > hi ? h[q] : hi;
    }
    return !(hi - lo <= LINEAR_RANGE);
}

/* z[0], z[s], ... z[(n - 1) s] <- their log_softmax: (z - max) - log(sum(exp(z - max))). */
INLINE void log_normalise(float* z, int64_t n, int64_t s) {
    float mx = z[0];
    for (int64_t i = 1; i < n; ++i) mx = z[i * s] > mx ? z[i * s] : mx;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += expf(z[i * s] - mx);
    const float l = logf(sum);
    for (int64_t i = 0; i < n; ++i) z[i * s] = (z[i * s] - mx) - l;
}

/* One matrix h [n n] in the log domain: 2 iters steps, columns first; out = exp(Z). keep
   (unless NULL) receives exp(Z) after every step, [2 iters n n]. */
static void sinkhorn_log_fwd(const float* h, float* out, float* keep, int64_t n, int iters) {
    const int64_t nn = n * n;
    float z[nn];
    memcpy(z, h, sizeof(float) * nn);
    for (int64_t s = 0; s < 2 * (int64_t)iters; ++s) {
        for (int64_t a = 0; a < n; ++a) {
            if (s % 2 == 0) log_normalise(z + a, n, n);  /* column a */
            else log_normalise(z + a * n, n, 1);         /* row a */
        }
        if (keep)
            for (int64_t q = 0; q < nn; ++q) keep[s * nn + q] = expf(z[q]);
    }
    for (int64_t q = 0; q < nn; ++q) out[q] = expf(z[q]);
}

/* Its exact reverse: dh = dL/dh for the upstream g [n n], out = the forward's result; keep:
   scratch of 2 iters n n floats. Z' = log_softmax(Z) has the adjoint
   dZ = dZ' - exp(Z') sum(dZ') along the step's axis. */
static void sinkhorn_log_bwd(const float* h, const float* g, float* dh, float* out,
                             float* keep, int64_t n, int iters) {
    const int64_t nn = n * n;
    sinkhorn_log_fwd(h, out, keep, n, iters);
    for (int64_t q = 0; q < nn; ++q) dh[q] = g[q] * out[q];
    for (int64_t s = 2 * (int64_t)iters - 1; s >= 0; --s) {
        const float* p = keep + s * nn;
        const int64_t step = s % 2 == 0 ? n : 1, across = s % 2 == 0 ? 1 : n;
        for (int64_t a = 0; a < n; ++a) {
            float sum = 0.0f;
            for (int64_t b = 0; b < n; ++b) sum += dh[a * across + b * step];
            for (int64_t b = 0; b < n; ++b)
                dh[a * across + b * step] -= p[a * across + b * step] * sum;
        }
    }
}

/* Unused lanes of a partial group: the uniform matrix (no division by zero). */
INLINE void fill_lanes(v16* m, int64_t count, int u0, float value) {
    for (int64_t q = 0; q < count; ++q)
        for (int u = u0; u < G; ++u) m[q][u] = value;
}

INLINE float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

/* ---------------------------------------------------------------------------------------
   The skinny matmuls with phi: z = x @ phi per token tile, dphi += x^T dz.
   phip [K, Mp] is phi with its M columns padded to Mp = 8 MV with zeros (8-float vectors:
   M = 24 for n = 4 then needs no padding; the training forward's 16-float ones below pad it
   to 32).
   TT tokens x MV vectors of accumulators stay in registers; each phi row is loaded once per
   tile and each x element once.
   --------------------------------------------------------------------------------------- */

#define WG 8  /* floats per vector in the skinny matmuls */

INLINE v8 v8load(const float* p) { v8 v; memcpy(&v, p, sizeof v); return v; }
INLINE void v8store(float* p, v8 v) { memcpy(p, &v, sizeof v); }

/* acc + s p, fused where the CPU has FMA. x @ phi's 8- and 16-float tiles sum the same
   logits and must round them alike (decoding reads the narrow table, the training forward
   the wide one): left to -ffp-contract=fast, GCC's tunings for AMD's Zen (what -march=native
   picks there) kept a single token's chain of 256-bit multiply-adds unfused and fused the
   512-bit one, and the two tables' logits came out last bits apart on a Zen 5. */
INLINE v8 fma8(v8 acc, float s, v8 p) {
#if defined(__FMA__)
    return (v8)_mm256_fmadd_ps(_mm256_set1_ps(s), (__m256)p, (__m256)acc);
#else
    return acc + s * p;
#endif
}

INLINE void xphi_tile(const void* x, const float* phip, int64_t t, int64_t K, const int TT,
                      const int MV, float* z, int bf) {
    v8 acc[MAX_TILE][MAX_MV];
    for (int u = 0; u < TT; ++u)
        for (int v = 0; v < MV; ++v) acc[u][v] = (v8){0};
    for (int64_t k = 0; k < K; ++k) {
        v8 p[MAX_MV];
        for (int v = 0; v < MV; ++v) p[v] = v8load(phip + (k * MV + v) * WG);
        for (int u = 0; u < TT; ++u) {
            const float s = lds(x, (t + u) * K + k, bf);
            for (int v = 0; v < MV; ++v) acc[u][v] = fma8(acc[u][v], s, p[v]);
        }
    }
    for (int u = 0; u < TT; ++u)
        for (int v = 0; v < MV; ++v) v8store(z + (u * MV + v) * WG, acc[u][v]);
}

/* The forward's x @ phi with 16-float vectors, where the build sets TORCH_MHC_SKINNY_W=16
   (build.py does on Intel CPUs with AVX-512, whose two 512-bit FMA ports do twice the work
   of 256-bit ones, and on Zen 5 with its 512-bit FMA units; Zen 4 runs a 512-bit FMA as two
   halves), the CPU has FMA (fma8 fuses only there, and the two tiles must round alike) and
   phip's padded width is a whole number of them (MV even: any table so padded, as the
   training forward's are, ops/cpu/ops.py's padded_table(wide=True); a [K, Mp] row reads the
   same as 8- or 16-float vectors). n = 4's 24 logits then take two vectors of a 32-wide row
   instead of three of 24: the maps forward ran in 2.25 against 2.86 ms (T = 2048, C = 512,
   one thread, Xeon with AVX-512, 2026-12-02, 21 interleaved rounds). Calls without autograd
   (decoding) keep the unpadded 24-wide rows: one token's maps read all of phi, and the
   padding's third more bytes cost more there than the wider vectors save (the native maps
   call inside a decoding step: 18.0 against 14.8 us at batch 1, 40.7 against 38.3 us at
   batch 8). On a Zen 5 the connection's forward and backward took 0.964x the 8-float
   build's time (T = 2048, C = 512, one thread, 2026-12-04, 30 interleaved rounds). */
#if defined(TORCH_MHC_SKINNY_W) && TORCH_MHC_SKINNY_W == 16 && defined(__AVX512F__) && \
    defined(__FMA__)
#define WIDE_XPHI 1
INLINE void xphi_tile16(const void* x, const float* phip, int64_t t, int64_t K, const int TT,
                        const int MV16, float* z, int bf) {
    v16 acc[MAX_TILE][MAX_MV / 2];
    for (int u = 0; u < TT; ++u)
        for (int v = 0; v < MV16; ++v) acc[u][v] = (v16){0};
    for (int64_t k = 0; k < K; ++k) {
        v16 p[MAX_MV / 2];
        for (int v = 0; v < MV16; ++v) memcpy(&p[v], phip + (k * MV16 + v) * 16, sizeof p[v]);
        for (int u = 0; u < TT; ++u) {
            const float s = lds(x, (t + u) * K + k, bf);
            for (int v = 0; v < MV16; ++v)  /* fused, as fma8 */
                acc[u][v] = (v16)_mm512_fmadd_ps(_mm512_set1_ps(s), (__m512)p[v],
                                                 (__m512)acc[u][v]);
        }
    }
    for (int u = 0; u < TT; ++u)
        for (int v = 0; v < MV16; ++v)
            memcpy(z + (u * MV16 + v) * 16, &acc[u][v], sizeof acc[u][v]);
}
#else
#define WIDE_XPHI 0
#endif

/* The widest vectors the skinny matmuls use (native.py pads the training forward's phi to
   a multiple of it). */
int native_skinny_width(void) { return WIDE_XPHI ? 16 : 8; }

/* Memory to bring into cache while a compute-bound loop runs: up to three byte ranges,
   walked one 64-byte line per touch (the next group of tokens' inputs of a backward, fetched
   during this group's dphi or dW, so that the next group's first passes find them in L2
   instead of waiting on memory). */
typedef struct {
    const char* p[3];
    int64_t lines[3];
} ahead_t;

INLINE void ahead_touch(const ahead_t* a, int64_t i) {
    for (int r = 0; r < 3; ++r) {
        if (i < a->lines[r]) {
            __builtin_prefetch(a->p[r] + i * 64);
            return;
        }
        i -= a->lines[r];
    }
}

/* dphi[k, :] += sum_u x[t + u, k] dz[u, :] for dz [TT, Mp]; touches lines 2 (i0 + k) and
   2 (i0 + k) + 1 of `ahead` on the way. */
INLINE void dphi_tile(const void* x, const float* dz, float* dphi, int64_t t, int64_t K,
                      const int TT, const int MV, const ahead_t* ahead, int64_t i0, int bf) {
    v8 zv[MAX_TILE][MAX_MV];
    for (int u = 0; u < TT; ++u)
        for (int v = 0; v < MV; ++v) zv[u][v] = v8load(dz + (u * MV + v) * WG);
    for (int64_t k = 0; k < K; ++k) {
        ahead_touch(ahead, 2 * (i0 + k));
        ahead_touch(ahead, 2 * (i0 + k) + 1);
        v8 p[MAX_MV];
        for (int v = 0; v < MV; ++v) p[v] = v8load(dphi + (k * MV + v) * WG);
        for (int u = 0; u < TT; ++u) {
            const float s = lds(x, (t + u) * K + k, bf);
            for (int v = 0; v < MV; ++v) p[v] += s * zv[u][v];
        }
        for (int v = 0; v < MV; ++v) v8store(dphi + (k * MV + v) * WG, p[v]);
    }
}

/* Where the maps backward keeps phi's gradient: transposed and in 16-float column blocks,
   [ceil(K / 16), Mp, 16] (dphit_rows below), on AVX-512, whose 32 vector registers hold its
   24 sums of 16 floats; else [K, Mp] (dphi_rows, as HC's rows backward): with 16 registers
   those sums spill, and the same kernels built without AVX-512 on the Xeon took 14.97
   against 12.87 ms. native.py reads the layout (DPHI_FLOATS: a thread's share). */
#if defined(__AVX512F__)
#define DPHI_TRANSPOSED 1
#define DPHI_FLOATS(K, Mp) (((K) + W - 1) / W * W * (Mp))
#else
#define DPHI_TRANSPOSED 0
#define DPHI_FLOATS(K, Mp) ((K) * (Mp))
#endif
int native_dphi_transposed(void) { return DPHI_TRANSPOSED; }

#if DPHI_TRANSPOSED
/* The next group's rows of the maps backward's inputs, fetched into cache during this
   group's dphi (so that its first passes find them in L2 instead of waiting on memory):
   x and gmerge [g, K], ga [g, C] from the next group's first token (NULL: none), g rows. */
typedef struct {
    const char* x;
    const char* gmerge;
    const char* ga;
    int64_t g, size;  /* rows; bytes per element */
} next_rows_t;

/* A line the next group will read: into L2, not L1 (prefetcht1). The group's 288 KB
   (T = 2048 tokens' x and gmerge rows of n = 4 streams of C = 512 floats, 16 tokens a group)
   do not fit a 32 KB L1 anyway (fetched into it, they presumably compete with this group's
   own loads for its line-fill slots): the maps backward ran in 0.96-0.98 the time of
   prefetcht0's (T = 2048, n = 4, C = 512, one and two threads, Zen 4, 2026-12-03, 30-40
   interleaved rounds). */
INLINE void prefetch_l2(const char* p) { __builtin_prefetch(p, 0, 2); }

/* dphit[q, k] += sum_u dz[u, q] x[t + u, k] over the g tokens from t, for the rows q0 ..
   q0 + QB of dphit (phi's gradient transposed, in blocks [ceil(K / 16), Mp, 16]: block kb
   holds columns 16 kb .. 16 kb + 15 of every row, the tail block's past K zero; dz [g, Mp]
   zero past column M): 16-wide chunks of k outermost, the chunk's QB sums in registers over
   all the group's tokens. The sums run over the tokens in order, as dphi_tile's do, so the
   bits are the same; but each element of dphit is loaded and stored once per group of 16
   tokens instead of once per 8, and the vectors run along K, 16 floats each, whatever M: the
   maps backward took 6.02 against 6.57 ms with dphi_tile (T = 2048, C = 512, one thread,
   Xeon with AVX-512, 2026-12-02, 21 interleaved rounds). The blocks put a chunk's QB sums at
   fixed offsets from one address; rows of [Mp, K] were QB addresses K floats apart, which
   GCC kept on the stack and reloaded for every load and store. The q loops are unrolled by
   pragma: left to itself GCC split the 24 sums into two loops over the tokens. With `next`,
   fetches chunk k of the next group's row u at each step (x and gmerge; ga for k < C). */
INLINE void dphit_block(const void* x, const float* dz, float* dphit, int64_t t, int64_t g,
                        int64_t K, int64_t C, int64_t Mp, int64_t q0, const int QB,
                        const next_rows_t* next, int bf) {
    FOR_CHUNKS(k, w, K,
        float* blk = dphit + (k / W * Mp + q0) * W;  /* [QB, 16] */
        v16 acc[24];
        _Pragma("GCC unroll 24")
        for (int q = 0; q < QB; ++q) acc[q] = vload(blk + q * W);
        for (int64_t u = 0; u < g; ++u) {
            const v16 xv = ldw(x, (t + u) * K + k, w, bf);
            const float* z = dz + u * Mp + q0;
            _Pragma("GCC unroll 24")
            for (int q = 0; q < QB; ++q) acc[q] += z[q] * xv;
            if (next && u < next->g) {
                prefetch_l2(next->x + (u * K + k) * next->size);
                if (next->gmerge) prefetch_l2(next->gmerge + (u * K + k) * next->size);
                if (next->ga && k < C) prefetch_l2(next->ga + (u * C + k) * next->size);
            }
        }
        _Pragma("GCC unroll 24")
        for (int q = 0; q < QB; ++q) vstore(blk + q * W, acc[q]);
    )
}

/* dphit += dz^T x[t .. t + g) for all Mp rows, in blocks of 24, 16 or 8 rows (the next
   group's rows fetched during the first block). */
static void dphit_rows(const void* x, const float* dz, float* dphit, int64_t t, int64_t g,
                       int64_t K, int64_t C, int64_t Mp, const next_rows_t* next, int bf) {
    for (int64_t q0 = 0; q0 < Mp; q0 += 24) {
        const next_rows_t* nr = q0 == 0 ? next : NULL;
        switch (Mp - q0 >= 24 ? 24 : Mp - q0) {
            case 8: dphit_block(x, dz, dphit, t, g, K, C, Mp, q0, 8, nr, bf); break;
            case 16: dphit_block(x, dz, dphit, t, g, K, C, Mp, q0, 16, nr, bf); break;
            default: dphit_block(x, dz, dphit, t, g, K, C, Mp, q0, 24, nr, bf); break;
        }
    }
}
#endif

/* z [tt, Mp] = x[t .. t + tt) @ phip and dphi += x[t .. t + tt)^T dz: full tiles of TT tokens,
   then single tokens, with TT and MV literal in every call (so that the accumulators are
   registers). TT = as many tokens as keep TT MV accumulators within 24 vector registers, and
   8 for MV = 4 (mHC-lite's 32 logits at n = 4): its 32 accumulators fill the 32 registers of
   AVX-512 without spilling there, and ran its maps forward in 4.0 ms against 4.8-5.4 ms with
   4 tokens, its backward in 10.6-11.5 against 13.4-15.0 ms (T = 2048, n = 4, C = 512, one
   thread, Zen 4, 2026-12-02); without AVX-512 (16 vector registers) 4. */
#if defined(__AVX512F__)
#define TT_MV4 8
#define TT_XPHI_MV23 8
#else
#define TT_MV4 4
/* x @ phi's tiles of 2 or 3 vectors of logits (mHC's 24 at n = 4: 3): 4 tokens with 16 vector
   registers, whose 8 would spill; the maps forward took 0.85 the time of 8 tokens' (T = 2048,
   n = 4, C = 512, one thread, Zen 4 built with -mno-avx512f, 2026-12-03, 20 interleaved
   rounds). phi's gradient keeps 8 (with 4 the maps backward took 1.02 the time). */
#define TT_XPHI_MV23 4
#endif
#define TILED_CASE(MV, TT, CALL)                                              \
    case MV:                                                                  \
        for (; u + TT <= tt; u += TT) CALL(TT, MV);                           \
        for (; u < tt; ++u) CALL(1, MV);                                      \
        break;
#define TILED(MV, TT23, CALL)                                                 \
    int64_t u = 0;                                                            \
    switch (MV) {                                                             \
        TILED_CASE(1, 8, CALL)                                                \
        TILED_CASE(2, TT23, CALL)                                             \
        TILED_CASE(3, TT23, CALL)                                             \
        TILED_CASE(4, TT_MV4, CALL)                                                \
        TILED_CASE(5, 4, CALL)                                                \
        TILED_CASE(6, 4, CALL)                                                \
        TILED_CASE(7, 2, CALL)                                                \
        TILED_CASE(8, 2, CALL)                                                \
        TILED_CASE(9, 2, CALL)                                                \
        default: TILED_CASE(10, 2, CALL)                                      \
    }

static void xphi_rows(const void* x, const float* phip, int64_t t, int64_t tt, int64_t K,
                      int64_t MV, float* z, int bf) {
#if WIDE_XPHI
    if (MV % 2 == 0) {  /* 16-float vectors: TT tokens x MV / 2 of them within 24 registers */
#define XPHI16(TT, MV16) xphi_tile16(x, phip, t + u, K, TT, MV16, z + u * (MV16) * 16, bf)
        int64_t u = 0;
        switch (MV / 2) {
            TILED_CASE(1, 8, XPHI16)
            TILED_CASE(2, 8, XPHI16)
            TILED_CASE(3, 8, XPHI16)
            TILED_CASE(4, 4, XPHI16)
            default: TILED_CASE(5, 4, XPHI16)
        }
#undef XPHI16
        return;
    }
#endif
#define XPHI(TT, MV) xphi_tile(x, phip, t + u, K, TT, MV, z + u * (MV) * WG, bf)
    TILED(MV, TT_XPHI_MV23, XPHI)
#undef XPHI
}

static void dphi_rows(const void* x, const float* dz, float* dphi, int64_t t, int64_t tt,
                      int64_t K, int64_t MV, const ahead_t* ahead, int bf) {
#define DPHI(TT, MV) dphi_tile(x, dz + u * (MV) * WG, dphi, t + u, K, TT, MV, ahead, u * K, bf)
    TILED(MV, 8, DPHI)
#undef DPHI
}

/* sum_k x[t, k]^2, in four independent sums: with one, each addition waited for the last
   and this loop cost 1.1 ms of the maps forward's 4.3 (2048 x 4 x 512, fp32). */
INLINE float sum_squares(const void* x, int64_t t, int64_t K, int bf) {
    v16 s[4] = {vzero(), vzero(), vzero(), vzero()};
    int64_t k = 0;
    for (; k + 4 * W <= K; k += 4 * W)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
            const v16 v = ldw(x, t * K + k + i * W, W, bf);
            s[i] += v * v;
        }
    for (; k < K; k += W) {
        const v16 v = ldw(x, t * K + k, K - k < W ? (int)(K - k) : W, bf);
        s[0] += v * v;
    }
    return hsum((s[0] + s[1]) + (s[2] + s[3]));
}

/* ---------------------------------------------------------------------------------------
   H_res of mHC's successors from the R gated res logits z of one token
   (functional/successors.py): in double and rounded once, as the reference builds them.
     RES_LITE    a = softmax(z) over the n! permutations, H = sum_k a_k P_k, P_k[i, p_k(i)] = 1
     RES_KROM    a = sigmoid(z) (m = log2 n), H[i, j] = prod_k (bit k of i == bit k of j ?
                 a_k : 1 - a_k), bit 0 the most significant (torch.kron's order)
     RES_STATIC  H = I, no logits
   RES_SINKHORN is mHC's own (the lanes above).
   --------------------------------------------------------------------------------------- */

enum { RES_SINKHORN = 0, RES_LITE = 1, RES_KROM = 2, RES_STATIC = 3 };
#define MAX_PERMS 24  /* n! within the skinny matmuls' M <= 80: n <= 4 */

/* The n! permutations of 0..n-1 in lexicographic order (itertools.permutations'), p_k(i) at
   perm[k n + i]; returns their count. */
static int64_t lex_permutations(int64_t n, int8_t* perm) {
    int8_t p[MAXN];
    for (int64_t i = 0; i < n; ++i) p[i] = (int8_t)i;
    int64_t count = 0;
    for (;;) {
        memcpy(perm + count * n, p, (size_t)n);
        ++count;
        int64_t i = n - 2;  /* the next permutation: the longest decreasing suffix's pivot */
        while (i >= 0 && p[i] > p[i + 1]) --i;
        if (i < 0) return count;
        int64_t j = n - 1;
        while (p[j] < p[i]) --j;
        int8_t tmp = p[i]; p[i] = p[j]; p[j] = tmp;
        for (int64_t lo = i + 1, hi = n - 1; lo < hi; ++lo, --hi) {
            tmp = p[lo]; p[lo] = p[hi]; p[hi] = tmp;
        }
    }
}

/* The mixture weights a [R] (double) of the res logits z [R]. */
INLINE void variant_weights(int res, const float* z, double* a, int64_t R) {
    if (res == RES_LITE) {
        double mx = z[0], sum = 0.0;
        for (int64_t k = 1; k < R; ++k) mx = z[k] > mx ? z[k] : mx;
        for (int64_t k = 0; k < R; ++k) sum += (a[k] = exp((double)z[k] - mx));
        for (int64_t k = 0; k < R; ++k) a[k] /= sum;
    } else {
        for (int64_t k = 0; k < R; ++k) a[k] = 1.0 / (1.0 + exp(-(double)z[k]));
    }
}

/* KromHC's factor k at (i, j): a_k where bit k of i and j agree, else 1 - a_k. */
INLINE double krom_factor(const double* a, int64_t k, int64_t m, int64_t i, int64_t j) {
    const int64_t bit = m - 1 - k;
    return ((i >> bit) & 1) == ((j >> bit) & 1) ? a[k] : 1.0 - a[k];
}

/* H [n n] (float, rounded once) from the weights a [R]. */
INLINE void variant_res_fwd(int res, const double* a, const int8_t* perm, float* h,
                            const int64_t n, int64_t R) {
    const int64_t nn = n * n;
    double hd[nn];
    if (res == RES_LITE) {
        for (int64_t q = 0; q < nn; ++q) hd[q] = 0.0;
        for (int64_t k = 0; k < R; ++k)
            for (int64_t i = 0; i < n; ++i) hd[i * n + perm[k * n + i]] += a[k];
    } else if (res == RES_KROM) {
        for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < n; ++j) {
                double v = 1.0;
                for (int64_t k = 0; k < R; ++k) v *= krom_factor(a, k, R, i, j);
                hd[i * n + j] = v;
            }
    } else {
        for (int64_t q = 0; q < nn; ++q) hd[q] = q % (n + 1) == 0 ? 1.0 : 0.0;
    }
    for (int64_t q = 0; q < nn; ++q) h[q] = (float)hd[q];
}

/* dL/dz [R] (float) for dL/dH = g [n n], from the weights a [R]:
     lite  da_k = <g, P_k> = sum_i g[i, p_k(i)], dz = a (da - <a, da>)
     krom  dz_k = a_k (1 - a_k) sum_ij g[i, j] (+-1) prod_{l != k} factor_l(i, j)
   (+1 where bit k of i and j agree). */
INLINE void variant_res_bwd(int res, const double* a, const int8_t* perm, const float* g,
                            float* dz, const int64_t n, int64_t R) {
    if (res == RES_LITE) {
        double da[MAX_PERMS], dot = 0.0;
        for (int64_t k = 0; k < R; ++k) {
            double s = 0.0;
            for (int64_t i = 0; i < n; ++i) s += g[i * n + perm[k * n + i]];
            da[k] = s;
            dot += a[k] * s;
        }
        for (int64_t k = 0; k < R; ++k) dz[k] = (float)(a[k] * (da[k] - dot));
    } else if (res == RES_KROM) {
        for (int64_t k = 0; k < R; ++k) {
            double s = 0.0;
            for (int64_t i = 0; i < n; ++i)
                for (int64_t j = 0; j < n; ++j) {
                    double others = 1.0;
                    for (int64_t l = 0; l < R; ++l)
                        if (l != k) others *= krom_factor(a, l, R, i, j);
                    const int64_t bit = R - 1 - k;
                    const double sign = ((i >> bit) & 1) == ((j >> bit) & 1) ? 1.0 : -1.0;
                    s += g[i * n + j] * sign * others;
                }
            dz[k] = (float)(s * a[k] * (1.0 - a[k]));
        }
    }
}

/* ---------------------------------------------------------------------------------------
   mHC maps, forward: per token
     r = sqrt(mean(x^2) + norm_eps), l = (x @ phi) / r, h~ = alpha_row * l + b,
     H_pre = sigmoid(h~_pre) + pre_eps, H_post = 2 sigmoid(h~_post), H_res = Sinkhorn(h~_res),
     and, when a is not NULL, a = sum_j H_pre[j] x[j].
   ab = [alpha_row (M), b (M)]. Writes lt [T, M] (the logits l) and r [T] for the backward,
   unless they are NULL (inference keeps neither).
   --------------------------------------------------------------------------------------- */

INLINE void gate_logits(const float* l, const float* ab, float* ht, int64_t M) {
    for (int64_t m = 0; m < M; ++m) ht[m] = ab[m] * l[m] + ab[M + m];
}

INLINE void maps_fwd_body(const void* x, const float* phip, const float* ab, float* lt,
                          float* r, float* hpre, float* hpost, float* hres, void* a,
                          int64_t t0, int64_t t1, const int64_t n, int64_t C, int64_t M,
                          int64_t MV, int iters, int res, float norm_eps, float sk_eps,
                          float pre_eps, int bf) {
    const int64_t K = n * C, Mp = MV * WG, nn = n * n, R = M - 2 * n;
    float z[G * Mp], ht[M], lrow[M];
    v16 m[nn];
    int far[G];
    int8_t perm[MAX_PERMS * MAXN];
    double wts[R > 0 ? R : 1];
    if (res == RES_LITE) lex_permutations(n, perm);
    for (int64_t t = t0; t < t1; t += G) {
        const int64_t g = t1 - t < G ? t1 - t : G;
        int any_far = 0;
        xphi_rows(x, phip, t, g, K, MV, z, bf);
        for (int64_t u = 0; u < g; ++u) {
            const int64_t tu = t + u;
            const float rr = sqrtf(sum_squares(x, tu, K, bf) / (float)K + norm_eps);
            float* l = lt ? lt + tu * M : lrow;
            if (r) r[tu] = rr;
            for (int64_t q = 0; q < M; ++q) l[q] = z[u * Mp + q] / rr;
            gate_logits(l, ab, ht, M);
            for (int64_t i = 0; i < n; ++i) {
                hpre[tu * n + i] = sigmoid(ht[i]) + pre_eps;
                hpost[tu * n + i] = 2.0f * sigmoid(ht[n + i]);
            }
            if (res != RES_SINKHORN) {  /* a successor's closed form, no lanes */
                variant_weights(res, ht + 2 * n, wts, R);
                variant_res_fwd(res, wts, perm, hres + tu * nn, n, R);
                continue;
            }
            far[u] = far_matrix(ht + 2 * n, nn, sk_eps);
            any_far |= far[u];
            if (far[u]) {  /* the uniform matrix in its lane; the log domain below */
                for (int64_t q = 0; q < nn; ++q) m[q][u] = 1.0f / (float)n;
                sinkhorn_log_fwd(ht + 2 * n, hres + tu * nn, NULL, n, iters);
            } else {
                column_softmax_lane(ht + 2 * n, m, (int)u, n);
            }
        }
        if (res == RES_SINKHORN) {
            fill_lanes(m, nn, (int)g, 1.0f / (float)n);
            sinkhorn_fwd_lanes(m, n, iters, sk_eps);
        }
        for (int64_t u = 0; u < g; ++u) {
            if (res == RES_SINKHORN && (!any_far || !far[u]))
                for (int64_t q = 0; q < nn; ++q) hres[(t + u) * nn + q] = m[q][u];
            if (a) aggregate_row(x, hpre + (t + u) * n, a, t + u, n, C, bf);
        }
    }
}

/* ---------------------------------------------------------------------------------------
   mHC maps, backward. Inputs: the forward's lt, r; the upstream gradients of H_pre (gpre),
   H_post (gpost), H_res (gres), of the aggregation (ga) and, on the fused_dx path, the
   merge's upstream gradient gmerge [T, n, C]; any may be NULL (no gradient). Per group of tokens:
     dH_pre += <x[j], ga>                              (the aggregation's share)
     dH_res += <gmerge[i], x[j]>                        (the merge's share, fused_dx path)
     dh~ = the gates' and Sinkhorn's backward           -> dht [T, M] (for db, dalpha)
     dl = alpha_row dh~, coef = -<dl, l> / (r^2 K), dz = dl / r
     dphi += x^T dz                                     (this thread's partial: dphit's
                                                         blocks or [K, Mp], DPHI_TRANSPOSED)
     dx = coef x + dz phi^T + H_pre[j] ga + sum_i H_res[i, j] gmerge[i]
   phitb is phi transposed in 16-float column blocks, [ceil(K / 16), M, 16] (block kb: columns
   16 kb .. 16 kb + 15 of phi^T [M, K], zero past K), so that dx's loads of a chunk's M rows
   are one run of memory (rows of phi^T [M, K] are 8 KB apart at K = 2048, and all fall in
   one set of the L1 cache); sk_y is scratch for Sinkhorn's iterates (see native.py).
   --------------------------------------------------------------------------------------- */

#if !defined(__AVX512F__)
/* Without AVX-512 a 16-float vector is two of the 16 vector registers, and GCC kept the dx
   passes' sums of 16-float vectors on the stack: the maps backward took 33 ms there
   against 10 with AVX-512 on the same Zen 4 core (whose FMA units are 256 bits wide either
   way). Their full chunks run as two 8-float halves instead (the same sums, element by
   element): 11.3 ms (T = 2048, n = 4, C = 512, one thread, built with -mno-avx512f,
   2026-12-03, 15 interleaved rounds). */

/* 8 floats of storage p (fp32 or bf16) at element i, and their store. */
INLINE v8 ld8(const void* p, int64_t i, int bf) {
    if (!bf) return v8load((const float*)p + i);
    const v16 v = ldw(p, i, WG, 1);
    v8 r;
    memcpy(&r, &v, sizeof r);
    return r;
}

INLINE void st8(void* p, int64_t i, v8 v, int bf) {
    if (!bf) {
        v8store((float*)p + i, v);
        return;
    }
    v16 w = vzero();
    memcpy(&w, &v, sizeof v);
    stw(p, i, w, WG, 1);
}

/* maps_dx_base for the 8 floats at column c. */
INLINE void maps_dx_base_half(const void* x, const void* ga, const void* gmerge,
                              const float* coef, const int per_row, const float* hp,
                              const float* hr, float* base, int64_t t, const int64_t n,
                              int64_t C, int64_t c, int bf) {
    const v8 av = ga ? ld8(ga, t * C + c, bf) : (v8){0};
    v8 gv[MAXN];
    for (int64_t i = 0; i < n; ++i)
        gv[i] = gmerge ? ld8(gmerge, (t * n + i) * C + c, bf) : (v8){0};
    for (int64_t j = 0; j < n; ++j) {
        v8 acc = coef[per_row ? j : 0] * ld8(x, (t * n + j) * C + c, bf);
        if (ga) acc += hp[j] * av;
        if (gmerge)
            for (int64_t i = 0; i < n; ++i) acc += hr[i * n + j] * gv[i];
        v8store(base + j * C + c, acc);
    }
}
#endif

/* base[j] = coef x[j] + H_pre[j] ga + sum_i H_res[i, j] gmerge[i] for token t, in float
   (the part of dx that is per token): each chunk of x, ga and gmerge is loaded once. coef is
   one number for the token (mHC), or one per stream row with per_row (HC). */
INLINE void maps_dx_base(const void* x, const void* ga, const void* gmerge, const float* coef,
                         const int per_row, const float* hp, const float* hr, float* base,
                         int64_t t, const int64_t n, int64_t C, int bf) {
    int64_t c0 = 0;  /* chunks before c0 done in halves */
#if !defined(__AVX512F__)
    for (; c0 + W <= C; c0 += W)
        for (int h = 0; h < W; h += WG)
            maps_dx_base_half(x, ga, gmerge, coef, per_row, hp, hr, base, t, n, C, c0 + h, bf);
#endif
    FOR_CHUNKS(c, w, C,
        if (c < c0) continue;
        const v16 av = ga ? ldw(ga, t * C + c, w, bf) : vzero();
        v16 gv[MAXN];
        for (int64_t i = 0; i < n; ++i)
            gv[i] = gmerge ? ldw(gmerge, (t * n + i) * C + c, w, bf) : vzero();
        for (int64_t j = 0; j < n; ++j) {
            v16 acc = coef[per_row ? j : 0] * ldw(x, (t * n + j) * C + c, w, bf);
            if (ga) acc += hp[j] * av;
            if (gmerge)
                for (int64_t i = 0; i < n; ++i) acc += hr[i * n + j] * gv[i];
            stw(base, j * C + c, acc, w, 0);
        }
    )
}

#if !defined(__AVX512F__)
/* dx_chunk for a full chunk, in two 8-float halves. */
INLINE void dx_chunk_halves(const void* a, int64_t a0, const float* s, int a_bf,
                            const float* pk, int64_t qs, const float* dz, void* dx, int64_t t,
                            const int TT, int64_t K, int64_t M, int64_t Mp, int64_t k, int bf) {
    for (int h = 0; h < W; h += WG) {
        v8 acc[MAX_TILE];
#pragma GCC unroll 8
        for (int u = 0; u < TT; ++u) {
            acc[u] = ld8(a, (a0 + u) * K + k + h, a_bf);
            if (s) acc[u] *= s[u];
        }
        for (int64_t q = 0; q < M; ++q) {
            const v8 p = v8load(pk + q * qs + h);
#pragma GCC unroll 8
            for (int u = 0; u < TT; ++u) acc[u] += dz[u * Mp + q] * p;
        }
#pragma GCC unroll 8
        for (int u = 0; u < TT; ++u) st8(dx, (t + u) * K + k + h, acc[u], bf);
    }
}
#endif

/* dx[t + u] = s[u] a[a0 + u] + dz[u] phi^T for TT rows from t, one 16-wide chunk (width w)
   at k: a [*, K] in storage a_bf, s NULL for s[u] = 1, dz [TT, Mp], and phi^T's columns k ..
   k + w at pk, its M rows qs floats apart (qs = K for phi^T [M, K], 16 for its blocks). The
   maps backward passes its float scratch rows (a = base), the rows backward x and coef. */
INLINE void dx_chunk(const void* a, int64_t a0, const float* s, int a_bf, const float* pk,
                     int64_t qs,
                     const float* dz, void* dx, int64_t t, const int TT, int64_t K, int64_t M,
                     int64_t Mp, int64_t k, const int w, int bf) {
#if !defined(__AVX512F__)
    if (w == W) {
        dx_chunk_halves(a, a0, s, a_bf, pk, qs, dz, dx, t, TT, K, M, Mp, k, bf);
        return;
    }
#endif
    v16 acc[MAX_TILE];
#pragma GCC unroll 8
    for (int u = 0; u < TT; ++u) {
        acc[u] = ldw(a, (a0 + u) * K + k, w, a_bf);
        if (s) acc[u] *= s[u];
    }
    for (int64_t q = 0; q < M; ++q) {
        const v16 p = ldw(pk, q * qs, w, 0);
#pragma GCC unroll 8
        for (int u = 0; u < TT; ++u) acc[u] += dz[u * Mp + q] * p;
    }
#pragma GCC unroll 8
    for (int u = 0; u < TT; ++u) stw(dx, (t + u) * K + k, acc[u], w, bf);
}

/* The maps backward's two per-token passes over x, ga and gmerge (the dots, then dx's base
   for a tile) as functions of their own, each compiled for its dtype, stream count and the
   gradients present (HC's backward calls the first too). Inlined into maps_bwd_body, whose
   dphi and dx tiles hold most vector registers, GCC kept token_dots' n + n n sums on the
   stack (a load and a store beside each multiply-add) and reloaded maps_dx_base's row
   pointers and NULL checks from it at every chunk (perf annotate: ~40% of the body's
   samples). Out of line the maps backward took 7.43 against 8.08 ms (T = 2048, n = 4,
   C = 512, one thread, 25 interleaved rounds of benchmarks/bench_native_builds.py,
   2026-12-03). */
static __attribute__((noinline)) void maps_token_dots(const void* x, const void* ga,
                                                      const void* gmerge, float* dots,
                                                      float* dres, int64_t t, int ahead,
                                                      int64_t n, int64_t C, int bf) {
    FOR_DTYPE(bf, WITH_N(n, token_dots(x, ga, gmerge, dots, dres, t, ahead, N_, C, bf)));
}

/* maps_dx_base (mHC's: one coef a token) for the TT tokens from t into base [TT, n C]. */
#define DX_BASES(GA, GM)                                                                 \
    for (int64_t u = 0; u < TT; ++u)                                                      \
        maps_dx_base(x, GA, GM, coef + u, 0, hp + u * N_, hr + u * N_ * N_,              \
                     base + u * N_ * C, t + u, N_, C, bf)
static __attribute__((noinline)) void maps_dx_bases(const void* x, const void* ga,
                                                    const void* gmerge, const float* coef,
                                                    const float* hp, const float* hr,
                                                    float* base, int64_t t, int64_t TT,
                                                    int64_t n, int64_t C, int bf) {
    FOR_DTYPE(bf, WITH_N(n,
        if (ga && gmerge) DX_BASES(ga, gmerge);
        else if (ga) DX_BASES(ga, NULL);
        else if (gmerge) DX_BASES(NULL, gmerge);
        else DX_BASES(NULL, NULL)));
}
#undef DX_BASES

/* dx for TT tokens from t; base: scratch of TT n C floats. */
INLINE void maps_dx_tile(const void* x, const float* phitb, const void* ga, const void* gmerge,
                         const float* coef, const float* hp, const float* hr, const float* dz,
                         void* dx, float* base, int64_t t, const int TT, const int64_t n,
                         int64_t C, int64_t M, int64_t Mp, int bf) {
    const int64_t K = n * C;
    maps_dx_bases(x, ga, gmerge, coef, hp, hr, base, t, TT, n, C, bf);
    int64_t k = 0;
    for (; k + W <= K; k += W)
        dx_chunk(base, 0, NULL, 0, phitb + k * M, W, dz, dx, t, TT, K, M, Mp, k, W, bf);
    if (k < K)
        dx_chunk(base, 0, NULL, 0, phitb + k * M, W, dz, dx, t, TT, K, M, Mp, k, (int)(K - k),
                 bf);
}

INLINE void maps_bwd_body(const void* x, const float* phitb, const float* ab, const float* lt,
                          const float* r, const float* gpre, const float* gpost,
                          const float* gres, const void* ga, const void* gmerge, void* dx,
                          float* dht, float* dphi, v16* sk_y, float* base, int64_t t0,
                          int64_t t1,
                          const int64_t n, int64_t C, int64_t M, int64_t MV, int iters,
                          int res, float sk_eps, float pre_eps, int bf) {
    const int64_t K = n * C, nn = n * n, Mp = MV * WG, R = M - 2 * n;
    const int64_t steps = 2 * (int64_t)iters - 1;
    v16* sk_d = sk_y + steps * nn;
    float dz[G * Mp], coef[G], hp[G * n], hr[G * nn], ht[M], dpre[n], dots[n], dres[nn];
    v16 p0[nn], gl[nn], hres[nn];
    float far_dh[G * nn], far_out[G * nn];  /* far tokens' log-domain results */
    int far[G];
    const int with_res = gres || gmerge;
    const int lanes = with_res && res == RES_SINKHORN;  /* Sinkhorn's backward in lanes */
    int8_t perm[MAX_PERMS * MAXN];
    double wts[R > 0 ? R : 1];
    float gq[nn];
    if (res == RES_LITE) lex_permutations(n, perm);
    for (int64_t t = t0; t < t1; t += G) {
        const int64_t g = t1 - t < G ? t1 - t : G;
        int any_far = 0;
        for (int64_t u = 0; u < g; ++u) {  /* the gates; Sinkhorn's inputs into lanes */
            const int64_t tu = t + u;
            float* d = dht + tu * M;
            gate_logits(lt + tu * M, ab, ht, M);
            for (int64_t i = 0; i < n; ++i) dpre[i] = gpre ? gpre[tu * n + i] : 0.0f;
            maps_token_dots(x, ga, gmerge, dots, dres, tu, tu + 1 < t1, n, C, bf);
            if (ga)
                for (int64_t i = 0; i < n; ++i) dpre[i] += dots[i];
            for (int64_t i = 0; i < n; ++i) {
                const float sp = sigmoid(ht[i]), so = sigmoid(ht[n + i]);
                hp[u * n + i] = sp + pre_eps;
                d[i] = dpre[i] * sp * (1.0f - sp);
                d[n + i] = gpost ? gpost[tu * n + i] * 2.0f * so * (1.0f - so) : 0.0f;
            }
            if (res != RES_SINKHORN) {  /* a successor: its closed form's backward */
                variant_weights(res, ht + 2 * n, wts, R);
                variant_res_fwd(res, wts, perm, hr + u * nn, n, R);  /* H_res, for dx */
                for (int64_t q = 0; q < nn; ++q)
                    gq[q] = (gres ? gres[tu * nn + q] : 0.0f) + (gmerge ? dres[q] : 0.0f);
                variant_res_bwd(res, wts, perm, gq, d + 2 * n, n, R);
            } else if (with_res) {
                for (int64_t q = 0; q < nn; ++q)
                    gl[q][u] = (gres ? gres[tu * nn + q] : 0.0f) + (gmerge ? dres[q] : 0.0f);
                far[u] = far_matrix(ht + 2 * n, nn, sk_eps);
                any_far |= far[u];
                if (far[u]) {  /* log domain now (sk_y is free); the lane runs uniform */
                    for (int64_t q = 0; q < nn; ++q) {
                        gq[q] = gl[q][u];
                        gl[q][u] = 0.0f;
                        p0[q][u] = 1.0f / (float)n;
                    }
                    sinkhorn_log_bwd(ht + 2 * n, gq, far_dh + u * nn, far_out + u * nn,
                                     (float*)sk_y, n, iters);
                } else {
                    column_softmax_lane(ht + 2 * n, p0, (int)u, n);
                }
            }
        }
        if (lanes) {
            fill_lanes(p0, nn, (int)g, 1.0f / (float)n);
            fill_lanes(gl, nn, (int)g, 0.0f);
            sinkhorn_bwd_lanes(p0, gl, hres, sk_y, sk_d, n, iters, sk_eps);
            for (int64_t u = 0; any_far && u < g; ++u)
                if (far[u])
                    for (int64_t q = 0; q < nn; ++q) {
                        gl[q][u] = far_dh[u * nn + q];
                        hres[q][u] = far_out[u * nn + q];
                    }
        }
        for (int64_t u = 0; u < g; ++u) {  /* Sinkhorn's gradient out of lanes; dz, coef */
            const int64_t tu = t + u;
            const float* l = lt + tu * M;
            float* d = dht + tu * M;
            if (res == RES_SINKHORN)
                for (int64_t q = 0; q < nn; ++q) {
                    d[2 * n + q] = with_res ? gl[q][u] : 0.0f;
                    hr[u * nn + q] = with_res ? hres[q][u] : 0.0f;
                }
            const float rr = r[tu];
            float dot = 0.0f;
            for (int64_t q = 0; q < M; ++q) {
                const float dl = d[q] * ab[q];
                dot += dl * l[q];
                dz[u * Mp + q] = dl / rr;
            }
            for (int64_t q = M; q < Mp; ++q) dz[u * Mp + q] = 0.0f;
            coef[u] = -dot / (rr * rr * (float)K);
        }
        /* The next group's x, ga and gmerge rows, fetched during dphi. */
        const int64_t t2 = t + G < t1 ? t + G : t1, t3 = t + 2 * G < t1 ? t + 2 * G : t1;
        const int64_t size = bf ? 2 : 4;
#if DPHI_TRANSPOSED
        const next_rows_t next = {
            (const char*)x + t2 * K * size,
            gmerge ? (const char*)gmerge + t2 * K * size : NULL,
            ga ? (const char*)ga + t2 * C * size : NULL, t3 - t2, size};
        dphit_rows(x, dz, dphi, t, g, K, C, Mp, &next, bf);
#else
        const ahead_t ahead = {
            {(const char*)x + t2 * K * size, ga ? (const char*)ga + t2 * C * size : NULL,
             gmerge ? (const char*)gmerge + t2 * K * size : NULL},
            {(t3 - t2) * K * size / 64, ga ? (t3 - t2) * C * size / 64 : 0,
             gmerge ? (t3 - t2) * K * size / 64 : 0}};
        dphi_rows(x, dz, dphi, t, g, K, MV, &ahead, bf);
#endif
        int64_t s = 0;
        for (; s + 8 <= g; s += 8)
            maps_dx_tile(x, phitb, ga, gmerge, coef + s, hp + s * n, hr + s * nn, dz + s * Mp, dx,
                         base, t + s, 8, n, C, M, Mp, bf);
        for (; s < g; ++s)
            maps_dx_tile(x, phitb, ga, gmerge, coef + s, hp + s * n, hr + s * nn, dz + s * Mp, dx,
                         base, t + s, 1, n, C, M, Mp, bf);
    }
}

/* ---------------------------------------------------------------------------------------
   Rows times a skinny matrix (HC's maps: every stream row of length C times W [C, n + 2]).
   rows_fwd: z [R, Mp] = x @ wp and ss [R] = sum_k x[r, k]^2 for rows [r0, r1) of x [R, K].
   rows_bwd: dw += x^T dz (this thread's partial, [K, Mp]) and dx = coef[r] x[r] + dz[r] W^T,
   with wt [M, K] = W^T and dz [R, Mp] (zero past column M).
   --------------------------------------------------------------------------------------- */

INLINE void rows_fwd_body(const void* x, const float* wp, float* z, float* ss, int64_t r0,
                          int64_t r1, int64_t K, int64_t MV, int bf) {
    const int64_t Mp = MV * WG;
    for (int64_t t = r0; t < r1; t += G) {
        const int64_t g = r1 - t < G ? r1 - t : G;
        xphi_rows(x, wp, t, g, K, MV, z + t * Mp, bf);
        for (int64_t u = 0; u < g; ++u) ss[t + u] = sum_squares(x, t + u, K, bf);
    }
}

INLINE void rows_dx_tile(const void* x, const float* wt, const float* dz, const float* coef,
                         void* dx, int64_t t, const int TT, int64_t K, int64_t M, int64_t Mp,
                         int bf) {
    int64_t k = 0;
    for (; k + W <= K; k += W)
        dx_chunk(x, t, coef, bf, wt + k, K, dz, dx, t, TT, K, M, Mp, k, W, bf);
    if (k < K) dx_chunk(x, t, coef, bf, wt + k, K, dz, dx, t, TT, K, M, Mp, k, (int)(K - k), bf);
}

INLINE void rows_bwd_body(const void* x, const float* wt, const float* dz, const float* coef,
                          void* dx, float* dw, int64_t r0, int64_t r1, int64_t K, int64_t M,
                          int64_t MV, int bf) {
    const int64_t Mp = MV * WG;
    const int64_t size = bf ? 2 : 4;
    for (int64_t t = r0; t < r1; t += G) {
        const int64_t g = r1 - t < G ? r1 - t : G;
        /* The next group's rows, fetched during dW (as in the maps backward): 3.83-3.87 ->
           3.54-3.64 ms for 8192 rows of 512, out of cache. */
        const int64_t t2 = t + G < r1 ? t + G : r1, t3 = t + 2 * G < r1 ? t + 2 * G : r1;
        const ahead_t ahead = {{(const char*)x + t2 * K * size, NULL, NULL},
                               {(t3 - t2) * K * size / 64, 0, 0}};
        dphi_rows(x, dz + t * Mp, dw, t, g, K, MV, &ahead, bf);
        int64_t s = 0;
        for (; s + 8 <= g; s += 8)
            rows_dx_tile(x, wt, dz + (t + s) * Mp, coef + t + s, dx, t + s, 8, K, M, Mp, bf);
        for (; s < g; ++s)
            rows_dx_tile(x, wt, dz + (t + s) * Mp, coef + t + s, dx, t + s, 1, K, M, Mp, bf);
    }
}

/* ---------------------------------------------------------------------------------------
   HC maps (and the pre-aggregation when a is not NULL), forward, for inference: per token t,
     u[j] = (x[j] @ W) / rms(x[j]), d[j] = tanh(u[j])                    (M = n + 2 columns)
     H_post[j] = sp[j] + s_beta d[j, 0], H_pre[j] = sq[j] + s_alpha d[j, 1],
     H_res[i, j] = sr[i, j] + s_alpha d[j, 2 + i],  a = sum_j H_pre[j] x[j]
   with p = (s_alpha, s_beta, sq [n], sp [n], sr [n n]) the scales and static maps and
   wp [C, Mp] W padded. Nothing is kept for a backward (training takes rows_fwd).
   --------------------------------------------------------------------------------------- */

INLINE void hc_fwd_body(const void* x, const float* wp, const float* p, float* hpre,
                        float* hpost, float* hres, void* a, int64_t t0, int64_t t1,
                        const int64_t n, int64_t C, int64_t MV, float norm_eps, int bf) {
    const int64_t Mp = MV * WG, nn = n * n;
    const float sa = p[0], sb = p[1];
    const float *sq = p + 2, *sp = p + 2 + n, *sr = p + 2 + 2 * n;
    float z[MAX_TILE * Mp];
    for (int64_t t = t0; t < t1; ++t) {
        for (int64_t j0 = 0; j0 < n; j0 += MAX_TILE) {  /* rows of this token, 8 at a time */
            const int64_t rows = n - j0 < MAX_TILE ? n - j0 : MAX_TILE;
            xphi_rows(x, wp, t * n + j0, rows, C, MV, z, bf);
            for (int64_t v = 0; v < rows; ++v) {
                const int64_t j = j0 + v;
                const float rr = sqrtf(sum_squares(x, t * n + j, C, bf) / (float)C + norm_eps);
                const float* zj = z + v * Mp;
                hpost[t * n + j] = sp[j] + sb * tanhf(zj[0] / rr);
                hpre[t * n + j] = sq[j] + sa * tanhf(zj[1] / rr);
                for (int64_t i = 0; i < n; ++i)
                    hres[t * nn + i * n + j] = sr[i * n + j] + sa * tanhf(zj[2 + i] / rr);
            }
        }
        if (a) aggregate_row(x, hpre + t * n, a, t, n, C, bf);
    }
}

/* ---------------------------------------------------------------------------------------
   HC maps and pre-aggregation, backward, with one dx (as the mHC maps backward). Per token t,
   stream rows t n + j of x [T, n, C]:
     gp[j] = gpre[t, j] + <x[j], ga>,  gr[i, j] = gres[t, i, j] + <gmerge[i], x[j]>
                                                 -> gtot [T, n + n n] (gp, then gr row-major)
     dd[j] = (s_beta gpost[t, j], s_alpha gp[j], s_alpha gr[0, j] .. s_alpha gr[n - 1, j])
     du = dd (1 - d[j]^2), coef[j] = -<du, u[j]> / (r[j]^2 C), dz[j] = du / r[j]
     dw += x[j]^T dz[j]                                      (dw [C, Mp]: this thread's part)
     dx[j] = coef[j] x[j] + dz[j] W^T + hpre[t, j] ga + sum_i hres[t, i, j] gmerge[i]
   d = tanh(u), u [T n, M] (M = n + 2) and r [T n] are the forward's, hpre [T, n] and
   hres [T, n, n] its maps, wt [M, C] = W^T, sc = (s_alpha, s_beta); gpre, gpost, gres, ga
   and gmerge may be NULL (no gradient). base: 8 rows of C floats of scratch.
   --------------------------------------------------------------------------------------- */

INLINE void hc_row_grads(const float* d, const float* u, float rr, const float* gp,
                         const float* gr, const float* gpost, float sa, float sb, float* dz,
                         float* coef, int64_t j, const int64_t n, int64_t C, int64_t M,
                         int64_t Mp) {
    float dot = 0.0f;
    for (int64_t q = 0; q < M; ++q) {
        const float dd = q == 0 ? (gpost ? sb * gpost[j] : 0.0f)
                       : q == 1 ? sa * gp[j] : sa * gr[(q - 2) * n + j];
        const float du = dd * (1.0f - d[q] * d[q]);
        dot += du * u[q];
        dz[q] = du / rr;
    }
    for (int64_t q = M; q < Mp; ++q) dz[q] = 0.0f;
    *coef = -dot / (rr * rr * (float)C);
}

INLINE void hc_bwd_body(const void* x, const float* wt, const float* d, const float* u,
                        const float* r, const float* hpre, const float* hres,
                        const float* gpre, const float* gpost, const float* gres,
                        const void* ga, const void* gmerge, const float* sc, void* dx,
                        float* gtot, float* dw, float* base, int64_t t0, int64_t t1,
                        const int64_t n, int64_t C, int64_t M, int64_t MV, int bf) {
    const int64_t Mp = MV * WG, nn = n * n, size = bf ? 2 : 4;
    const int64_t tk = n <= MAX_TILE ? MAX_TILE / n : 1;  /* tokens per dx tile (<= 8 rows) */
    float dz[G * n * Mp], coef[G * n], dots[n], dres[nn];
    for (int64_t t = t0; t < t1; t += G) {
        const int64_t g = t1 - t < G ? t1 - t : G;
        for (int64_t v = 0; v < g; ++v) {  /* the dot products, then each row's dz, coef */
            const int64_t tv = t + v;
            maps_token_dots(x, ga, gmerge, dots, dres, tv, tv + 1 < t1, n, C, bf);
            float* gp = gtot + tv * (n + nn);
            float* gr = gp + n;
            for (int64_t j = 0; j < n; ++j)
                gp[j] = (gpre ? gpre[tv * n + j] : 0.0f) + (ga ? dots[j] : 0.0f);
            for (int64_t q = 0; q < nn; ++q)
                gr[q] = (gres ? gres[tv * nn + q] : 0.0f) + (gmerge ? dres[q] : 0.0f);
            for (int64_t j = 0; j < n; ++j) {
                const int64_t row = tv * n + j;
                hc_row_grads(d + row * M, u + row * M, r[row], gp, gr,
                             gpost ? gpost + tv * n : NULL, sc[0], sc[1],
                             dz + (v * n + j) * Mp, coef + v * n + j, j, n, C, M, Mp);
            }
        }
        /* The next group's x, ga and gmerge rows, fetched during dw. */
        const int64_t t2 = t + G < t1 ? t + G : t1, t3 = t + 2 * G < t1 ? t + 2 * G : t1;
        const int64_t K = n * C;
        const ahead_t ahead = {
            {(const char*)x + t2 * K * size, ga ? (const char*)ga + t2 * C * size : NULL,
             gmerge ? (const char*)gmerge + t2 * K * size : NULL},
            {(t3 - t2) * K * size / 64, ga ? (t3 - t2) * C * size / 64 : 0,
             gmerge ? (t3 - t2) * K * size / 64 : 0}};
        dphi_rows(x, dz, dw, t * n, g * n, C, MV, &ahead, bf);
        for (int64_t s = 0; s < g; s += tk) {  /* dx, tk tokens (tk n rows) at a time */
            const int64_t kt = g - s < tk ? g - s : tk, rows = kt * n, row0 = (t + s) * n;
            for (int64_t v = 0; v < kt; ++v)
                maps_dx_base(x, ga, gmerge, coef + (s + v) * n, 1, hpre + (t + s + v) * n,
                             hres + (t + s + v) * nn, base + v * n * C, t + s + v, n, C, bf);
            const float* dzs = dz + s * n * Mp;
            if (rows == MAX_TILE) {
                FOR_CHUNKS(k, w, C,
                    dx_chunk(base, 0, NULL, 0, wt + k, C, dzs, dx, row0, MAX_TILE, C, M, Mp,
                             k, w, bf););
            } else {  /* n = 3, 5, 6, 7 or the group's last tokens: row by row */
                for (int64_t q = 0; q < rows; ++q)
                    FOR_CHUNKS(k, w, C,
                        dx_chunk(base, q, NULL, 0, wt + k, C, dzs + q * Mp, dx, row0 + q, 1,
                                 C, M, Mp, k, w, bf););
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------
   Exported entry points: name_f32 / name_bf16, pointers first, then t0, t1, the number of
   threads and the sizes. Each splits [t0, t1) into contiguous ranges over an OpenMP team of
   `threads`: built with -fopenmp against libgomp.so.1, which is the runtime torch already
   loaded, so the team is the one torch's own ops use (its threads are warm, and no second
   pool competes with them for the cores). Per-thread scratch (partial sums, Sinkhorn's
   iterates) is a [threads, ...] buffer: thread k uses slice k. Without OpenMP, or with
   threads = 1, the caller's thread runs the whole range (native.py also calls ranges
   from its own threads in a forked child, where libgomp's pool cannot be used).
   --------------------------------------------------------------------------------------- */

#ifdef _OPENMP
#include <omp.h>
#define PARALLEL_RANGES(T0, T1, THREADS, CALL)                                          \
    do {                                                                                \
        const int64_t lo_ = (T0), hi_ = (T1);                                           \
        const int nt_ = (int)(THREADS);                                                 \
        /* One copy of CALL (the bodies are large): with if(0) the caller runs alone. */ \
        _Pragma("omp parallel num_threads(nt_) if(nt_ > 1)")                            \
        {                                                                               \
            const int64_t k_ = omp_get_thread_num(), m_ = omp_get_num_threads();        \
            const int64_t a_ = lo_ + (hi_ - lo_) * k_ / m_;                              \
            const int64_t b_ = lo_ + (hi_ - lo_) * (k_ + 1) / m_;                        \
            CALL;                                                                       \
        }                                                                               \
    } while (0)
#else
#define PARALLEL_RANGES(T0, T1, THREADS, CALL)                                          \
    do {                                                                                \
        const int64_t a_ = (T0), b_ = (T1);                                             \
        const int64_t k_ = 0;                                                           \
        (void)k_;                                                                       \
        (void)(THREADS);                                                                \
        CALL;                                                                           \
    } while (0)
#endif

/* 1 when built with OpenMP (native.py reports it). */
int native_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

#define EXPORT_BOTH(NAME, PARAMS, ARGS)                                                 \
    void NAME##_f32 PARAMS {                                                            \
        const int bf = 0;                                                               \
        PARALLEL_RANGES(t0, t1, threads, WITH_N(n, NAME##_body ARGS));                  \
    }                                                                                   \
    void NAME##_bf16 PARAMS {                                                           \
        const int bf = 1;                                                               \
        PARALLEL_RANGES(t0, t1, threads, WITH_N(n, NAME##_body ARGS));                  \
    }

EXPORT_BOTH(merge_fwd,
            (const void* x, const void* f, const float* hp, const float* hr, void* out,
             int64_t t0, int64_t t1, int64_t threads, int64_t n, int64_t C),
            (x, f, hp, hr, out, a_, b_, N_, C, bf))

EXPORT_BOTH(merge_bwd,
            (const void* x, const void* f, const float* hp, const float* hr, const void* g,
             void* dx, void* df, float* dhp, float* dhr, int64_t t0, int64_t t1,
             int64_t threads, int64_t n, int64_t C),
            (x, f, hp, hr, g, dx, df, dhp, dhr, a_, b_, N_, C, bf))

EXPORT_BOTH(pre_fwd,
            (const void* x, const float* h, void* a, int64_t t0, int64_t t1, int64_t threads,
             int64_t n, int64_t C),
            (x, h, a, a_, b_, N_, C, bf))

EXPORT_BOTH(pre_bwd,
            (const void* x, const float* h, const void* da, void* dx, float* dh, int64_t t0,
             int64_t t1, int64_t threads, int64_t n, int64_t C),
            (x, h, da, dx, dh, a_, b_, N_, C, bf))

EXPORT_BOTH(maps_fwd,
            (const void* x, const float* phip, const float* ab, float* lt, float* r,
             float* hpre, float* hpost, float* hres, void* a, int64_t t0, int64_t t1,
             int64_t threads, int64_t n, int64_t C, int64_t M, int64_t MV, int64_t iters,
             int64_t res, double norm_eps, double sk_eps, double pre_eps),
            (x, phip, ab, lt, r, hpre, hpost, hres, a, a_, b_, N_, C, M, MV, (int)iters,
             (int)res, (float)norm_eps, (float)sk_eps, (float)pre_eps, bf))

/* phitb: phi^T in blocks (maps_bwd_body). Per-thread slices: dphi DPHI_FLOATS(n C, Mp),
   sk_y [(2 iters - 1)(n n + n) 16], base [8 K]. */
EXPORT_BOTH(maps_bwd,
            (const void* x, const float* phitb, const float* ab, const float* lt,
             const float* r, const float* gpre, const float* gpost, const float* gres,
             const void* ga, const void* gmerge, void* dx, float* dht, float* dphi, float* sk_y,
             float* base, int64_t t0, int64_t t1, int64_t threads, int64_t n, int64_t C,
             int64_t M, int64_t MV, int64_t iters, int64_t res, double sk_eps,
             double pre_eps),
            (x, phitb, ab, lt, r, gpre, gpost, gres, ga, gmerge, dx, dht,
             dphi + k_ * DPHI_FLOATS(n * C, MV * WG),
             (v16*)(sk_y + k_ * (2 * iters - 1) * (n * n + n) * 16),
             base + k_ * 8 * n * C, a_, b_, N_, C, M, MV, (int)iters, (int)res,
             (float)sk_eps, (float)pre_eps, bf))

/* The maps backward's layouts of phi in and of its gradient out, in one pass each on the
   caller's thread. torch's transposing copies of the same [K, M] <-> [K / 16, M, 16]
   reshapes (small inner dimensions) took 196 us a call together, these 133 (K = 2048,
   M = 24, one thread, 48 MB of other traffic before each call, 15 interleaved rounds,
   benchmarks/bench_connection_calls.py, Zen 4, 2026-12-03): a fixed cost of every maps
   backward, whatever its token count.
   maps_phi_blocks: phitb [ceil(K / 16), M, 16] (phi^T's column blocks, zero past K) from
   phi [K, M]. maps_dphi_sum: dphi [K, M] = the sum of `parts` per-thread gradients of
   DPHI_FLOATS(K, Mp) floats each (blocks [ceil(K / 16), Mp, 16], or [K, Mp]). */
void maps_phi_blocks(const float* phi, float* phitb, int64_t K, int64_t M) {
    for (int64_t kb = 0; kb * W < K; ++kb) {  /* block kb: rows 16 kb .. of phi, transposed */
        const int64_t rows = K - kb * W < W ? K - kb * W : W;
        for (int64_t q = 0; q < M; ++q) {
            float* out = phitb + (kb * M + q) * W;
            for (int64_t i = 0; i < rows; ++i) out[i] = phi[(kb * W + i) * M + q];
            for (int64_t i = rows; i < W; ++i) out[i] = 0.0f;
        }
    }
}

void maps_dphi_sum(const float* parts, int64_t threads, int64_t K, int64_t M, int64_t Mp,
                   float* dphi) {
    const int64_t size = DPHI_FLOATS(K, Mp);
#if DPHI_TRANSPOSED
    for (int64_t kb = 0; kb * W < K; ++kb) {
        const int64_t rows = K - kb * W < W ? K - kb * W : W;
        const float* in = parts + kb * Mp * W;  /* [Mp, 16] */
        for (int64_t i = 0; i < rows; ++i)  /* row kb 16 + i of dphi: column i of the block */
            for (int64_t q = 0; q < M; ++q) {
                float s = in[q * W + i];
                for (int64_t p = 1; p < threads; ++p) s += in[p * size + q * W + i];
                dphi[(kb * W + i) * M + q] = s;
            }
    }
#else
    for (int64_t k = 0; k < K; ++k)
        for (int64_t q = 0; q < M; ++q) {
            float s = parts[k * Mp + q];
            for (int64_t p = 1; p < threads; ++p) s += parts[p * size + k * Mp + q];
            dphi[k * M + q] = s;
        }
#endif
}

EXPORT_BOTH(hc_fwd,
            (const void* x, const float* wp, const float* p, float* hpre, float* hpost,
             float* hres, void* a, int64_t t0, int64_t t1, int64_t threads, int64_t n,
             int64_t C, int64_t MV, double norm_eps),
            (x, wp, p, hpre, hpost, hres, a, a_, b_, N_, C, MV, (float)norm_eps, bf))

/* Per-thread slices: dw [C, Mp], base [8 C]. */
EXPORT_BOTH(hc_bwd,
            (const void* x, const float* wt, const float* d, const float* u, const float* r,
             const float* hpre, const float* hres, const float* gpre, const float* gpost,
             const float* gres, const void* ga, const void* gmerge, const float* sc, void* dx,
             float* gtot, float* dw, float* base, int64_t t0, int64_t t1, int64_t threads,
             int64_t n, int64_t C, int64_t M, int64_t MV),
            (x, wt, d, u, r, hpre, hres, gpre, gpost, gres, ga, gmerge, sc, dx, gtot,
             dw + k_ * C * MV * WG, base + k_ * MAX_TILE * C, a_, b_, N_, C, M, MV, bf))

#define EXPORT_ROWS(NAME, BF)                                                           \
    void rows_fwd_##NAME(const void* x, const float* wp, float* z, float* ss, int64_t r0,  \
                         int64_t r1, int64_t threads, int64_t K, int64_t MV) {          \
        PARALLEL_RANGES(r0, r1, threads, rows_fwd_body(x, wp, z, ss, a_, b_, K, MV, BF)); \
    }                                                                                   \
    /* Per-thread slices: dw [K, Mp]. */                                                \
    void rows_bwd_##NAME(const void* x, const float* wt, const float* dz, const float* coef, \
                         void* dx, float* dw, int64_t r0, int64_t r1, int64_t threads,  \
                         int64_t K, int64_t M, int64_t MV) {                            \
        PARALLEL_RANGES(r0, r1, threads,                                                \
                        rows_bwd_body(x, wt, dz, coef, dx, dw + k_ * K * MV * WG, a_, b_, \
                                      K, M, MV, BF));                                   \
    }

EXPORT_ROWS(f32, 0)
EXPORT_ROWS(bf16, 1)

/* ---------------------------------------------------------------------------------------
   Decoding: a connection's two calls per step without autograd, for a few tokens: its maps
   and aggregation before the branch, its merge after it. Every argument but the tensors of
   the call sits in one block prepared once per connection and shape (ops/cpu/decode.py):
   converting twenty ctypes arguments per call cost more than the arithmetic of one token.
   Each entry point takes the block and the call's tensors, as ops/cpu/decode_calls.c's
   built-in functions call them through the block's first two fields (without ctypes on the
   way), and ctypes where that extension is not built.
   They run the exported entry points' loop bodies on the caller's thread without entering
   OpenMP: even a parallel region that its if clause keeps to one thread passes through
   libgomp (a team made and ended), whose code and data the branch between two calls has
   pushed out of the caches (the maps call at batch 1 after 16 MiB of other traffic: 16.4
   against 21.7 us, 2026-12-02). The bodies are the autograd path's (its x @ phi on 8-float
   vectors where the training forward's may run 16-float ones: the same sums in the same
   order), so a decoded step gets the very bits of the autograd path.
   --------------------------------------------------------------------------------------- */

typedef struct decode_call decode_call;
struct decode_call {
    /* decode_calls.c declares these two fields again, first and in this order */
    void (*maps)(const decode_call* d, const void* x, void* a);
    void (*merge)(const decode_call* d, const void* x, const void* f, void* out);
    const float* table;  /* mHC: phi [n C, Mp]; HC: W [C, Mp] (padded float32) */
    const float* gates;  /* mHC: [2, M] gate and bias per logit; HC: its scalars */
    float* hpre;         /* [t, n] */
    float* hpost;        /* [t, n] */
    float* hres;         /* [t, n, n] */
    int64_t t, n, C, M, MV, iters, bf, kind;  /* kind: 0 mHC or a successor, 1 HC */
    int64_t res;         /* mHC's H_res map (RES_SINKHORN) or a successor's */
    double norm_eps, sk_eps, pre_eps;
};

/* The maps of x [t, n, C] into the block's hpre, hpost and hres, and the branch input a
   [t, C]. */
void decode_maps(const decode_call* d, const void* x, void* a) {
    if (d->kind == 0) {
        FOR_DTYPE(d->bf, WITH_N(d->n, maps_fwd_body(
            x, d->table, d->gates, NULL, NULL, d->hpre, d->hpost, d->hres, a, 0, d->t, N_,
            d->C, d->M, d->MV, (int)d->iters, (int)d->res, (float)d->norm_eps,
            (float)d->sk_eps, (float)d->pre_eps, bf)));
    } else {
        FOR_DTYPE(d->bf, WITH_N(d->n, hc_fwd_body(
            x, d->table, d->gates, d->hpre, d->hpost, d->hres, a, 0, d->t, N_, d->C, d->MV,
            (float)d->norm_eps, bf)));
    }
}

/* out [t, n, C] = H_res x + H_post^T f with the maps of the block's last decode_maps. */
void decode_merge(const decode_call* d, const void* x, const void* f, void* out) {
    FOR_DTYPE(d->bf, WITH_N(d->n, merge_fwd_body(x, f, d->hpost, d->hres, out, 0,
                                                  d->t, N_, d->C, bf)));
}

/* The block's size, for the test that native.py's DecodeCall matches it. */
int64_t decode_call_size(void) { return (int64_t)sizeof(decode_call); }

/* Where the block's entry points are, for decode.py to put in its first two fields. */
void decode_entry_points(decode_call* d) {
    d->maps = decode_maps;
    d->merge = decode_merge;
}
