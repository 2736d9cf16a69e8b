"""Native CPU loops for the streaming ops: pre-aggregation and post-merge, forward and backward.

Why C: these ops contract a tiny per-token n x n (or n) map with [n, C] rows. In torch they
become batched matmuls of 4 x 4 matrices (slow on the CPU) plus several passes over [T, n, C]
temporaries; a loop per token reads each row once and writes each result once, and the
same loop handles bfloat16 storage (converted to fp32 in registers). The CPU is the
bottleneck's memory bus, so fewer passes is the whole gain (benchmarks/NOTES_ops.md).

The source below is plain C99 with no torch headers: the system C compiler builds it in
about a second, once per machine, into a cache directory ($TORCH_MHC_CACHE, else
$XDG_CACHE_HOME/torch_mhc, else ~/.cache/torch_mhc), and ctypes loads it. If no compiler is
found or the build fails, `load()` returns None and ops.cpu uses its pure-torch path.
TORCH_MHC_NATIVE=0 disables the native path.

Calls split the tokens into torch.get_num_threads() contiguous ranges run on a thread pool
(ctypes releases the GIL during each call). Every function takes [t0, t1), the token range
to process, and contiguous tensors.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = ["load", "NativeOps"]

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16_t;

static inline float ld_f32(const float* p, int64_t i) { return p[i]; }
static inline void st_f32(float* p, int64_t i, float v) { p[i] = v; }
static inline float ld_bf16(const bf16_t* p, int64_t i) {
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline void st_bf16(bf16_t* p, int64_t i, float v) {
    /* Round to nearest even; NaN stays a (quiet) NaN. Branch-free, so loops vectorise. */
    uint32_t u;
    memcpy(&u, &v, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    p[i] = (bf16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
}

/* out[r] = sum_c a[c] rows[r][c] for r < m, in one pass over a. Each dot keeps a vector of
   16 partial sums (GCC/Clang vector extension: no -ffast-math needed) and the m dots
   interleave, so no FMA waits on the previous one. */
typedef float v16 __attribute__((vector_size(64)));
static inline v16 load16(const float* p) { v16 v; memcpy(&v, p, sizeof(v)); return v; }

static inline void dots(const float* restrict a, const float* const* rows, int64_t m,
                        int64_t C, float* restrict out) {
    v16 s[m];
    for (int64_t r = 0; r < m; ++r) s[r] = (v16){0};
    int64_t c = 0;
    for (; c + 16 <= C; c += 16) {
        const v16 va = load16(a + c);
        for (int64_t r = 0; r < m; ++r) s[r] += va * load16(rows[r] + c);
    }
    for (int64_t r = 0; r < m; ++r) {
        float acc = 0.0f;
        for (int64_t k = c; k < C; ++k) acc += a[k] * rows[r][k];
        for (int l = 0; l < 16; ++l) acc += s[r][l];
        out[r] = acc;
    }
}

static inline v16 ld16_f32(const float* p) { return load16(p); }
static inline void st16_f32(float* p, v16 v) { memcpy(p, &v, sizeof(v)); }
static inline v16 ld16_bf16(const bf16_t* p) {
    v16 v;
    for (int l = 0; l < 16; ++l) v[l] = ld_bf16(p, l);
    return v;
}
static inline void st16_bf16(bf16_t* p, v16 v) {
    for (int l = 0; l < 16; ++l) st_bf16(p, l, v[l]);
}

/* Rows of a token as float: a view for fp32 storage, a converted copy for bf16. */
#define ROWS_F32(dst, src, len, buf) const float* dst = (src)
#define ROWS_BF16(dst, src, len, buf) \
    for (int64_t q = 0; q < (len); ++q) (buf)[q] = ld_bf16((src), q); \
    const float* dst = (buf)

#define INLINE static inline __attribute__((always_inline))

#define DEFINE(SUF, T, LD, ST, ROWS, LD16, ST16)                                             \
/* out[t, i] = sum_j h_res[t, i, j] x[t, j] + h_post[t, i] f[t] */                           \
INLINE void merge_fwd_##SUF##_impl(const T* restrict x, const T* restrict f,                 \
                                   const float* restrict hp, const float* restrict hr,       \
                                   T* restrict out, int64_t t0, int64_t t1, int64_t n,       \
                                   int64_t C) {                                              \
    float* acc = (float*)malloc(sizeof(float) * C);                                          \
    for (int64_t t = t0; t < t1; ++t) {                                                      \
        const T* xt = x + t * n * C;                                                         \
        const T* ft = f + t * C;                                                             \
        for (int64_t i = 0; i < n; ++i) {                                                    \
            const float p = hp[t * n + i];                                                   \
            for (int64_t c = 0; c < C; ++c) acc[c] = p * LD(ft, c);                          \
            for (int64_t j = 0; j < n; ++j) {                                                \
                const float h = hr[(t * n + i) * n + j];                                     \
                const T* xj = xt + j * C;                                                    \
                for (int64_t c = 0; c < C; ++c) acc[c] += h * LD(xj, c);                     \
            }                                                                                \
            T* oi = out + (t * n + i) * C;                                                   \
            for (int64_t c = 0; c < C; ++c) ST(oi, c, acc[c]);                               \
        }                                                                                    \
    }                                                                                        \
    free(acc);                                                                               \
}                                                                                            \
                                                                                             \
/* dx[t, j] = sum_i h_res[t, i, j] g[t, i]; df[t] = sum_i h_post[t, i] g[t, i];              \
   dh_post[t, i] = <g[t, i], f[t]>; dh_res[t, i, j] = <g[t, i], x[t, j]> */                  \
INLINE void merge_bwd_##SUF##_impl(const T* restrict x, const T* restrict f,                 \
                                   const float* restrict hp, const float* restrict hr,       \
                                   const T* restrict g, T* restrict dx, T* restrict df,      \
                                   float* restrict dhp, float* restrict dhr,                 \
                                   int64_t t0, int64_t t1, int64_t n, int64_t C) {           \
    float* buf = (float*)malloc(sizeof(float) * ((2 * n + 2) * C + n + 1));                  \
    float* acc = buf + (2 * n + 1) * C;                                                      \
    float* prod = acc + C;                                                                   \
    const float* rows[n + 1];                                                                \
    for (int64_t t = t0; t < t1; ++t) {                                                      \
        ROWS(gt, g + t * n * C, n * C, buf);                                                 \
        ROWS(xt, x + t * n * C, n * C, buf + n * C);                                         \
        ROWS(ft, f + t * C, C, buf + 2 * n * C);                                             \
        for (int64_t j = 0; j < n; ++j) {                                                    \
            for (int64_t c = 0; c < C; ++c) acc[c] = 0.0f;                                   \
            for (int64_t i = 0; i < n; ++i) {                                                \
                const float h = hr[(t * n + i) * n + j];                                     \
                const float* gi = gt + i * C;                                                \
                for (int64_t c = 0; c < C; ++c) acc[c] += h * gi[c];                         \
            }                                                                                \
            T* dxj = dx + (t * n + j) * C;                                                   \
            for (int64_t c = 0; c < C; ++c) ST(dxj, c, acc[c]);                              \
        }                                                                                    \
        for (int64_t j = 0; j < n; ++j) rows[j] = xt + j * C;                                \
        rows[n] = ft;                                                                        \
        for (int64_t c = 0; c < C; ++c) acc[c] = 0.0f;                                       \
        for (int64_t i = 0; i < n; ++i) {                                                    \
            const float p = hp[t * n + i];                                                   \
            const float* gi = gt + i * C;                                                    \
            for (int64_t c = 0; c < C; ++c) acc[c] += p * gi[c];                             \
            dots(gi, rows, n + 1, C, prod);  /* <g_i, x_0>, ..., <g_i, x_n-1>, <g_i, f> */   \
            for (int64_t j = 0; j < n; ++j) dhr[(t * n + i) * n + j] = prod[j];              \
            dhp[t * n + i] = prod[n];                                                        \
        }                                                                                    \
        T* dft = df + t * C;                                                                 \
        for (int64_t c = 0; c < C; ++c) ST(dft, c, acc[c]);                                  \
    }                                                                                        \
    free(buf);                                                                               \
}                                                                                            \
                                                                                             \
/* out[t] = sum_j h[t, j] x[t, j] */                                                         \
INLINE void pre_fwd_##SUF##_impl(const T* restrict x, const float* restrict h,               \
                                 T* restrict out, int64_t t0, int64_t t1, int64_t n,         \
                                 int64_t C) {                                                \
    float* acc = (float*)malloc(sizeof(float) * C);                                          \
    for (int64_t t = t0; t < t1; ++t) {                                                      \
        for (int64_t c = 0; c < C; ++c) acc[c] = 0.0f;                                       \
        for (int64_t j = 0; j < n; ++j) {                                                    \
            const float hj = h[t * n + j];                                                   \
            const T* xj = x + (t * n + j) * C;                                               \
            for (int64_t c = 0; c < C; ++c) acc[c] += hj * LD(xj, c);                        \
        }                                                                                    \
        T* ot = out + t * C;                                                                 \
        for (int64_t c = 0; c < C; ++c) ST(ot, c, acc[c]);                                   \
    }                                                                                        \
    free(acc);                                                                               \
}                                                                                            \
                                                                                             \
/* dx[t, j] = h[t, j] da[t]; dh[t, j] = <x[t, j], da[t]> */                                  \
INLINE void pre_bwd_##SUF##_impl(const T* restrict x, const float* restrict h,               \
                                 const T* restrict da, T* restrict dx, float* restrict dh,   \
                                 int64_t t0, int64_t t1, int64_t n, int64_t C) {             \
    float* buf = (float*)malloc(sizeof(float) * (n + 1) * C);                                \
    const float* rows[n];                                                                    \
    for (int64_t t = t0; t < t1; ++t) {                                                      \
        ROWS(at, da + t * C, C, buf);                                                        \
        ROWS(xt, x + t * n * C, n * C, buf + C);                                             \
        for (int64_t j = 0; j < n; ++j) {                                                    \
            if (dx) {  /* NULL: only dh (the fused maps backward writes dx) */               \
                const float hj = h[t * n + j];                                               \
                T* dxj = dx + (t * n + j) * C;                                               \
                for (int64_t c = 0; c < C; ++c) ST(dxj, c, hj * at[c]);                      \
            }                                                                                \
            rows[j] = xt + j * C;                                                            \
        }                                                                                    \
        dots(at, rows, n, C, dh + t * n);                                                    \
    }                                                                                        \
    free(buf);                                                                               \
}                                                                                            \
                                                                                             \
/* nt (<= 8) tokens from t of maps_dx; nt is a constant 8 for full blocks after inlining.   \
   Walks stream by stream so that the optional pre-aggregation term h_pre[t, j] ga[t]      \
   (the same pass's other gradient of x) lines up with channel c. */                         \
INLINE void maps_dx_block_##SUF(const T* restrict x, const float* restrict dz,               \
                                const float* restrict phit, const float* restrict coef,      \
                                const float* restrict hp, const T* restrict ga,              \
                                T* restrict dx, int64_t t, int64_t nt, int64_t M,            \
                                int64_t n, int64_t C) {                                      \
    const int64_t K = n * C;                                                                 \
    for (int64_t j = 0; j < n; ++j) {                                                        \
        int64_t c = 0;                                                                       \
        for (; c + 16 <= C; c += 16) {                                                       \
            const int64_t k = j * C + c;                                                     \
            v16 acc[nt];                                                                     \
            for (int64_t u = 0; u < nt; ++u)                                                 \
                acc[u] = coef[t + u] * LD16(x + (t + u) * K + k);                            \
            if (ga)                                                                          \
                for (int64_t u = 0; u < nt; ++u)                                             \
                    acc[u] += hp[(t + u) * n + j] * LD16(ga + (t + u) * C + c);              \
            for (int64_t m = 0; m < M; ++m) {                                                \
                const v16 p = load16(phit + m * K + k);                                      \
                for (int64_t u = 0; u < nt; ++u) acc[u] += dz[(t + u) * M + m] * p;          \
            }                                                                                \
            for (int64_t u = 0; u < nt; ++u) ST16(dx + (t + u) * K + k, acc[u]);             \
        }                                                                                    \
        for (; c < C; ++c)                                                                   \
            for (int64_t u = 0; u < nt; ++u) {                                               \
                const int64_t k = j * C + c;                                                 \
                float a = coef[t + u] * LD(x + (t + u) * K, k);                              \
                if (ga) a += hp[(t + u) * n + j] * LD(ga + (t + u) * C, c);                  \
                for (int64_t m = 0; m < M; ++m) a += dz[(t + u) * M + m] * phit[m * K + k];  \
                ST(dx + (t + u) * K, k, a);                                                  \
            }                                                                                \
    }                                                                                        \
}

DEFINE(f32, float, ld_f32, st_f32, ROWS_F32, ld16_f32, st16_f32)
DEFINE(bf16, bf16_t, ld_bf16, st_bf16, ROWS_BF16, ld16_bf16, st16_bf16)

/* Exported entry points, one per op and dtype. */
#define EXPORT(SUF, T)                                                                       \
void merge_fwd_##SUF(const T* x, const T* f, const float* hp, const float* hr, T* out,       \
                     int64_t t0, int64_t t1, int64_t n, int64_t C) {                         \
    merge_fwd_##SUF##_impl(x, f, hp, hr, out, t0, t1, n, C);                                 \
}                                                                                            \
void merge_bwd_##SUF(const T* x, const T* f, const float* hp, const float* hr, const T* g,   \
                     T* dx, T* df, float* dhp, float* dhr,                                   \
                     int64_t t0, int64_t t1, int64_t n, int64_t C) {                         \
    merge_bwd_##SUF##_impl(x, f, hp, hr, g, dx, df, dhp, dhr, t0, t1, n, C);                 \
}                                                                                            \
void pre_fwd_##SUF(const T* x, const float* h, T* out,                                       \
                   int64_t t0, int64_t t1, int64_t n, int64_t C) {                           \
    pre_fwd_##SUF##_impl(x, h, out, t0, t1, n, C);                                           \
}                                                                                            \
void pre_bwd_##SUF(const T* x, const float* h, const T* da, T* dx, float* dh,                \
                   int64_t t0, int64_t t1, int64_t n, int64_t C) {                           \
    pre_bwd_##SUF##_impl(x, h, da, dx, dh, t0, t1, n, C);                                    \
}                                                                                            \
/* The maps' input gradient dx[t] = coef[t] x[t] + dz[t] @ phi^T (+ h_pre[t, j] ga[t] on    \
   stream j when ga is not NULL), phit = phi^T [M, n*C]: blocks of 8 tokens share each       \
   16-wide slice of phi^T (read from L2 once per block). */                                  \
void maps_dx_##SUF(const T* x, const float* dz, const float* phit, const float* coef,        \
                   const float* hp, const T* ga, T* dx,                                      \
                   int64_t t0, int64_t t1, int64_t M, int64_t n, int64_t C) {                \
    int64_t t = t0;                                                                          \
    for (; t + 8 <= t1; t += 8)                                                              \
        maps_dx_block_##SUF(x, dz, phit, coef, hp, ga, dx, t, 8, M, n, C);                   \
    if (t < t1) maps_dx_block_##SUF(x, dz, phit, coef, hp, ga, dx, t, t1 - t, M, n, C);      \
}

EXPORT(f32, float)
EXPORT(bf16, bf16_t)
"""


_FLAGS = ["-O3", "-march=native", "-std=gnu11", "-ffp-contract=fast", "-shared", "-fPIC"]
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_MIN_TOKENS_PER_THREAD = 64


def _cache_dir() -> Path:
    if os.environ.get("TORCH_MHC_CACHE"):
        return Path(os.environ["TORCH_MHC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torch_mhc"


def _cpu_signature() -> str:
    """What -march=native depends on: the machine and its CPU flags."""
    flags = ""
    with_flags = Path("/proc/cpuinfo")
    if with_flags.exists():
        for line in with_flags.read_text(errors="replace").splitlines():
            if line.startswith("flags"):
                flags = line
                break
    return f"{platform.machine()}|{platform.processor()}|{flags}"


def _build(compiler: str) -> Path:
    key = hashlib.sha256(
        "\n".join([_SOURCE, compiler, " ".join(_FLAGS), _cpu_signature()]).encode()
    ).hexdigest()[:16]
    cache = _cache_dir()
    lib = cache / f"torch_mhc_cpu_{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src = Path(tmp) / "torch_mhc_cpu.c"
        src.write_text(_SOURCE)
        out = Path(tmp) / lib.name
        proc = subprocess.run([compiler, *_FLAGS, str(src), "-o", str(out)],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{proc.stderr[-2000:]}")
        os.replace(out, lib)  # atomic: concurrent builders each publish a complete file
    return lib


class NativeOps:
    """The loaded library; each method runs one op over all tokens on the thread pool."""

    def __init__(self, path: Path):
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        # Pointer arguments, then t0, t1 and the sizes: (n, C), or (M, n, C) for maps_dx.
        arity = {"merge_fwd": (5, 2), "merge_bwd": (9, 2), "pre_fwd": (3, 2),
                 "pre_bwd": (5, 2), "maps_dx": (7, 3)}
        for name, (n_ptrs, n_sizes) in arity.items():
            for suffix in _SUFFIX.values():
                fn = getattr(self._lib, f"{name}_{suffix}")
                fn.argtypes = [p] * n_ptrs + [i64] * (2 + n_sizes)
                fn.restype = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    def _run(self, name: str, dtype: torch.dtype, tensors: list, tokens: int, *sizes: int):
        """Call name_<dtype>(pointers..., t0, t1, *sizes) over [0, tokens) on the pool.

        A None among tensors passes NULL (an optional operand).
        """
        fn = getattr(self._lib, f"{name}_{_SUFFIX[dtype]}")
        ptrs = [None if t is None else t.data_ptr() for t in tensors]
        threads = max(1, min(torch.get_num_threads(), tokens // _MIN_TOKENS_PER_THREAD))
        if threads == 1:
            fn(*ptrs, 0, tokens, *sizes)
            return
        if self._pool is None or self._pool_size != threads:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="torch_mhc")
            self._pool_size = threads
        bounds = [tokens * k // threads for k in range(threads + 1)]
        futures = [self._pool.submit(fn, *ptrs, bounds[k], bounds[k + 1], *sizes)
                   for k in range(threads)]
        for fut in futures:
            fut.result()

    def merge_fwd(self, x, f, h_post, h_res):
        t, n, c = x.shape
        out = torch.empty_like(x)
        self._run("merge_fwd", x.dtype, [x, f, h_post, h_res, out], t, n, c)
        return out

    def merge_bwd(self, x, f, h_post, h_res, g):
        t, n, c = x.shape
        dx, df = torch.empty_like(x), torch.empty_like(f)
        dh_post, dh_res = torch.empty_like(h_post), torch.empty_like(h_res)
        self._run("merge_bwd", x.dtype, [x, f, h_post, h_res, g, dx, df, dh_post, dh_res],
                  t, n, c)
        return dx, df, dh_post, dh_res

    def pre_fwd(self, x, h):
        t, n, c = x.shape
        out = x.new_empty((t, c))
        self._run("pre_fwd", x.dtype, [x, h, out], t, n, c)
        return out

    def maps_dx(self, x, dz, phit, coef, h_pre=None, ga=None):
        """coef[t] x[t] + dz[t] @ phit (+ h_pre[t, j] ga[t] on stream j) for x [T, n, C],
        dz [T, M], phit [M, n*C], coef [T], h_pre [T, n], ga [T, C]."""
        t, n, c = x.shape
        dx = torch.empty_like(x)
        self._run("maps_dx", x.dtype, [x, dz, phit, coef, h_pre, ga, dx], t, dz.shape[1], n, c)
        return dx

    def pre_bwd(self, x, h, da):
        t, n, c = x.shape
        dx, dh = torch.empty_like(x), torch.empty_like(h)
        self._run("pre_bwd", x.dtype, [x, h, da, dx, dh], t, n, c)
        return dx, dh

    def pre_dh(self, x, da):
        """pre_bwd's dh alone: <x[t, j], da[t]> -> [T, n] float32."""
        t, n, c = x.shape
        dh = x.new_empty((t, n), dtype=torch.float32)
        self._run("pre_bwd", x.dtype, [x, None, da, None, dh], t, n, c)
        return dh


def supports(*tensors: torch.Tensor) -> bool:
    """The dtypes and device the native loops handle (the maps are float32)."""
    x = tensors[0]
    return x.device.type == "cpu" and x.dtype in _SUFFIX


_loaded: NativeOps | None = None
_tried = False


def load() -> NativeOps | None:
    """Build (once per machine) and load the library; None if disabled or unavailable."""
    global _loaded, _tried
    if _tried:
        return _loaded
    _tried = True
    if os.environ.get("TORCH_MHC_NATIVE", "1").strip() in ("0", "false", "no", "off"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") \
        or shutil.which("clang")
    if compiler is None or sys.platform == "win32":
        return None
    try:
        _loaded = NativeOps(_build(compiler))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        warnings.warn(f"torch_mhc: native CPU ops unavailable, using pure torch ({err})",
                      stacklevel=2)
    return _loaded
