"""Native CPU loops for the connection's passes over the streams (source: native.c).

Why C: these ops contract a tiny per-token n x n (or n) map with [n, C] rows, plus two
skinny matmuls with phi. In torch they become batched matmuls of 4 x 4 matrices (slow on the
CPU), several passes over [T, n, C] temporaries and a dozen small ops per Sinkhorn
iteration; a loop per token tile reads each row once, writes each result once, keeps the
per-token partial sums in vector registers, and handles bfloat16 storage (converted to fp32
in registers). native.c says what each kernel fuses; benchmarks/NOTES_ops.md has the
measurements.

Building (ops/cpu/build.py): nothing happens at import. The first native op builds the
library with the system C compiler (plain C11 with GCC/Clang vector extensions and OpenMP,
no torch headers; once per machine and source version) into a cache directory, or finds it
there, and loads it with ctypes (the two decoding calls, ops/cpu/decode.py, go through a
small CPython extension built the same way at the first one, decode_calls.c, or ctypes
where it does not build). Without a working compiler one warning names the
pure-torch fallback that ops.cpu then uses; TORCH_MHC_NATIVE=0 turns the native path off
(and the warning with it).

Threads: a call splits the tokens into torch.get_num_threads() contiguous ranges over an
OpenMP team of libgomp, the runtime torch itself uses (native.c), so the kernels share
torch's intra-op threads instead of competing with them. ctypes releases the GIL during the
call. In a process forked after the parent ran a parallel region, libgomp's team cannot be
used (its threads were not copied; torch's own parallel ops wait forever there too), so
an at-fork handler switches the child to ranges run on threads it starts itself.

Memory: large outputs come from a BlockPool of private anonymous mappings, reused once no
tensor holds them (TORCH_MHC_CPU_POOL_MB caps it, default 1024 MiB; 0 turns it off).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import math
import mmap
import os
import threading
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from torch_mhc.functional import successors as _successors
from torch_mhc.ops.cpu.build import build_decode_calls, build_library, warn_fallback

__all__ = ["DecodeCall", "SINGLE_THREAD_TOKENS", "load", "NativeOps"]

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_MIN_TOKENS_PER_THREAD = 64
# Below this many tokens a call runs on one thread (decoding); ops/cpu/decode.py prepares
# calls for such calls only.
SINGLE_THREAD_TOKENS = 2 * _MIN_TOKENS_PER_THREAD


class BlockPool:
    """Reusable page-aligned memory for the kernels' large outputs ([T, n, C] and [T, C]).

    Why: glibc hands large blocks back to the system when they are freed, so every fresh
    output of a training step is faulted in and zeroed by the kernel again, which cost about
    as much as the merge itself (benchmarks/NOTES_ops.md). The pool keeps the private
    anonymous mappings it made (copy-on-write after fork: a child's writes never reach its
    parent, nor the other way) and lends each out as a tensor over a small ctypes view of
    the mapping; the tensor's storage holds the view, and when the last tensor (or view of
    one) goes, the view is freed and its weak-reference callback puts the block back on the
    free list. Blocks are kept up to `cap_bytes` in all (in use or not); beyond that, and
    below `min_bytes`, outputs are ordinary torch.empty tensors. TORCH_MHC_CPU_POOL_MB sets
    the cap (default 1024; 0 turns the pool off).
    """

    def __init__(self, cap_bytes: int, min_bytes: int = 1 << 20):
        self.cap_bytes, self.min_bytes = cap_bytes, min_bytes
        self.held = 0  # bytes of all blocks made, in use or not
        self._free: dict[int, deque] = {}  # size -> mappings no tensor holds
        self._lent: dict[int, tuple] = {}  # id(view) -> (weakref to the view, its mapping)
        self._lock = threading.Lock()  # guards held and making blocks (not the callbacks)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, numel: int | None = None
              ) -> torch.Tensor:
        """An uninitialised tensor: a free pooled block, a new one, or torch.empty
        (numel: the product of shape, where the caller has it)."""
        if numel is None:
            numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if nbytes < self.min_bytes or self.cap_bytes <= 0:
            return torch.empty(shape, dtype=dtype)
        free = self._free.setdefault(nbytes, deque())
        try:
            block = free.pop()  # deque.pop / append are atomic: callbacks may run anywhere
        except IndexError:
            with self._lock:
                if self.held + nbytes > self.cap_bytes:
                    return torch.empty(shape, dtype=dtype)
                self.held += nbytes
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            block = mmap.mmap(-1, nbytes, flags=flags)
        return self._lend(block, nbytes, dtype, numel).view(shape)

    def _lend(self, block: mmap.mmap, nbytes: int, dtype: torch.dtype, numel: int):
        view = (ctypes.c_char * nbytes).from_buffer(block)
        key = id(view)

        def give_back(_, free=self._free[nbytes], lent=self._lent, key=key, block=block):
            lent.pop(key, None)
            free.append(block)

        self._lent[key] = (weakref.ref(view, give_back), block)
        return torch.frombuffer(view, dtype=dtype, count=numel)


def _pool_cap() -> int:
    text = os.environ.get("TORCH_MHC_CPU_POOL_MB", "1024").strip()
    try:
        return int(float(text) * (1 << 20))
    except ValueError:
        raise ValueError(f"TORCH_MHC_CPU_POOL_MB must be a number of MiB, got {text!r}") from None


_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
# Argument types after the pointers, t0, t1 and the thread count (native.c's exports).
_SIGNATURES = {
    "merge_fwd": (5, [_I, _I]),  # n, C
    "merge_bwd": (9, [_I, _I]),
    "pre_fwd": (3, [_I, _I]),
    "pre_bwd": (5, [_I, _I]),
    # n, C, M, MV, iters, res (RES below), norm_eps, sk_eps, pre_eps
    "maps_fwd": (9, [_I, _I, _I, _I, _I, _I, _D, _D, _D]),
    "maps_bwd": (15, [_I, _I, _I, _I, _I, _I, _D, _D]),  # n, C, M, MV, iters, res, 2 epsilons
    "hc_fwd": (7, [_I, _I, _I, _D]),  # n, C, MV, norm_eps
    "hc_bwd": (17, [_I, _I, _I, _I]),  # n, C, M, MV
    "rows_fwd": (4, [_I, _I]),  # K, MV
    "rows_bwd": (6, [_I, _I, _I]),  # K, M, MV
}


class DecodeCall(ctypes.Structure):
    """native.c's decode_call: its two entry points (set by NativeOps.entry_points), then
    every argument of a connection's two decoding calls but their tensors."""

    _fields_ = [(name, _P) for name in
                ("maps", "merge", "table", "gates", "hpre", "hpost", "hres")]
    _fields_ += [(name, _I) for name in
                 ("t", "n", "C", "M", "MV", "iters", "bf", "kind", "res")]
    _fields_ += [(name, _D) for name in ("norm_eps", "sk_eps", "pre_eps")]


class PerThread:
    """A [threads, ...] buffer: each thread of a call gets its own slice (partial sums)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def padded_width(m: int, width: int = 8) -> int:
    """Columns of phi padded to whole vectors of `width` floats (the skinny matmuls' register
    tiles: 8, or NativeOps.skinny_width for the training forward)."""
    return -(-m // width) * width


class NativeOps:
    """The loaded library; each method runs one op over all tokens on torch's threads."""

    def __init__(self, path: Path):
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._fns = {}  # (name, dtype) -> the entry point
        for name, (n_ptrs, sizes) in _SIGNATURES.items():
            for dtype, suffix in _SUFFIX.items():
                fn = getattr(self._lib, f"{name}_{suffix}")
                fn.argtypes = [_P] * n_ptrs + [_I, _I, _I] + sizes
                fn.restype = None
                self._fns[name, dtype] = fn
        # decode_maps(&call, x, a), decode_merge(&call, x, f, out): addresses; called through
        # decode_calls.c's built-ins where they build (decoding_calls)
        for name, count in (("decode_maps", 3), ("decode_merge", 4), ("decode_entry_points", 1)):
            fn = getattr(self._lib, name)
            fn.argtypes, fn.restype = [_P] * count, None
        # maps_phi_blocks(phi, phitb, K, M), maps_dphi_sum(parts, threads, K, M, Mp, dphi)
        self._lib.maps_phi_blocks.argtypes = [_P, _P, _I, _I]
        self._lib.maps_dphi_sum.argtypes = [_P, _I, _I, _I, _I, _P]
        self._lib.maps_phi_blocks.restype = self._lib.maps_dphi_sum.restype = None
        self._decoding: tuple | None = None
        self.openmp = bool(self._lib.native_openmp())
        # 16 where the forward's x @ phi runs 16-float vectors over a phi padded to 16 columns
        # (the AVX-512 builds build.py asks it for: Intel's, AMD's from Zen 5), else 8
        # (native.c's xphi_tile16)
        self.skinny_width = int(self._lib.native_skinny_width())
        # whether maps_bwd's per-thread dphi partials are transposed blocks [K / 16, Mp, 16]
        # (AVX-512 builds) or [K, Mp]
        self.dphi_transposed = bool(self._lib.native_dphi_transposed())
        # Threads this process started itself: used where OpenMP cannot be (a forked child,
        # or a library built without OpenMP). Reset in a forked child (its threads are gone).
        self.own_threads = not self.openmp
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self.blocks = BlockPool(_pool_cap())

    def entry_points(self, call: DecodeCall) -> None:
        """Put this library's decode_maps and decode_merge in call's first two fields."""
        self._lib.decode_entry_points(ctypes.addressof(call))

    def decoding_calls(self) -> tuple:
        """(maps, merge): maps(call, x, a) and merge(call, x, f, out), every argument an
        address (ctypes.addressof(call) of a DecodeCall filled by entry_points, the tensors'
        data_ptr()), calling the call block's entry points. decode_calls.c's built-in
        functions where that extension builds (at the first call here), else the library's
        functions through ctypes: the same entry points, a few microseconds slower a call."""
        if self._decoding is None:
            module = _decode_calls_module()
            self._decoding = ((module.maps, module.merge) if module is not None else
                              (self._lib.decode_maps, self._lib.decode_merge))
        return self._decoding

    def after_fork_in_child(self) -> None:
        """libgomp's team and our executor's threads exist only in the parent."""
        self.own_threads = True
        self._pool, self._pool_size = None, 0

    def threads_for(self, tokens: int) -> int:
        """How many threads a call over `tokens` tokens uses."""
        if tokens < SINGLE_THREAD_TOKENS:  # decoding: skip the query
            return 1
        return max(1, min(torch.get_num_threads(), tokens // _MIN_TOKENS_PER_THREAD))

    def _run(self, name: str, dtype: torch.dtype, tensors: list, tokens: int, *sizes):
        """Call name_<dtype>(pointers..., t0, t1, threads, *sizes) over [0, tokens).

        A None among tensors passes NULL (an optional operand); a PerThread passes the
        address of its slice 0 (the library offsets thread k to slice k), or of slice k to
        the range run by our own thread k.
        """
        fn = self._fns[name, dtype]
        threads = self.threads_for(tokens)

        def pointers(k):
            return [None if t is None else
                    t.tensor[k].data_ptr() if isinstance(t, PerThread) else t.data_ptr()
                    for t in tensors]

        if threads == 1 or not self.own_threads:
            fn(*pointers(0), 0, tokens, threads, *sizes)
            return
        if self._pool is None or self._pool_size != threads:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="torch_mhc")
            self._pool_size = threads
        bounds = [tokens * k // threads for k in range(threads + 1)]
        futures = [self._pool.submit(fn, *pointers(k), bounds[k], bounds[k + 1], 1, *sizes)
                   for k in range(threads)]
        for fut in futures:
            fut.result()

    def merge_fwd(self, x, f, h_post, h_res):
        """H_res x + H_post^T f for x [T, n, C], f [T, C], h_post [T, n], h_res [T, n, n]
        (contiguous; any leading shape in place of T: the output has x's shape)."""
        numel = x.numel()
        t = numel // (x.shape[-2] * x.shape[-1]) if numel else 0
        out = self.blocks.empty(x.shape, x.dtype, numel)
        self._run("merge_fwd", x.dtype, [x, f, h_post, h_res, out], t, *x.shape[-2:])
        return out

    def merge_bwd(self, x, f, h_post, h_res, g, fused_dx=False):
        """(dx, df, dh_post, dh_res) for the merge's upstream gradient g; fused_dx=True leaves
        dx and dh_res to the maps' backward (None here) and does not read x."""
        t, n, c = x.shape
        dx = None if fused_dx else self.blocks.empty(x.shape, x.dtype)
        df = self.blocks.empty(f.shape, f.dtype)
        dh_post = torch.empty_like(h_post)
        dh_res = None if fused_dx else torch.empty_like(h_res)
        self._run("merge_bwd", x.dtype, [x, f, h_post, h_res, g, dx, df, dh_post, dh_res],
                  t, n, c)
        return dx, df, dh_post, dh_res

    def pre_fwd(self, x, h):
        t, n, c = x.shape
        out = self.blocks.empty((t, c), x.dtype)
        self._run("pre_fwd", x.dtype, [x, h, out], t, n, c)
        return out

    def pre_bwd(self, x, h, da):
        t, n, c = x.shape
        dx, dh = self.blocks.empty(x.shape, x.dtype), torch.empty_like(h)
        self._run("pre_bwd", x.dtype, [x, h, da, dx, dh], t, n, c)
        return dx, dh

    def maps_fwd(self, x, phip, ab, iters, norm_eps, sk_eps, pre_eps, with_pre, res=0):
        """The mHC maps of x [T, n, C] (and the pre-aggregation when with_pre); res = RES[kind]
        for a successor's H_res in place of Sinkhorn (M = 2 n + res_count then).

        phip: phi [n*C, M] in float32 with columns zero-padded to padded_width(M); ab: [2, M]
        float32, the gate per logit row and the static biases. Returns lt [T, M] (logits
        after the RMS division), r [T], H_pre [T, n], H_post [T, n], H_res [T, n, n] and
        a [T, C] in x's dtype (None without with_pre).
        """
        t, n, c = x.shape
        _check_tables(phip, ab, n * c)
        m = ab.shape[1]
        _check_res(res, n, m)
        f32 = dict(dtype=torch.float32, device=x.device)
        lt, r = torch.empty((t, m), **f32), torch.empty((t,), **f32)
        h_pre, h_post = torch.empty((t, n), **f32), torch.empty((t, n), **f32)
        h_res = torch.empty((t, n, n), **f32)
        a = self.blocks.empty((t, c), x.dtype) if with_pre else None
        self._run("maps_fwd", x.dtype, [x, phip, ab, lt, r, h_pre, h_post, h_res, a], t,
                  n, c, m, phip.shape[1] // 8, iters, res, norm_eps, sk_eps, pre_eps)
        return lt, r, h_pre, h_post, h_res, a

    def maps_infer(self, x, phip, ab, iters, norm_eps, sk_eps, pre_eps, res=0):
        """maps_fwd's H_pre [..., n], H_post [..., n], H_res [..., n, n] and a [..., C] for
        contiguous x [..., n, C] of any leading shape, in that shape, without the logits and
        the RMS (inference: nothing is kept for a backward)."""
        *lead, n, c = x.shape
        t = math.prod(lead)
        _check_tables(phip, ab, n * c)
        _check_res(res, n, ab.shape[1])
        h_pre, h_post, h_res, a = self._maps_outputs(x, lead, t, True)
        self._run("maps_fwd", x.dtype, [x, phip, ab, None, None, h_pre, h_post, h_res, a], t,
                  n, c, ab.shape[1], phip.shape[1] // 8, iters, res, norm_eps, sk_eps,
                  pre_eps)
        return h_pre, h_post, h_res, a

    def hc_infer(self, x, wp, p, norm_eps, with_pre):
        """HC's H_pre [..., n], H_post [..., n], H_res [..., n, n] and, with with_pre,
        a [..., C] for contiguous x [..., n, C] of any leading shape (inference).

        wp: W [C, n + 2] in float32 with columns zero-padded to padded_width; p: float32
        (s_alpha, s_beta, static_pre [n], static_post [n], static_res [n n]).
        """
        *lead, n, c = x.shape
        t = math.prod(lead)
        h_pre, h_post, h_res, a = self._maps_outputs(x, lead, t, with_pre)
        self._run("hc_fwd", x.dtype, [x, wp, p, h_pre, h_post, h_res, a], t, n, c,
                  wp.shape[1] // 8, norm_eps)
        return (h_pre, h_post, h_res, a) if with_pre else (h_pre, h_post, h_res)

    def _maps_outputs(self, x, lead, t, with_pre):
        """Uninitialised H_pre, H_post, H_res (float32) and a (x's dtype, or None) for
        streams x [*lead, n, C] of t tokens."""
        n, c = x.shape[-2:]
        f32 = torch.float32
        return (torch.empty((*lead, n), dtype=f32), torch.empty((*lead, n), dtype=f32),
                torch.empty((*lead, n, n), dtype=f32),
                self.blocks.empty((*lead, c), x.dtype, t * c) if with_pre else None)

    def maps_bwd(self, x, phi, ab, lt, r, g_pre, g_post, g_res, g_a, g_merge, iters, sk_eps,
                 pre_eps, res=0):
        """dx [T, n, C] (x's dtype), dh~ [T, M] and dphi [n*C, M] of the maps (and of the
        aggregation when g_a is given; of the merge's H_res x when g_merge is given).

        phi: [n*C, M] float32, any strides; the gradients are float32 [T, n], [T, n], [T, n, n]
        and x's dtype [T, C], [T, n, C]; any may be None. res as in maps_fwd.
        """
        t, n, c = x.shape
        m = ab.shape[1]
        _check_res(res, n, m)
        if tuple(phi.shape) != (n * c, m):
            raise ValueError(f"maps_bwd: phi must be [n*C, M] = [{n * c}, {m}] for x "
                             f"{tuple(x.shape)} and ab {tuple(ab.shape)}, got {tuple(phi.shape)}")
        mp = padded_width(m)
        dx = self.blocks.empty(x.shape, x.dtype)
        dht = torch.empty((t, m), dtype=torch.float32, device=x.device)
        threads = self.threads_for(t)
        # phi^T [M, n C] in 16-float column blocks [ceil(n C / 16), M, 16], zero past n C
        # (dx reads a chunk's M rows as one run of memory)
        blocks = -(-n * c // 16)
        phi = phi.to(torch.float32).contiguous()
        phitb = torch.empty((blocks, m, 16), dtype=torch.float32)
        self._lib.maps_phi_blocks(phi.data_ptr(), phitb.data_ptr(), n * c, m)
        # phi's gradient per thread: [n C, Mp], or where native.c's DPHI_TRANSPOSED is set,
        # transposed in the same blocks, [ceil(n C / 16), Mp, 16]
        shape = (blocks, mp, 16) if self.dphi_transposed else (n * c, mp)
        parts = torch.zeros((threads, *shape), dtype=torch.float32, device=x.device)
        # Sinkhorn's recomputed iterates and denominators for 16 tokens, per thread (torch's
        # CPU allocations are 64-byte aligned, and so is each row: a multiple of 16 floats).
        steps = 2 * iters - 1
        sk_y = torch.empty((threads, steps * (n * n + n) * 16), dtype=torch.float32)
        # The per-token part of dx for a tile of 8 tokens, in float32, per thread.
        base = torch.empty((threads, 8 * n * c), dtype=torch.float32)
        self._run("maps_bwd", x.dtype,
                  [x, phitb, ab, lt, r, g_pre, g_post, g_res, g_a, g_merge, dx, dht,
                   PerThread(parts), PerThread(sk_y), PerThread(base)], t, n, c, m, mp // 8,
                  iters, res, sk_eps, pre_eps)
        dphi = torch.empty((n * c, m), dtype=torch.float32)
        self._lib.maps_dphi_sum(parts.data_ptr(), threads, n * c, m, mp, dphi.data_ptr())
        return dx, dht, dphi

    def hc_bwd(self, x, wt, d, u, r, h_pre, h_res, g_pre, g_post, g_res, g_a, g_merge, sc):
        """The backward of HC's maps and pre-aggregation (and of the merge's H_res x when
        g_merge is given) for x [T, n, C]: dx [T, n, C] in x's dtype, gtot [T, n + n n] (the
        total gradients of H_pre, then H_res, aggregation and merge included) and dw [C, M].

        wt: W^T [M, C] float32 (M = n + 2); d = tanh(u), u [T n, M] and r [T n] from the
        forward's rows; h_pre [T, n], h_res [T, n, n] its maps; the gradients are float32
        [T, n], [T, n], [T, n, n] and x's dtype [T, C], [T, n, C], any may be None;
        sc = (s_alpha, s_beta) float32.
        """
        t, n, c = x.shape
        m = wt.shape[0]
        mp = padded_width(m)
        dx = self.blocks.empty(x.shape, x.dtype)
        gtot = torch.empty((t, n + n * n), dtype=torch.float32)
        threads = self.threads_for(t)
        dw = torch.zeros((threads, c, mp), dtype=torch.float32)
        base = torch.empty((threads, 8 * c), dtype=torch.float32)  # 8 rows of dx, in float
        self._run("hc_bwd", x.dtype,
                  [x, wt, d, u, r, h_pre, h_res, g_pre, g_post, g_res, g_a, g_merge, sc, dx,
                   gtot, PerThread(dw), PerThread(base)], t, n, c, m, mp // 8)
        dw = dw[0] if threads == 1 else dw.sum(dim=0)
        return dx, gtot, dw[:, :m].contiguous()

    def rows_fwd(self, x, wp):
        """z [R, Mp] = x @ wp and the sums of squares ss [R] of x's rows, for x [R, K]
        (fp32 or bf16) and wp [K, Mp] float32 (columns padded to padded_width)."""
        rows, k = x.shape
        z = torch.empty((rows, wp.shape[1]), dtype=torch.float32)
        ss = torch.empty((rows,), dtype=torch.float32)
        self._run("rows_fwd", x.dtype, [x, wp, z, ss], rows, k, wp.shape[1] // 8)
        return z, ss

    def rows_bwd(self, x, wt, dz, coef):
        """dx = coef[:, None] x + dz[:, :M] @ wt (x's dtype) and dw = x^T dz [K, M] float32,
        for x [R, K], wt [M, K] = W^T, dz [R, Mp] float32 zero past column M, coef [R]."""
        rows, k = x.shape
        m, mp = wt.shape[0], dz.shape[1]
        dx = self.blocks.empty(x.shape, x.dtype)
        threads = self.threads_for(rows)
        dw = torch.zeros((threads, k, mp), dtype=torch.float32)
        self._run("rows_bwd", x.dtype, [x, wt, dz, coef, dx, PerThread(dw)], rows, k, m,
                  mp // 8)
        dw = dw[0] if threads == 1 else dw.sum(dim=0)
        return dx, dw[:, :m].contiguous()


MAX_STREAMS = 8  # native.c's MAXN: per-token arrays of n (n x n) vectors
# native.c's H_res maps: mHC's Sinkhorn, then its successors' closed forms (res argument)
RES = {"mhc": 0, "mhc-lite": 1, "kromhc": 2, "mhc-static-res": 3}
MAX_MAP_LOGITS = 80  # native.c's MAX_MV 8-float vectors: phi's widest padded row


def _check_tables(phip: torch.Tensor, ab: torch.Tensor, k: int) -> None:
    """ValueError unless phip is a float32 [K, Mp] table (Mp a multiple of 8, M <= Mp <=
    MAX_MAP_LOGITS) and ab a float32 [2, M] one: the loops read Mp / 8 vectors a row into
    register tiles sized for MAX_MAP_LOGITS columns, and 2 M gate numbers."""
    m = ab.shape[-1] if ab.dim() == 2 else -1
    if (ab.dim() != 2 or ab.shape[0] != 2 or ab.dtype != torch.float32
            or phip.dim() != 2 or phip.dtype != torch.float32 or phip.shape[0] != k
            or phip.shape[1] % 8 or not m <= phip.shape[1] <= MAX_MAP_LOGITS):
        raise ValueError(
            f"the native maps expect phi's table as float32 [{k}, Mp] (Mp a multiple of 8, "
            f"M <= Mp <= {MAX_MAP_LOGITS}) and the gates as float32 [2, M], got "
            f"{phip.dtype} {tuple(phip.shape)} and {ab.dtype} {tuple(ab.shape)}")


def _check_res(res: int, n: int, m: int) -> None:
    """ValueError unless native.c's maps can take H_res map `res` with n streams and M logits
    (they size their per-token arrays for these: mHC-lite's n! permutations up to n = 4)."""
    names = {code: kind for kind, code in RES.items()}
    if res not in names:
        raise ValueError(f"res must be one of {RES} (an H_res map), got {res!r}")
    kind = names[res]
    try:  # the successors' own check of n (kromhc: a power of two) and their R
        want = n * n if kind == "mhc" else _successors.res_count(kind, n)
    except ValueError as err:
        raise ValueError(f"the native {kind} maps: {err}") from None
    if m != 2 * n + want or m > MAX_MAP_LOGITS or n > MAX_STREAMS:
        raise ValueError(f"the native {kind} maps with n = {n} expect M = 2 n + {want} "
                         f"<= {MAX_MAP_LOGITS} logits, got M = {m}")


def supports(x: torch.Tensor) -> bool:
    """Whether the native loops handle streams x [..., n, C]: CPU, float32 or bfloat16
    storage (the maps are float32), n <= MAX_STREAMS."""
    return (x.device.type == "cpu" and x.dtype in _SUFFIX and x.dim() >= 2
            and x.shape[-2] <= MAX_STREAMS)


def _decode_calls_module():
    """decode_calls.c's extension module, built or found in the cache, or None (no Python
    headers, no compiler, a file that does not load even when built once more)."""
    for rebuild in (False, True):  # a verified file that does not load is built once more
        path = build_decode_calls(rebuild)
        if path is None:
            return None
        name = "torch_mhc.ops.cpu._decode_calls"  # PyInit__decode_calls
        try:
            loader = importlib.machinery.ExtensionFileLoader(name, str(path))
            spec = importlib.util.spec_from_file_location(name, path, loader=loader)
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            return module
        except Exception:  # noqa: BLE001 (ImportError, OSError, a warning made an error)
            continue
    return None


_loaded: NativeOps | None = None
_tried = False
_load_lock = threading.Lock()
_OFF = ("0", "false", "no", "off")
_hooks: list = []  # the at-fork handler, once registered (it cannot be unregistered)


def _after_fork_in_child() -> None:
    if _loaded is not None:
        _loaded.after_fork_in_child()


def _open() -> NativeOps | None:
    """Build or find the library and load it; a verified file that still fails to load
    (say, a dependency missing since it was built) is built once more."""
    path = build_library()
    if path is None:
        return None
    try:
        return NativeOps(path)
    except OSError:
        path = build_library(rebuild=True)
    try:
        return None if path is None else NativeOps(path)
    except OSError as err:
        warn_fallback(f"{path} does not load: {err}")
        return None


def load() -> NativeOps | None:
    """The native library, built or found in the cache on the first call; None if disabled
    (TORCH_MHC_NATIVE=0) or unavailable (ops.cpu then runs its pure-torch fallback, after
    one warning)."""
    global _loaded, _tried
    if _tried:
        return _loaded
    with _load_lock:
        if not _tried:
            if os.environ.get("TORCH_MHC_NATIVE", "1").strip().lower() not in _OFF:
                _loaded = _open()
                if _loaded is not None and not _hooks:
                    os.register_at_fork(after_in_child=_after_fork_in_child)
                    _hooks.append(_after_fork_in_child)
            _tried = True
    return _loaded
