"""Native CPU loops for the connection's passes over the streams (source: cpu_native.c).

Why C: these ops contract a tiny per-token n x n (or n) map with [n, C] rows, plus two
skinny matmuls with phi. In torch they become batched matmuls of 4 x 4 matrices (slow on the
CPU), several passes over [T, n, C] temporaries and a dozen small ops per Sinkhorn
iteration; a loop per token tile reads each row once, writes each result once, keeps the
per-token partial sums in vector registers, and handles bfloat16 storage (converted to fp32
in registers). cpu_native.c says what each kernel fuses; benchmarks/NOTES_ops.md has the
measurements.

The source is plain C11 with GCC/Clang vector extensions and no torch headers: the system C
compiler builds it in about a second, once per machine and source version, into a cache
directory ($TORCH_MHC_CACHE, else $XDG_CACHE_HOME/torch_mhc, else ~/.cache/torch_mhc), and
ctypes loads it. If no compiler is found or the build fails, `load()` returns None and
ops.cpu uses its pure-torch path. TORCH_MHC_NATIVE=0 disables the native path.

Calls split the tokens into torch.get_num_threads() contiguous ranges run on a thread pool
(ctypes releases the GIL during each call). Every function takes [t0, t1), the token range
to process, and contiguous tensors. Large outputs come from a BlockPool (reused memory,
capped by TORCH_MHC_CPU_POOL_MB, default 1024 MiB; 0 turns it off).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import mmap
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

_SOURCE_PATH = Path(__file__).with_name("cpu_native.c")


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
    source = _SOURCE_PATH.read_text()
    key = hashlib.sha256(
        "\n".join([source, compiler, " ".join(_FLAGS), _cpu_signature()]).encode()
    ).hexdigest()[:16]
    cache = _cache_dir()
    lib = cache / f"torch_mhc_cpu_{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src = Path(tmp) / "torch_mhc_cpu.c"
        src.write_text(source)
        out = Path(tmp) / lib.name
        proc = subprocess.run([compiler, *_FLAGS, str(src), "-o", str(out)],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{proc.stderr[-2000:]}")
        os.replace(out, lib)  # atomic: concurrent builders each publish a complete file
    return lib


class BlockPool:
    """Reusable page-aligned memory for the kernels' large outputs ([T, n, C] and [T, C]).

    Why: glibc hands large blocks back to the system when they are freed, so every fresh
    output of a training step is faulted in and zeroed by the kernel again, which cost about
    as much as the merge itself (benchmarks/NOTES_ops.md). The pool keeps the anonymous
    mappings it made and hands a block out again once no tensor uses it: a tensor made by
    torch.frombuffer holds a reference to its block, so a block whose reference count is
    back to the pool's own is free. Blocks are kept up to `cap_bytes` in all (in use or
    not); beyond that, and below `min_bytes`, outputs are ordinary torch.empty tensors.
    TORCH_MHC_CPU_POOL_MB sets the cap (default 1024; 0 turns the pool off).
    """

    def __init__(self, cap_bytes: int, min_bytes: int = 1 << 20):
        self.cap_bytes, self.min_bytes = cap_bytes, min_bytes
        self.held = 0  # bytes of all blocks made, in use or not
        self._blocks: dict[int, list[mmap.mmap]] = {}
        # A free block's reference count as `empty`'s scan sees it (list, loop variable,
        # getrefcount's argument), measured on a probe in a loop of the same shape.
        probe = [mmap.mmap(-1, mmap.PAGESIZE)]
        for block in probe:
            self._free_refs = sys.getrefcount(block)
        probe[0].close()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor: a free pooled block, a new one, or torch.empty."""
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if nbytes < self.min_bytes or self.cap_bytes <= 0:
            return torch.empty(shape, dtype=dtype)
        blocks = self._blocks.setdefault(nbytes, [])
        for block in blocks:
            if sys.getrefcount(block) <= self._free_refs:  # no tensor holds it
                return torch.frombuffer(block, dtype=dtype, count=numel).view(shape)
        if self.held + nbytes > self.cap_bytes:
            return torch.empty(shape, dtype=dtype)
        blocks.append(mmap.mmap(-1, nbytes))
        self.held += nbytes
        return torch.frombuffer(blocks[-1], dtype=dtype, count=numel).view(shape)


def _pool_cap() -> int:
    text = os.environ.get("TORCH_MHC_CPU_POOL_MB", "1024").strip()
    try:
        return int(float(text) * (1 << 20))
    except ValueError:
        raise ValueError(f"TORCH_MHC_CPU_POOL_MB must be a number of MiB, got {text!r}") from None


_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
# Argument types after the pointers, t0 and t1 (cpu_native.c's entry points).
_SIGNATURES = {
    "merge_fwd": (5, [_I, _I]),  # n, C
    "merge_bwd": (9, [_I, _I]),
    "pre_fwd": (3, [_I, _I]),
    "pre_bwd": (5, [_I, _I]),
    "maps_fwd": (9, [_I, _I, _I, _I, _I, _D, _D, _D]),  # n, C, M, MV, iters, 3 epsilons
    "maps_bwd": (15, [_I, _I, _I, _I, _I, _D, _D]),  # n, C, M, MV, iters, sk_eps, pre_eps
    "rows_fwd": (4, [_I, _I]),  # K, MV
    "rows_bwd": (6, [_I, _I, _I]),  # K, M, MV
}


class PerThread:
    """A [threads, ...] buffer: each thread of a call gets its own slice (partial sums)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def padded_width(m: int) -> int:
    """Columns of phi padded to whole 8-float vectors (the skinny matmuls' register tiles)."""
    return -(-m // 8) * 8


class NativeOps:
    """The loaded library; each method runs one op over all tokens on the thread pool."""

    def __init__(self, path: Path):
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        for name, (n_ptrs, sizes) in _SIGNATURES.items():
            for suffix in _SUFFIX.values():
                fn = getattr(self._lib, f"{name}_{suffix}")
                fn.argtypes = [_P] * n_ptrs + [_I, _I] + sizes
                fn.restype = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self.blocks = BlockPool(_pool_cap())

    def threads_for(self, tokens: int) -> int:
        """How many threads a call over `tokens` tokens uses."""
        return max(1, min(torch.get_num_threads(), tokens // _MIN_TOKENS_PER_THREAD))

    def _run(self, name: str, dtype: torch.dtype, tensors: list, tokens: int, *sizes):
        """Call name_<dtype>(pointers..., t0, t1, *sizes) over [0, tokens) on the pool.

        A None among tensors passes NULL (an optional operand); a PerThread passes thread
        k the address of its slice k.
        """
        fn = getattr(self._lib, f"{name}_{_SUFFIX[dtype]}")
        threads = self.threads_for(tokens)

        def pointers(k):
            return [None if t is None else
                    t.tensor[k].data_ptr() if isinstance(t, PerThread) else t.data_ptr()
                    for t in tensors]

        if threads == 1:
            fn(*pointers(0), 0, tokens, *sizes)
            return
        if self._pool is None or self._pool_size != threads:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="torch_mhc")
            self._pool_size = threads
        bounds = [tokens * k // threads for k in range(threads + 1)]
        futures = [self._pool.submit(fn, *pointers(k), bounds[k], bounds[k + 1], *sizes)
                   for k in range(threads)]
        for fut in futures:
            fut.result()

    def merge_fwd(self, x, f, h_post, h_res):
        """H_res x + H_post^T f for x [T, n, C], f [T, C], h_post [T, n], h_res [T, n, n]."""
        t, n, c = x.shape
        out = self.blocks.empty(x.shape, x.dtype)
        self._run("merge_fwd", x.dtype, [x, f, h_post, h_res, out], t, n, c)
        return out

    def merge_bwd(self, x, f, h_post, h_res, g, linked=False):
        """(dx, df, dh_post, dh_res) for the merge's upstream gradient g; linked=True leaves
        dx and dh_res to the maps' backward (None here) and does not read x."""
        t, n, c = x.shape
        dx = None if linked else self.blocks.empty(x.shape, x.dtype)
        df = self.blocks.empty(f.shape, f.dtype)
        dh_post = torch.empty_like(h_post)
        dh_res = None if linked else torch.empty_like(h_res)
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

    def maps_fwd(self, x, phip, ab, iters, norm_eps, sk_eps, pre_eps, with_pre):
        """The mHC maps of x [T, n, C] (and the pre-aggregation when with_pre).

        phip: phi [n*C, M] in float32 with columns zero-padded to padded_width(M); ab: [2, M]
        float32, the gate per logit row and the static biases. Returns lt [T, M] (logits
        after the RMS division), r [T], H_pre [T, n], H_post [T, n], H_res [T, n, n] and
        a [T, C] in x's dtype (None without with_pre).
        """
        t, n, c = x.shape
        m = ab.shape[1]
        f32 = dict(dtype=torch.float32, device=x.device)
        lt, r = torch.empty((t, m), **f32), torch.empty((t,), **f32)
        h_pre, h_post = torch.empty((t, n), **f32), torch.empty((t, n), **f32)
        h_res = torch.empty((t, n, n), **f32)
        a = self.blocks.empty((t, c), x.dtype) if with_pre else None
        self._run("maps_fwd", x.dtype, [x, phip, ab, lt, r, h_pre, h_post, h_res, a], t,
                  n, c, m, phip.shape[1] // 8, iters, norm_eps, sk_eps, pre_eps)
        return lt, r, h_pre, h_post, h_res, a

    def maps_bwd(self, x, phit, ab, lt, r, g_pre, g_post, g_res, g_a, g_link, iters, sk_eps,
                 pre_eps):
        """dx [T, n, C] (x's dtype), dh~ [T, M] and dphi [n*C, M] of the maps (and of the
        aggregation when g_a is given; of the merge's H_res x when g_link is given).

        phit: phi^T [M, n*C] float32; the gradients are float32 [T, n], [T, n], [T, n, n]
        and x's dtype [T, C], [T, n, C]; any may be None.
        """
        t, n, c = x.shape
        m = ab.shape[1]
        mp = padded_width(m)
        dx = self.blocks.empty(x.shape, x.dtype)
        dht = torch.empty((t, m), dtype=torch.float32, device=x.device)
        threads = self.threads_for(t)
        dphi = torch.zeros((threads, n * c, mp), dtype=torch.float32, device=x.device)
        # Sinkhorn's recomputed iterates and denominators for 16 tokens, per thread (torch's
        # CPU allocations are 64-byte aligned, and so is each row: a multiple of 16 floats).
        steps = 2 * iters - 1
        sk_y = torch.empty((threads, steps * (n * n + n) * 16), dtype=torch.float32)
        # The per-token part of dx for a tile of 8 tokens, in float32, per thread.
        base = torch.empty((threads, 8 * n * c), dtype=torch.float32)
        self._run("maps_bwd", x.dtype,
                  [x, phit, ab, lt, r, g_pre, g_post, g_res, g_a, g_link, dx, dht,
                   PerThread(dphi), PerThread(sk_y), PerThread(base)], t, n, c, m, mp // 8,
                  iters, sk_eps, pre_eps)
        dphi = dphi[0] if dphi.shape[0] == 1 else dphi.sum(dim=0)
        return dx, dht, dphi[:, :m].contiguous()

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


MAX_STREAMS = 8  # cpu_native.c's MAXN: per-token arrays of n (n x n) vectors


def supports(x: torch.Tensor) -> bool:
    """Whether the native loops handle streams x [..., n, C]: CPU, float32 or bfloat16
    storage (the maps are float32), n <= MAX_STREAMS."""
    return (x.device.type == "cpu" and x.dtype in _SUFFIX and x.dim() >= 2
            and x.shape[-2] <= MAX_STREAMS)


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
