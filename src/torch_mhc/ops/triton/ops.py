"""The `triton` implementation: Triton kernels registered as torch.library custom ops.

Each op and its backward are custom ops (namespace `torch_mhc`) with fake implementations,
so torch.compile(fullgraph=True) traces through them and CUDA graphs capture them:

    torch_mhc::mhc_maps_fwd / mhc_maps_bwd          (a) maps, Sinkhorn fused in
    torch_mhc::pre_aggregate_fwd / pre_aggregate_bwd (b)
    torch_mhc::post_merge_fwd / post_merge_bwd       (c) reads (n+1)C, writes nC per token
    torch_mhc::sinkhorn_fwd / sinkhorn_bwd           (d)
    torch_mhc::variant_maps_fwd / variant_maps_bwd   (e) mHC's successors' maps: (a)'s matmul
                                                     kernels, the kind's H_res in Sinkhorn's place
    torch_mhc::mhc_maps_pre_bwd                      (f) backwards with fused_dx: (a) and (b)'s
    torch_mhc::post_merge_bwd_no_dx                      with x's whole gradient, (c)'s without

The public functions below have the contracts of functional.maps (same shapes, maps in
float32, aggregation and merge in the streams' dtype) and flatten the leading dimensions
into T tokens. The kernels compute in float32 whatever the storage dtype (fp32, fp16, bf16):
H_pre and H_post are not rounded to the streams' dtype as the reference's matmuls round
them.

TF32, deliberately: the map kernels' matmuls are "ieee" (exact fp32, FMA units) for fp32
streams, whose reference is fp32. For fp16/bf16 streams they run on tensor cores, where a
tf32 mma reads the top 10 mantissa bits of each fp32 register: it truncates. x is exact in
TF32 (fp16 and bf16 fit). The forward's phi: exact too when fp16/bf16; when fp32 (autocast,
mixed precision) the forward uses tf32x3 (`_fwd_precision`), so the logits are fp32-accurate:
alpha's gradient, a sum over tokens with cancellation, exceeded the GPU tolerance even with
phi rounded to nearest (2.5e-3 of max|reference| at one of 40 emulated cases), and by more
when truncated. The backward's dots (dx = dz phi^T, dphi = x^T dz) are single tf32 with every
operand rounded to nearest first: phi on the host (`tf32_operand`), dz in the kernel by
cvt.rna.tf32.f32, stored rounded for the dx and dphi kernels. Emulated on the CPU over 20 seeds
(tests/ops/test_triton.py, test_tf32_rounding_stays_within_the_gpu_tolerance), x's and phi's
gradients differ from the fp32 reference by at most about 5e-4 of their max|reference| (the
GPU tests allow 2e-3 for phi, 1.6e-2 for bf16 x; truncating gave 1.2e-3 in x's gradient);
maps and the other gradients are as fp32. The ahead-of-time check (ops/triton/aot.py)
asserts that fp32 launches contain no tf32 mma and that the backward rounds (cvt.rna) before
its tf32 mma.

The maps run as matmul kernels over token blocks x splits of K (K = n*C) and per-token
kernels (RMS, gates, Sinkhorn); the plans choose the token blocks and splits from T and n
(`token_block`, `k_splits`; ops/triton/kernels.py (a) says why). Under torch.autocast the
maps op casts x and phi to the autocast dtype (`_register_maps_autocast`).

The kernels need CUDA tensors, or CPU tensors when triton.kernels was imported with
TRITON_INTERPRET=1 (Triton's interpreter; how the tests run without a GPU).

Each custom op builds its launches with a `plan_*` function (outputs, grid, arguments,
constexprs and compile options from `kernel_config`) and runs them; ops/triton/aot.py calls
the same plans on meta tensors to compile every launch ahead of time for sm_80 / sm_90 and
check registers and spills, so the check and the launcher cannot drift apart. A kernel that
fails to compile or launch raises a RuntimeError naming the kernel, the op, the input shapes
and dtypes, and the other implementations to select.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from torch_mhc.functional import maps as _ref
from torch_mhc.functional import successors as _succ
from torch_mhc.functional.sinkhorn import LINEAR_RANGE
from torch_mhc.ops.checks import (
    ImplUnavailableError,
    check_hc_scalars,
    check_maps_scalars,
    check_mhc_shapes,
    check_sinkhorn_scalars,
    first_derivatives_only,
)
from torch_mhc.ops.triton import kernels as _k

__all__ = ["FUSED_DX", "Launch", "PLANS", "hc_maps", "hc_maps_pre", "interpreted", "mhc_maps",
           "mhc_maps_pre", "post_merge", "pre_aggregate",
           "sinkhorn", "variant_maps", "variant_maps_pre"]


def hc_maps(x, w, s_alpha, s_beta, static_pre, static_post, static_res, norm_eps=1e-6):
    """HC's maps stay in torch (functional.maps); its aggregation and merge use the kernels."""
    check_hc_scalars("hc_maps", norm_eps)
    return _ref.hc_maps(x, w, s_alpha, s_beta, static_pre, static_post, static_res, norm_eps)


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_F32 = torch.float32
_first_order = first_derivatives_only("triton")  # the kernels' backwards (checks.py)


# Decided when triton.kernels was imported; a constant, so torch.compile never traces a
# check on the kernel objects themselves.
_INTERPRETED = not isinstance(_k.merge_fwd_kernel, triton.runtime.jit.JITFunction)


def interpreted() -> bool:
    """True when the kernels run in Triton's interpreter (CPU tensors allowed)."""
    return _INTERPRETED


def _padded(n: int) -> int:
    """Streams padded to a power of two >= 4 (tl.dot needs tiles of 16 = 4 x 4 columns)."""
    return max(4, triton.next_power_of_2(n))


def _pp_width(n: int) -> int:
    """Width of the map kernels' pre/post tile: the 2n columns, at least tl.dot's 16."""
    return max(16, triton.next_power_of_2(2 * n))


def _res_width(n: int, res: int | None = None) -> int:
    """Width of the map kernels' res tile: mHC's NP*NP (res None), or a successor's res logits
    (res of them, kernels.py (e)) at least tl.dot's 16."""
    return _padded(n) ** 2 if res is None else max(16, triton.next_power_of_2(max(1, res)))


def _tile_class(n: int, res: int | None = None) -> int:
    """The padded stream count whose mHC tiles (NP*NP + PW columns) are the narrowest at least
    as wide as these: the matmul kernels' launch parameters were chosen per mHC's NP
    (kernel_config), and a successor's tiles take those of the next wider mHC's."""
    if res is None:
        return _padded(n)
    cols = _res_width(n, res) + _pp_width(n)
    return next(c for c in (4, 8, 16, 32) if c * c + _pp_width(c) >= cols)


def _precision(dtype: torch.dtype) -> str:
    """The map kernels' tl.dot precision for streams of `dtype` (module docstring: TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _fwd_precision(dtype: torch.dtype, phi_dtype: torch.dtype) -> str:
    """The forward's: tf32x3 (phi split in two TF32 parts; x is exact in TF32) for fp32 phi
    beside half streams, so that the logits, which every map and alpha's gradient (a sum with
    cancellation over tokens) take, are as fp32."""
    if _precision(dtype) == "tf32" and phi_dtype == _F32:
        return "tf32x3"
    return _precision(dtype)


def round_tf32(t: Tensor) -> Tensor:
    """fp32 t rounded to TF32 (10 mantissa bits), to nearest with ties away from zero as PTX's
    cvt.rna.tf32.f32; infinities and NaN unchanged."""
    bits = t.contiguous().view(torch.int32)
    rounded = ((bits + 0x1000) & -0x2000).view(torch.float32)
    return torch.where(torch.isfinite(t), rounded, t)


def tf32_operand(phi: Tensor, stream_dtype: torch.dtype) -> Tensor:
    """phi as the map kernels read it: rounded to TF32 where their dots run in TF32 (half
    streams) and phi is fp32 (autocast, mixed precision), as tf32 mma truncates what it gets."""
    if _precision(stream_dtype) == "tf32" and phi.dtype == _F32:
        return round_tf32(phi)
    return phi


def _device(t: Tensor):
    """Launch on t's GPU (Triton uses the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@dataclass(frozen=True)
class Launch:
    """One kernel launch, exactly as a custom op runs it (tests/ops/test_triton_aot.py compiles
    these ahead of time, so launcher and check cannot drift apart)."""

    kernel: object  # a triton JITFunction (an interpreted function under TRITON_INTERPRET=1)
    grid: tuple[int, ...]
    args: tuple  # tensors and scalars, in the kernel's argument order
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 3
    maxnreg: int | None = None  # ptxas register cap (None: ptxas decides)
    # Multiply-adds contracted to FMAs (one rounding each), as the tolerances of the tests were
    # measured with; passed explicitly so that Triton's default (an environment variable,
    # TRITON_DEFAULT_FP_FUSION, whose unset value changes in Triton 3.10) cannot change the
    # compiled code between installs. The interpreter ignores it (numpy rounds each step).
    enable_fp_fusion: bool = True
    # Tensors the launch's programs read more than once between them, as (argument index,
    # times): phi read once per token block, dz once per K block (the bytes model,
    # ops/triton/traffic.py); dx twice where mhc_dx_kernel adds to it (read, then written).
    # Every other tensor argument is read or written once.
    reads: tuple[tuple[int, int], ...] = ()

    @property
    def name(self) -> str:
        return getattr(self.kernel, "__name__", None) or self.kernel.fn.__name__

    @property
    def options(self) -> dict:
        """The compile options, as keyword arguments of a launch."""
        extra = {} if self.maxnreg is None else {"maxnreg": self.maxnreg}
        return dict(num_warps=self.num_warps, num_stages=self.num_stages,
                    enable_fp_fusion=self.enable_fp_fusion, **extra)

    def run(self) -> None:
        if 0 in self.grid:  # no tokens (an empty batch): nothing to launch
            return
        self.kernel[self.grid](*self.args, **self.constexprs, **self.options)


_ENV_VAR = "TORCH_MHC_IMPL"


def _run(op: str, launches: list[Launch], *inputs: Tensor) -> None:
    """Run the launches on the inputs' device; a failure names op, shapes, dtype and the way out."""
    with _device(inputs[0]):
        for launch in launches:
            try:
                launch.run()
            except Exception as err:  # compile errors, ptxas errors, launch failures alike
                raise launch_failed(op, launch, inputs, err) from err


def launch_failed(op: str, launch, inputs, err: Exception) -> RuntimeError:
    """The error of a launch of op (a Launch, or what has its name, constexprs and
    num_warps) that raised err: the kernel, the inputs' shapes and dtypes, and the other
    implementations to select."""
    shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in inputs)
    return RuntimeError(
        f"triton kernel {launch.name} of op {op} failed for inputs {shapes} "
        f"(constexprs {launch.constexprs}, num_warps {launch.num_warps}): "
        f"{type(err).__name__}: {err}. Select another implementation with "
        f"impl='inductor', 'cpu' or 'reference' (or {_ENV_VAR}=inductor)"
    )


# Shared memory one block may use (bytes: the opt-in maximum per block) by compute capability:
# A100 (sm_80) 163 KiB, consumer Ampere and Ada (sm_86, sm_89) 99 KiB, H100/H200 (sm_90)
# 227 KiB. Without a device to ask (meta tensors, the interpreter) the plans assume the smallest.
SMEM_PER_BLOCK = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
SMEM_DEFAULT = min(SMEM_PER_BLOCK.values())


@functools.cache
def _device_smem(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    if optin:
        return int(optin)
    cc = props.major * 10 + props.minor
    if cc in SMEM_PER_BLOCK:
        return SMEM_PER_BLOCK[cc]
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def smem_limit(device: torch.device) -> int:
    """Shared memory per block on `device` (asked once per GPU); SMEM_DEFAULT off a GPU."""
    if device.type != "cuda":
        return SMEM_DEFAULT
    return _device_smem(device.index if device.index is not None else torch.cuda.current_device())


def maps_smem(kernel: str, n: int, block_t: int, block_k: int, num_stages: int,
              x_bytes: int, phi_bytes: int, res: int | None = None) -> int:
    """An upper estimate of the shared memory of a matmul kernel of the maps (bytes), fitted to
    what the compiled kernels use (ops/triton/aot.py): num_stages - 1 buffers of each pipelined
    tile (phi's [BLOCK_K, NP*NP + PW] columns and x's [BLOCK_T, BLOCK_K]), one more x tile of
    slack, dx's dz operand [BLOCK_T, NP*NP + PW] (fp32), dphi's [BLOCK_K, NP*NP] result.
    kernel: xphi, dx or dphi; res: a successor's res logits (None: mHC's, NP*NP of them)."""
    cols = _res_width(n, res) + _pp_width(n)
    bufs = max(1, num_stages - 1)
    x_tile = block_t * block_k * x_bytes
    if kernel == "dphi":
        return max(bufs * (x_tile + block_t * cols * 4), block_k * _res_width(n, res) * 4) + x_tile
    est = bufs * (block_k * cols * phi_bytes + x_tile) + x_tile
    return est + (block_t * cols * 4 if kernel == "dx" else 0)


def _fit_smem(kernel: str, n: int, cfg: dict, x_bytes: int, phi_bytes: int, limit: int,
              res: int | None = None) -> dict:
    """cfg with BLOCK_K and num_stages lowered until maps_smem fits in `limit` (fewer stages
    before a K tile under 32: a shorter K step costs more than one less load in flight)."""
    bk = cfg["BLOCK_K"]
    tries = [(bk, 3), (bk // 2, 3), (bk // 2, 2), (bk // 4, 3), (bk // 4, 2), (16, 1)]
    for block_k, stages in tries:
        if block_k < 16:
            continue
        if maps_smem(kernel, n, cfg["BLOCK_T"], block_k, stages, x_bytes, phi_bytes,
                     res) <= limit:
            return {**cfg, "BLOCK_K": block_k, "num_stages": stages}
    return {**cfg, "BLOCK_K": 16, "num_stages": 1}  # the ahead-of-time check reports it


def kernel_config(kernel: str, n: int, dtype: torch.dtype, param_dtype: torch.dtype | None = None,
                  smem: int = SMEM_DEFAULT, res: int | None = None) -> dict:
    """Launch parameters of one kernel for n streams of `dtype` and parameters (phi) of
    `param_dtype` (default: dtype; fp32 under autocast or mixed precision) on a GPU giving a
    block `smem` bytes of shared memory: chosen with the ahead-of-time compile check
    (ops/triton/aot.py, table in benchmarks/README.md) so that no kernel spills or needs more
    shared memory than sm_80, sm_86/89 and sm_90 give, and registers stay below 255.

    kernel: xphi, dx, dphi (the maps' matmuls: BLOCK_T, BLOCK_K); maps_fwd, maps_bwd (the maps'
    per-token work, Sinkhorn included), sinkhorn_fwd, sinkhorn_bwd (BLOCK_T); pre_fwd,
    pre_bwd, merge_fwd, merge_dx, merge_dh (TILE: elements per [BLOCK_T, NP, BLOCK_C] tile);
    variant_fwd, variant_bwd (a successor's per-token maps: BLOCK_T); each also num_warps,
    num_stages and maxnreg (None: no register cap). res: a successor's res logits (R; None:
    mHC), whose matmul tiles take the launch parameters of mHC's next wider ones
    (_tile_class).
    """
    np_ = _tile_class(n, res) if kernel in ("xphi", "dx", "dphi") else _padded(n)
    fp32 = dtype == torch.float32
    # maxnreg: an explicit register cap. Without one, ptxas sometimes aims at a low register
    # count and spills a few bytes (seen at 64-128 registers); with one it also uses more
    # registers where it could do with fewer, so caps are set only where the check needs them.
    if kernel in ("xphi", "dx", "dphi"):
        # xphi and dx hold no Sinkhorn, so their token blocks are as large as registers allow
        # (phi is read once per token block: ops/triton/traffic.py). fp32 streams: ieee dots
        # run on FMA units with the whole tile in registers; n > 8 holds [BLOCK_T, 288]-wide
        # tiles, so fewer tokens per program.
        # tf32x3 (fp32 phi beside half streams) splits phi's tile in two: fewer tokens. These
        # are the largest token blocks that compile without spills (ops/triton/aot.py).
        # n > 8 with half streams: xphi's [BLOCK_T, 288] tensor-core accumulator spills on
        # sm_80 and sm_86 past 16 tokens (64 tokens at 16 warps fit sm_90 only).
        cap = {"xphi": True, "dx": np_ >= 8, "dphi": np_ >= 8}[kernel]
        # The full matrix of the check (every n, target and dtype pair) found spills in xphi
        # with 64-wide K tiles in tf32x3 (up to 700 bytes at n = 5 and 8 on sm_80, a few at
        # n = 2): 32-wide tiles there; and with fp32 streams at n = 3 on sm_90 (24 bytes with
        # 64 tokens): 32 tokens. The successors' tiles (res given): with fp32 streams xphi
        # spilled a few bytes at 64 tokens on sm_90 (KromHC, n = 2 and 8), and mHC-lite's dx
        # at n = 5 (the only one in the n > 8 class, 144 columns) 276 bytes on sm_86: 32
        # tokens; its xphi spilled 416 bytes at 16 tokens in tf32x3 on sm_80 and none at 32.
        x3 = kernel == "xphi" and _fwd_precision(dtype, param_dtype or dtype) == "tf32x3"
        if fp32:
            narrow = kernel == "xphi" and n == 3
            if res is not None:
                narrow = kernel == "xphi" or np_ >= 16
            block_t = 32 if np_ == 8 or narrow else 64
        elif np_ >= 16:
            block_t = (16 if res is None else 32) if kernel == "xphi" else 64
        else:
            block_t = 64 if x3 else 128
        cfg = dict(BLOCK_T=block_t if kernel != "dphi" else (32 if np_ <= 8 else 16),
                   BLOCK_K=32 if ((np_ >= 16 and (fp32 or kernel == "xphi"))
                                  or x3) else 64,
                   num_warps=8 if (np_ >= 8 or fp32) else 4, num_stages=3,
                   maxnreg=255 if cap else None)
        # Shared memory grows with phi's element size: fp32 phi beside half streams (autocast)
        # doubles phi's pipelined tiles.
        return _fit_smem(kernel, n, cfg, dtype.itemsize, (param_dtype or dtype).itemsize, smem,
                         res)
    if kernel in ("maps_fwd", "maps_bwd"):
        return dict(BLOCK_T=32 if np_ <= 8 else 16, num_warps=4 if np_ <= 4 else 8, num_stages=3,
                    maxnreg=255 if (kernel == "maps_bwd" and np_ >= 16) else None)
    if kernel in ("variant_fwd", "variant_bwd"):
        # float64 tiles: H_res [BLOCK_T, NP*NP] and the weights [BLOCK_T, RW] (mHC-lite at
        # n = 5: 128 wide). mHC-lite at n = 4 (32 weights) spilled 8 bytes in the forward
        # with 4 warps on sm_86, and 4 bytes in the backward with 8 on sm_90.
        wide = np_ >= 16 or _res_width(n, res or 0) >= 128
        few = np_ <= 4 and (_res_width(n, res or 0) <= 16 or kernel == "variant_bwd")
        return dict(BLOCK_T=16 if wide else 32, num_warps=4 if few and not wide else 8,
                    num_stages=3, maxnreg=None)
    if kernel in ("sinkhorn_fwd", "sinkhorn_bwd"):
        return dict(BLOCK_T=32 if np_ <= 8 else 16, num_warps=4 if np_ <= 4 else 8, num_stages=3,
                    maxnreg=255 if (kernel == "sinkhorn_bwd" and np_ >= 16) else None)
    if kernel in ("pre_fwd", "pre_bwd", "merge_fwd", "merge_dx"):
        return dict(TILE=2048, num_warps=4, num_stages=3, maxnreg=None)
    if kernel == "merge_dh":  # spilled 4-8 bytes at 48-72 registers uncapped
        return dict(TILE=2048, num_warps=4, num_stages=3, maxnreg=128)
    raise ValueError(f"unknown kernel {kernel!r}")


def _opts(cfg: dict) -> dict:
    """The compile options of a kernel_config entry, as Launch fields."""
    return dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], maxnreg=cfg["maxnreg"])


def _channel_blocks(n: int, c: int, tile: int = 2048) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_C) for the streaming kernels: about `tile` elements per [T, NP, C] tile."""
    np_ = triton.next_power_of_2(n)
    block_c = min(256, triton.next_power_of_2(c), max(32, tile // np_))
    return max(1, tile // (np_ * block_c)), block_c


def check_tensors(name: str, *tensors: Tensor) -> None:
    """TypeError unless each tensor is fp32, fp16 or bf16; RuntimeError unless on a GPU (or the
    interpreter runs the kernels)."""
    for t in tensors:
        if t.dtype not in DTYPES:
            raise TypeError(
                f"triton {name} supports float32, float16 and bfloat16 tensors, got {t.dtype}; "
                "use impl='cpu' or 'reference' for other dtypes"
            )
        if t.device.type not in ("cuda", "meta") and not _INTERPRETED:
            raise ImplUnavailableError(
                f"triton {name} needs CUDA tensors, got a tensor on {t.device}; use impl='cpu', "
                "or set TRITON_INTERPRET=1 before torch_mhc.ops.triton.kernels is imported "
                "to run the kernels in Triton's interpreter"
            )


# ---------------------------------------------------------------------------------------------
# (a) mHC maps
# ---------------------------------------------------------------------------------------------


# Splitting K (the maps' matmul kernels, ops/triton/kernels.py (a)): programs aimed at, about
# two per SM of the largest GPUs (H100/H200: 132 SMs), so that few tokens (decoding, small
# batches) still spread over the GPU; at least _MIN_K_TILES BLOCK_K steps per split, below
# which a split's partial sums cost more than its share of the matmul; at most _MAX_SPLITS
# partial sums per token for the forward's finishing kernel to add.
_PROGRAMS = 256
_MIN_K_TILES = 4
_MAX_SPLITS = 128
_SPLIT_UNROLL = 4  # partial sums the finishing kernel loads per step


def token_block(t: int, block_t: int) -> int:
    """The matmul kernels' BLOCK_T for T tokens: block_t, or fewer for few tokens (at least
    tl.dot's 16), so that a decoding step computes no masked rows it could avoid."""
    return min(block_t, max(16, triton.next_power_of_2(max(1, t))))


def k_splits(k: int, token_blocks: int, block_k: int) -> tuple[int, int]:
    """(splits, K per split, a multiple of block_k) for a matmul over K run by token_blocks
    blocks: enough splits that the grid has about _PROGRAMS programs, within the bounds above."""
    tiles = triton.cdiv(k, block_k)
    want = triton.cdiv(_PROGRAMS, max(1, token_blocks))
    splits = max(1, min(want, tiles // _MIN_K_TILES, _MAX_SPLITS))
    per_split = triton.cdiv(tiles, splits) * block_k
    return triton.cdiv(k, per_split), per_split


def plan_maps_fwd(x, phi, alpha, b_pre, b_post, b_res, iters, norm_eps, sk_eps, pre_eps,
                  smem=None):
    """Outputs and launches of mhc_maps_fwd (any device, meta included: nothing runs); smem:
    the target's shared memory per block (default: that of x's GPU). Two launches: the
    partial x @ phi over token blocks x K splits, then the per-token finish."""
    t, n, c = x.shape
    k, m = n * c, n * n + 2 * n
    h_pre, h_post = x.new_empty((t, n), dtype=_F32), x.new_empty((t, n), dtype=_F32)
    h_res = x.new_empty((t, n, n), dtype=_F32)
    logits, r = x.new_empty((t, m), dtype=_F32), x.new_empty((t,), dtype=_F32)
    cfg = kernel_config("xphi", n, x.dtype, phi.dtype, smem or smem_limit(x.device))
    fcfg = kernel_config("maps_fwd", n, x.dtype)
    block_t = token_block(t, cfg["BLOCK_T"])
    blocks = triton.cdiv(t, block_t)
    splits, per_split = k_splits(k, blocks, cfg["BLOCK_K"])
    parts = x.new_empty((t, splits, m), dtype=_F32)  # partial x @ phi per split
    ss = x.new_empty((t, splits), dtype=_F32)  # partial sums of squares
    shape = dict(N=n, NP=_padded(n), PW=_pp_width(n))
    launches = [
        Launch(_k.mhc_xphi_kernel, (blocks, splits), (x, phi, parts, ss, t, k, per_split),
               dict(**shape, BLOCK_T=block_t, BLOCK_K=cfg["BLOCK_K"],
                    PRECISION=_fwd_precision(x.dtype, phi.dtype)),
               **_opts(cfg), reads=((1, blocks),)),
        Launch(_k.mhc_maps_fwd_kernel, (triton.cdiv(t, fcfg["BLOCK_T"]),),
               (parts, ss, alpha, b_pre, b_post, b_res, h_pre, h_post, h_res, logits, r, t, k,
                splits, norm_eps, sk_eps, pre_eps, LINEAR_RANGE),
               dict(**shape, ITERS=iters, LOG_OK=sk_eps == 0.0, BLOCK_T=fcfg["BLOCK_T"],
                    UNROLL=_SPLIT_UNROLL),
               **_opts(fcfg)),
    ]
    return launches, (h_pre, h_post, h_res, logits, r)


@torch.library.custom_op("torch_mhc::mhc_maps_fwd", mutates_args=())
def _maps_fwd(
    x: Tensor, phi: Tensor, alpha: Tensor, b_pre: Tensor, b_post: Tensor, b_res: Tensor,
    iters: int, norm_eps: float, sk_eps: float, pre_eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [T, n, C] -> H_pre, H_post [T, n], H_res [T, n, n], logits [T, M], r [T] (fp32)."""
    launches, out = plan_maps_fwd(x, phi, alpha, b_pre, b_post, b_res, iters, norm_eps, sk_eps,
                                  pre_eps)
    _run("mhc_maps (forward)", launches, x, phi)
    return out


@_maps_fwd.register_fake
def _(x, phi, alpha, b_pre, b_post, b_res, iters, norm_eps, sk_eps, pre_eps):
    t, n, _ = x.shape
    return (
        x.new_empty((t, n), dtype=_F32), x.new_empty((t, n), dtype=_F32),
        x.new_empty((t, n, n), dtype=_F32),
        x.new_empty((t, n * n + 2 * n), dtype=_F32), x.new_empty((t,), dtype=_F32),
    )


def plan_maps_bwd(x, phi, alpha, b_pre, b_post, b_res, logits, r, g_pre, g_post, g_res, iters,
                  sk_eps, smem=None, fused: tuple | None = None):
    """Launches of mhc_maps_bwd and its buffers (dx, dgate, dphi parts): the per-token
    gradients (Sinkhorn's backward, dz), dx over token blocks x K splits, dphi. fused:
    (h_pre, h_res, g, da), whose shares of x's gradient dx then holds too: merge_dx_kernel
    writes H_res^T g + H_pre da first, mhc_dx_kernel adds the maps' share in place."""
    t, n, c = x.shape
    k, m, np_ = n * c, n * n + 2 * n, _padded(n)
    gcfg = kernel_config("maps_bwd", n, x.dtype)
    dgate = x.new_empty((t, m), dtype=_F32)
    dz = x.new_empty((t, m), dtype=_F32)
    coef = x.new_empty((t,), dtype=_F32)  # r's share of dx: coef * x
    scratch = x.new_empty((t, 2 * iters, np_), dtype=_F32)  # Sinkhorn's normalisers
    shape = dict(N=n, NP=np_, PW=_pp_width(n))
    precision = _precision(x.dtype)
    head, dx = ([], None) if fused is None else _plan_merge_share(x, *fused)
    tail, dx, dphi_parts = _plan_dx_dphi(x, phi, dz, coef, shape, smem, dx=dx)
    launches = [*head,
        Launch(_k.mhc_maps_bwd_kernel, (triton.cdiv(t, gcfg["BLOCK_T"]),),
               (alpha, b_pre, b_post, b_res, logits, r, g_pre, g_post, g_res, dgate, dz, coef,
                scratch, t, k, sk_eps, LINEAR_RANGE),
               dict(**shape, ITERS=iters, LOG_OK=sk_eps == 0.0, BLOCK_T=gcfg["BLOCK_T"],
                    PRECISION=precision),
               **_opts(gcfg)),
        *tail,
    ]
    return launches, (dx, dgate, dphi_parts)


def _plan_merge_share(x, h_pre, h_res, g, da) -> tuple[list, Tensor]:
    """The launch writing dx = H_res^T g + H_pre da [T, n, C] (merge_dx_kernel's MODE 2: the
    merge's and the aggregation's shares of x's gradient), and dx."""
    dx = torch.empty_like(x)
    return [_merge_dx_launch(x, (None, h_res, g, dx, None), (h_pre, da), mode=2)], dx


def _merge_dx_launch(x, args: tuple, extra: tuple = (None, None), mode: int = 0) -> Launch:
    """merge_dx_kernel over x's tokens and channels: args (h_post, h_res, g, dx, df), extra
    (h_pre, da), mode its MODE (0: dx and df, 1: df, 2: dx with the aggregation's share)."""
    t, n, c = x.shape
    cfg = kernel_config("merge_dx", n, x.dtype)
    block_t, block_c = _channel_blocks(n, c, cfg["TILE"])
    return Launch(_k.merge_dx_kernel, (triton.cdiv(t, block_t), triton.cdiv(c, block_c)),
                  (*args, t, c, *extra),
                  dict(N=n, NP=triton.next_power_of_2(n), BLOCK_T=block_t, BLOCK_C=block_c,
                       MODE=mode), **_opts(cfg))


def _plan_dx_dphi(x, phi, dz, coef, shape: dict, smem=None, res: int | None = None,
                  dx: Tensor | None = None):
    """The maps backward's last two launches, from the per-token kernel's dz [T, M] and coef
    [T]: dx = dz phi^T + coef x over token blocks x K splits, and dphi = x^T dz in parts over
    token splits (summed by the caller). shape: the kernels' N, NP, PW (and R, RW for a
    successor's res columns, res its R); dx: a gradient of x written by an earlier launch, to
    which this one is added in place (mhc_dx_kernel's ADD). Returns (launches, dx, dphi parts
    [splits, K, M])."""
    t, n, c = x.shape
    k, m = n * c, dz.shape[1]
    smem = smem or smem_limit(x.device)
    cfg = kernel_config("dx", n, x.dtype, phi.dtype, smem, res)
    dcfg = kernel_config("dphi", n, x.dtype, phi.dtype, smem, res)
    add, dx = dx is not None, torch.empty_like(x) if dx is None else dx
    block_t = token_block(t, cfg["BLOCK_T"])
    blocks = triton.cdiv(t, block_t)
    splits, per_split = k_splits(k, blocks, cfg["BLOCK_K"])
    # dphi = x^T dz over T: split the tokens so that about 512 programs run, then sum. No
    # tokens: one split of zeros (the kernel still writes it), so dphi is zero, not empty.
    k_blocks = triton.cdiv(k, dcfg["BLOCK_K"])
    t_splits = max(1, min(triton.cdiv(t, dcfg["BLOCK_T"]), 512 // max(1, k_blocks)))
    per_t_split = max(1, triton.cdiv(triton.cdiv(t, t_splits), dcfg["BLOCK_T"])) * dcfg["BLOCK_T"]
    t_splits = max(1, triton.cdiv(t, per_t_split))
    dphi_parts = x.new_empty((t_splits, k, m), dtype=_F32)
    precision = _precision(x.dtype)
    launches = [
        Launch(_k.mhc_dx_kernel, (blocks, splits),
               (x, tf32_operand(phi, x.dtype), dz, coef, dx, t, k, per_split),
               dict(**shape, BLOCK_T=block_t, BLOCK_K=cfg["BLOCK_K"], PRECISION=precision,
                    ADD=add),
               **_opts(cfg),
               reads=((1, blocks), (2, splits), (3, splits), *([(4, 2)] if add else []))),
        Launch(_k.mhc_dphi_kernel, (k_blocks, t_splits), (x, dz, dphi_parts, t, k, per_t_split),
               dict(**shape, BLOCK_T=dcfg["BLOCK_T"], BLOCK_K=dcfg["BLOCK_K"],
                    PRECISION=precision),
               **_opts(dcfg), reads=((1, k_blocks),)),
    ]
    return launches, dx, dphi_parts


@torch.library.custom_op("torch_mhc::mhc_maps_bwd", mutates_args=())
def _maps_bwd(
    x: Tensor, phi: Tensor, alpha: Tensor, b_pre: Tensor, b_post: Tensor, b_res: Tensor,
    logits: Tensor, r: Tensor, g_pre: Tensor, g_post: Tensor, g_res: Tensor,
    iters: int, sk_eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of x, phi, alpha, b_pre, b_post, b_res (in their dtypes)."""
    launches, (dx, dgate, dphi_parts) = plan_maps_bwd(
        x, phi, alpha, b_pre, b_post, b_res, logits, r, g_pre, g_post, g_res, iters, sk_eps)
    _run("mhc_maps (backward)", launches, x, phi)
    return _maps_grads(dx, dgate, dphi_parts, logits, phi, alpha, b_pre, b_post, b_res)


def _maps_grads(dx, dgate, dphi_parts, logits, phi, alpha, b_pre, b_post, b_res) -> tuple:
    """The maps backward's outputs from its kernels' dx, per-token gate gradients dgate
    [T, M] and dphi parts: gradients of x, phi, alpha, b_pre, b_post, b_res (their dtypes)."""
    n = b_pre.shape[0]
    d_b = dgate.sum(dim=0)  # [M]: the biases' gradients in the logits' column order
    d_a = (dgate * logits).sum(dim=0)  # [M]: then summed per gate
    d_alpha = torch.stack([d_a[:n].sum(), d_a[n : 2 * n].sum(), d_a[2 * n :].sum()])
    # Custom ops may not return aliases of each other: copy the slices of d_b.
    return (
        dx,
        dphi_parts.sum(dim=0).to(phi.dtype),
        d_alpha.to(alpha.dtype),
        d_b[:n].to(b_pre.dtype, copy=True),
        d_b[n : 2 * n].to(b_post.dtype, copy=True),
        d_b[2 * n :].reshape(n, n).to(b_res.dtype, copy=True),
    )


@_maps_bwd.register_fake
def _(x, phi, alpha, b_pre, b_post, b_res, logits, r, g_pre, g_post, g_res, iters, sk_eps):
    return (
        torch.empty_like(x), torch.empty_like(phi), torch.empty_like(alpha),
        torch.empty_like(b_pre), torch.empty_like(b_post), torch.empty_like(b_res),
    )


def _maps_setup(ctx, inputs, output):
    x, phi, alpha, b_pre, b_post, b_res, iters, _, sk_eps, _ = inputs
    _, _, _, logits, r = output
    ctx.save_for_backward(x, phi, alpha, b_pre, b_post, b_res, logits, r)
    ctx.iters, ctx.sk_eps = iters, sk_eps


def _dense_map_grads(x: Tensor, g_pre, g_post, g_res) -> tuple[Tensor, Tensor, Tensor]:
    """The maps' upstream gradients as the backward kernels read them: float32, contiguous,
    zeros for a map that got none ([T, n], [T, n], [T, n, n] for x [T, n, C])."""
    t, n, _ = x.shape

    def dense(g, shape):
        if g is None:
            return torch.zeros(shape, dtype=_F32, device=x.device)
        return g.to(_F32).contiguous()

    return dense(g_pre, (t, n)), dense(g_post, (t, n)), dense(g_res, (t, n, n))


@_first_order
def _maps_backward(ctx, g_pre, g_post, g_res, _g_logits, _g_r):
    x, phi, alpha, b_pre, b_post, b_res, logits, r = ctx.saved_tensors
    g_pre, g_post, g_res = _dense_map_grads(x, g_pre, g_post, g_res)
    grads = torch.ops.torch_mhc.mhc_maps_bwd(
        x, phi, alpha, b_pre, b_post, b_res, logits, r,
        g_pre, g_post, g_res,
        ctx.iters, ctx.sk_eps,
    )
    return (*grads, None, None, None, None)


_maps_fwd.register_autograd(_maps_backward, setup_context=_maps_setup)


# Autocast: the maps' matmul runs in the autocast dtype, as a Linear's would (x and phi cast
# to it; the gates and biases stay as they are, the kernels read them in fp32). The
# aggregation and merge ops have no rule, so under autocast they keep the streams' dtype, as
# a residual add does. torch.library.register_autocast would cast every floating input, and
# to a dtype fixed when registering: this rule reads the region's dtype at each call.
_AUTOCAST = torch.library.Library("torch_mhc", "FRAGMENT")


def _register_maps_autocast(device_type: str, op: str = "mhc_maps_fwd") -> None:
    """The rule for op, whose arguments are x, phi, ... (mhc_maps_fwd) or kind, x, phi, ...
    (variant_maps_fwd)."""
    key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    lead = 1 if op == "variant_maps_fwd" else 0  # arguments before x

    def kernel(_keys, *args):
        dtype = torch.get_autocast_dtype(device_type)
        x, phi = args[lead], args[lead + 1]
        with torch._C._ExcludeDispatchKeyGuard(keyset):
            return getattr(torch.ops.torch_mhc, op)(*args[:lead], x.to(dtype), phi.to(dtype),
                                                    *args[lead + 2 :])

    _AUTOCAST.impl(op, kernel, key, with_keyset=True)


for _device_type in ("cuda", "cpu"):
    _register_maps_autocast(_device_type)


def mhc_maps(
    x: Tensor,
    phi: Tensor,
    alpha: Tensor,
    b_pre: Tensor,
    b_post: Tensor,
    b_res: Tensor,
    sinkhorn_iters: int = 20,
    norm_eps: float = 1e-6,
    sinkhorn_eps: float = 0.0,
    pre_eps: float = 0.0,
):
    """Same contract as functional.maps.mhc_maps; one kernel for all three maps."""
    check_tensors("mhc_maps", x, phi)
    check_maps_scalars("mhc_maps", sinkhorn_iters, norm_eps, sinkhorn_eps, pre_eps)
    check_mhc_shapes("mhc_maps", x, phi, alpha, b_pre, b_post, b_res)
    lead, (n, c) = x.shape[:-2], x.shape[-2:]
    h_pre, h_post, h_res, _, _ = _maps_fwd(
        x.reshape(-1, n, c).contiguous(), phi.contiguous(), alpha.contiguous(),
        b_pre.contiguous(), b_post.contiguous(), b_res.contiguous(),
        int(sinkhorn_iters), float(norm_eps), float(sinkhorn_eps), float(pre_eps),
    )
    return h_pre.reshape(*lead, n), h_post.reshape(*lead, n), h_res.reshape(*lead, n, n)


# ---------------------------------------------------------------------------------------------
# (b) pre-aggregation
# ---------------------------------------------------------------------------------------------


def plan_pre_fwd(x, h):
    t, n, c = x.shape
    out = x.new_empty((t, c))
    cfg = kernel_config("pre_fwd", n, x.dtype)
    block_t, block_c = _channel_blocks(n, c, cfg["TILE"])
    return [Launch(_k.pre_fwd_kernel, (triton.cdiv(t, block_t), triton.cdiv(c, block_c)),
                   (x, h, out, t, c),
                   dict(N=n, NP=triton.next_power_of_2(n), BLOCK_T=block_t, BLOCK_C=block_c),
                   **_opts(cfg))], out


@torch.library.custom_op("torch_mhc::pre_aggregate_fwd", mutates_args=())
def _pre_fwd(x: Tensor, h: Tensor) -> Tensor:
    """x [T, n, C], h [T, n] (fp32) -> [T, C] in x's dtype."""
    launches, out = plan_pre_fwd(x, h)
    _run("pre_aggregate (forward)", launches, x, h)
    return out


@_pre_fwd.register_fake
def _(x, h):
    return x.new_empty((x.shape[0], x.shape[2]))


def plan_pre_bwd(x, h, da, write_dx: bool = True):
    """write_dx False: dh alone (dx None: the fused maps backward adds its share)."""
    t, n, c = x.shape
    dx, dh = torch.empty_like(x) if write_dx else None, torch.empty_like(h)
    cfg = kernel_config("pre_bwd", n, x.dtype)
    block_t, block_c = _channel_blocks(n, c, cfg["TILE"])
    return [Launch(_k.pre_bwd_kernel, (triton.cdiv(t, block_t),), (x, h, da, dx, dh, t, c),
                   dict(N=n, NP=triton.next_power_of_2(n), BLOCK_T=block_t,
                        BLOCK_C=block_c, WRITE_DX=write_dx), **_opts(cfg))], (dx, dh)


@torch.library.custom_op("torch_mhc::pre_aggregate_bwd", mutates_args=())
def _pre_bwd(x: Tensor, h: Tensor, da: Tensor) -> tuple[Tensor, Tensor]:
    launches, out = plan_pre_bwd(x, h, da)
    _run("pre_aggregate (backward)", launches, x, h)
    return out


@_pre_bwd.register_fake
def _(x, h, da):
    return torch.empty_like(x), torch.empty_like(h)


def _pre_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


@_first_order
def _pre_backward(ctx, da):
    x, h = ctx.saved_tensors
    return torch.ops.torch_mhc.pre_aggregate_bwd(x, h, da.to(x.dtype).contiguous())


_pre_fwd.register_autograd(_pre_backward, setup_context=_pre_setup)


def pre_aggregate(x: Tensor, h_pre: Tensor) -> Tensor:
    """sum_j H_pre[j] x[j]: [..., n, C], [..., n] -> [..., C] in x's dtype."""
    check_tensors("pre_aggregate", x)
    if x.dim() < 2 or h_pre.shape != x.shape[:-1]:
        raise ValueError(
            f"pre_aggregate expects x [..., n, C] and h_pre [..., n], got {tuple(x.shape)} "
            f"and {tuple(h_pre.shape)}"
        )
    lead, (n, c) = x.shape[:-2], x.shape[-2:]
    out = _pre_fwd(x.reshape(-1, n, c).contiguous(), h_pre.reshape(-1, n).to(_F32).contiguous())
    return out.reshape(*lead, c)


# ---------------------------------------------------------------------------------------------
# (c) post-and-merge
# ---------------------------------------------------------------------------------------------


def plan_merge_fwd(x, f, h_post, h_res):
    t, n, c = x.shape
    out = torch.empty_like(x)
    cfg = kernel_config("merge_fwd", n, x.dtype)
    block_t, block_c = _channel_blocks(n, c, cfg["TILE"])
    return [Launch(_k.merge_fwd_kernel, (triton.cdiv(t, block_t), triton.cdiv(c, block_c)),
                   (x, f, h_post, h_res, out, t, c),
                   dict(N=n, NP=triton.next_power_of_2(n), BLOCK_T=block_t, BLOCK_C=block_c),
                   **_opts(cfg))], out


@torch.library.custom_op("torch_mhc::post_merge_fwd", mutates_args=())
def _merge_fwd(x: Tensor, f: Tensor, h_post: Tensor, h_res: Tensor) -> Tensor:
    """x [T, n, C], f [T, C] (x's dtype), h_post [T, n], h_res [T, n, n] (fp32)."""
    launches, out = plan_merge_fwd(x, f, h_post, h_res)
    _run("post_merge (forward)", launches, x, f, h_res)
    return out


@_merge_fwd.register_fake
def _(x, f, h_post, h_res):
    return torch.empty_like(x)


def plan_merge_bwd(x, f, h_post, h_res, g, write_dx: bool = True):
    """write_dx False: df, dH_post and dH_res (dx None: the fused maps backward adds its
    share)."""
    t, n, c = x.shape
    dx, df = torch.empty_like(x) if write_dx else None, torch.empty_like(f)
    dh_post, dh_res = torch.empty_like(h_post), torch.empty_like(h_res)
    dh_cfg = kernel_config("merge_dh", n, x.dtype)
    block_t, block_c = _channel_blocks(n, c, dh_cfg["TILE"])  # merge_dx's TILE too
    consts = dict(N=n, NP=triton.next_power_of_2(n), BLOCK_T=block_t, BLOCK_C=block_c)
    return [_merge_dx_launch(x, (h_post, h_res if write_dx else None, g, dx, df),
                             mode=0 if write_dx else 1),
            # g is read by all n + 1 programs of a token block, neighbours in the grid: the
            # re-reads come from L2, so the bytes model counts g once
            Launch(_k.merge_dh_kernel, ((n + 1) * triton.cdiv(t, block_t),),
                   (x, f, g, dh_post, dh_res, t, c), consts, **_opts(dh_cfg))], \
        (dx, df, dh_post, dh_res)


@torch.library.custom_op("torch_mhc::post_merge_bwd", mutates_args=())
def _merge_bwd(
    x: Tensor, f: Tensor, h_post: Tensor, h_res: Tensor, g: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    launches, out = plan_merge_bwd(x, f, h_post, h_res, g)
    _run("post_merge (backward)", launches, x, f, h_res)
    return out


@_merge_bwd.register_fake
def _(x, f, h_post, h_res, g):
    return (
        torch.empty_like(x), torch.empty_like(f),
        torch.empty_like(h_post), torch.empty_like(h_res),
    )


def _merge_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


@_first_order
def _merge_backward(ctx, g):
    x, f, h_post, h_res = ctx.saved_tensors
    return torch.ops.torch_mhc.post_merge_bwd(x, f, h_post, h_res, g.to(x.dtype).contiguous())


_merge_fwd.register_autograd(_merge_backward, setup_context=_merge_setup)


def post_merge(x: Tensor, f: Tensor, h_post: Tensor, h_res: Tensor, *,
               fused_dx: bool = False) -> Tensor:
    """H_res x + H_post^T f: [..., n, C], [..., C], [..., n], [..., n, n] -> [..., n, C].

    fused_dx=True: x is the x_for_merge of mhc_maps_pre(..., fused_dx=True), whose backward
    adds the merge's share of x's gradient (section (f))."""
    check_tensors("post_merge", x, f)
    _ref.check_merge_shapes(x, f, h_post, h_res)
    n, c = x.shape[-2:]
    args = (
        x.reshape(-1, n, c).contiguous(),
        f.to(x.dtype).reshape(-1, c).contiguous(),
        h_post.reshape(-1, n).to(_F32).contiguous(),
        h_res.reshape(-1, n, n).to(_F32).contiguous(),
    )
    out = _FusedMerge.apply(*args) if fused_dx else _merge_fwd(*args)
    return out.reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# (d) Sinkhorn
# ---------------------------------------------------------------------------------------------

def plan_sinkhorn_fwd(logits, iters, eps):
    t, n, _ = logits.shape
    out = torch.empty_like(logits)
    cfg = kernel_config("sinkhorn_fwd", n, logits.dtype)
    return [Launch(_k.sinkhorn_fwd_kernel, (triton.cdiv(t, cfg["BLOCK_T"]),),
                   (logits, out, t, eps, LINEAR_RANGE),
                   dict(N=n, NP=triton.next_power_of_2(n), ITERS=iters, LOG_OK=eps == 0.0,
                        BLOCK_T=cfg["BLOCK_T"]), **_opts(cfg))], out


@torch.library.custom_op("torch_mhc::sinkhorn_fwd", mutates_args=())
def _sinkhorn_fwd(logits: Tensor, iters: int, eps: float) -> Tensor:
    launches, out = plan_sinkhorn_fwd(logits, iters, eps)
    _run("sinkhorn (forward)", launches, logits)
    return out


@_sinkhorn_fwd.register_fake
def _(logits, iters, eps):
    return torch.empty_like(logits)


def plan_sinkhorn_bwd(logits, g, iters, eps):
    t, n, _ = logits.shape
    np_ = triton.next_power_of_2(n)
    dlogits = torch.empty_like(logits)
    scratch = logits.new_empty((t, 2 * iters, np_), dtype=_F32)  # the normalisers
    cfg = kernel_config("sinkhorn_bwd", n, logits.dtype)
    return [Launch(_k.sinkhorn_bwd_kernel, (triton.cdiv(t, cfg["BLOCK_T"]),),
                   (logits, g, dlogits, scratch, t, eps, LINEAR_RANGE),
                   dict(N=n, NP=np_, ITERS=iters, LOG_OK=eps == 0.0, BLOCK_T=cfg["BLOCK_T"]),
                   **_opts(cfg))], dlogits


@torch.library.custom_op("torch_mhc::sinkhorn_bwd", mutates_args=())
def _sinkhorn_bwd(logits: Tensor, g: Tensor, iters: int, eps: float) -> Tensor:
    launches, out = plan_sinkhorn_bwd(logits, g, iters, eps)
    _run("sinkhorn (backward)", launches, logits)
    return out


@_sinkhorn_bwd.register_fake
def _(logits, g, iters, eps):
    return torch.empty_like(logits)


def _sinkhorn_setup(ctx, inputs, output):
    logits, iters, eps = inputs
    ctx.save_for_backward(logits)  # n x n per token; the backward recomputes the iterates
    ctx.iters, ctx.eps = iters, eps


@_first_order
def _sinkhorn_backward(ctx, g):
    (logits,) = ctx.saved_tensors
    dlogits = torch.ops.torch_mhc.sinkhorn_bwd(
        logits, g.to(logits.dtype).contiguous(), ctx.iters, ctx.eps
    )
    return dlogits, None, None


_sinkhorn_fwd.register_autograd(_sinkhorn_backward, setup_context=_sinkhorn_setup)


def sinkhorn(logits: Tensor, iters: int = 20, *, eps: float = 0.0) -> Tensor:
    """Same as torch_mhc.sinkhorn(logits, iters, eps=eps): fp32 inside, logits' dtype out."""
    check_tensors("sinkhorn", logits)
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"sinkhorn expects matrices [..., n, n], got {tuple(logits.shape)}")
    check_sinkhorn_scalars("sinkhorn", iters, eps)
    n = logits.shape[-1]
    out = _sinkhorn_fwd(logits.reshape(-1, n, n).contiguous(), int(iters), float(eps))
    return out.reshape(logits.shape)


# ---------------------------------------------------------------------------------------------
# (e) mHC's successors' maps (functional.successors.variant_maps)
# ---------------------------------------------------------------------------------------------

# The kernels' KIND (ops/triton/kernels.py (e)); R = 0 (a static H_res, KromHC at n = 1) is
# the identity whatever the kind.
_KINDS = {"mhc-static-res": 0, "mhc-lite": 1, "kromhc": 2}
# The successors' tiles are those of mHC's kernels, which the ahead-of-time check covers up to
# n = 16 (aot.FULL); more streams take the reference maps (with this implementation's
# pre_aggregate).
VARIANT_MAX_STREAMS = 16


def _kind_code(kind: str, res: int) -> int:
    return _KINDS[kind] if res else 0


# mHC-lite's permutations p_k(i) per (n, device), made on the first call and kept (a copy to
# the device at every call would not be capturable in a CUDA graph).
_PERMUTATIONS: dict[tuple[int, torch.device], Tensor] = {}


def _permutations(n: int, device: torch.device) -> Tensor:
    """int32 [n!, n]: p_k(i), in itertools.permutations order (P_k[i, p_k(i)] = 1, as
    functional.successors.permutation_matrices)."""
    if device.type == "meta":
        return torch.empty((math.factorial(n), n), dtype=torch.int32, device=device)
    key = (n, device)
    table = _PERMUTATIONS.get(key)
    if table is None:
        rows = list(itertools.permutations(range(n)))
        table = torch.tensor(rows, dtype=torch.int32).to(device)
        _PERMUTATIONS[key] = table
    return table


def _variant_constexprs(kind: str, n: int) -> dict:
    res = _succ.res_count(kind, n)
    return dict(N=n, NP=_padded(n), PW=_pp_width(n), R=res, RW=_res_width(n, res))


def plan_variant_fwd(kind, x, phi, alpha, b_pre, b_post, b_res, norm_eps, smem=None):
    """Outputs and launches of variant_maps_fwd: mhc_xphi_kernel with the successor's res
    columns, then variant_maps_fwd_kernel (as plan_maps_fwd, any device, meta included)."""
    t, n, c = x.shape
    shape = _variant_constexprs(kind, n)
    res = shape["R"]
    k, m = n * c, 2 * n + res
    h_pre, h_post = x.new_empty((t, n), dtype=_F32), x.new_empty((t, n), dtype=_F32)
    h_res = x.new_empty((t, n, n), dtype=_F32)
    logits, r = x.new_empty((t, m), dtype=_F32), x.new_empty((t,), dtype=_F32)
    cfg = kernel_config("xphi", n, x.dtype, phi.dtype, smem or smem_limit(x.device), res)
    fcfg = kernel_config("variant_fwd", n, x.dtype, res=res)
    block_t = token_block(t, cfg["BLOCK_T"])
    blocks = triton.cdiv(t, block_t)
    splits, per_split = k_splits(k, blocks, cfg["BLOCK_K"])
    parts = x.new_empty((t, splits, m), dtype=_F32)  # partial x @ phi per split
    ss = x.new_empty((t, splits), dtype=_F32)  # partial sums of squares
    code = _kind_code(kind, res)
    perm = _permutations(n, x.device) if code == 1 else None
    launches = [
        Launch(_k.mhc_xphi_kernel, (blocks, splits), (x, phi, parts, ss, t, k, per_split),
               dict(**shape, BLOCK_T=block_t, BLOCK_K=cfg["BLOCK_K"],
                    PRECISION=_fwd_precision(x.dtype, phi.dtype)),
               **_opts(cfg), reads=((1, blocks),)),
        Launch(_k.variant_maps_fwd_kernel, (triton.cdiv(t, fcfg["BLOCK_T"]),),
               (parts, ss, alpha, b_pre, b_post, b_pre if b_res is None else b_res, perm,
                h_pre, h_post, h_res, logits, r, t, k, splits, norm_eps),
               dict(**shape, KIND=code, BLOCK_T=fcfg["BLOCK_T"], UNROLL=_SPLIT_UNROLL),
               **_opts(fcfg)),
    ]
    return launches, (h_pre, h_post, h_res, logits, r)


@torch.library.custom_op("torch_mhc::variant_maps_fwd", mutates_args=())
def _variant_fwd(
    kind: str, x: Tensor, phi: Tensor, alpha: Tensor, b_pre: Tensor, b_post: Tensor,
    b_res: Tensor | None, norm_eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [T, n, C] -> H_pre, H_post [T, n], H_res [T, n, n], logits [T, 2n + R], r [T] (fp32)."""
    launches, out = plan_variant_fwd(kind, x, phi, alpha, b_pre, b_post, b_res, norm_eps)
    _run(f"variant_maps {kind} (forward)", launches, x, phi)
    return out


@_variant_fwd.register_fake
def _(kind, x, phi, alpha, b_pre, b_post, b_res, norm_eps):
    t, n, _ = x.shape
    return (
        x.new_empty((t, n), dtype=_F32), x.new_empty((t, n), dtype=_F32),
        x.new_empty((t, n, n), dtype=_F32),
        x.new_empty((t, phi.shape[1]), dtype=_F32), x.new_empty((t,), dtype=_F32),
    )


def plan_variant_bwd(kind, x, phi, alpha, b_pre, b_post, b_res, logits, r, g_pre, g_post, g_res,
                     smem=None):
    """Launches of variant_maps_bwd and its buffers (dx, dgate, dphi parts): the per-token
    gradients, then mHC's dx and dphi kernels with the successor's res columns (as
    plan_maps_bwd)."""
    t, n, c = x.shape
    shape = _variant_constexprs(kind, n)
    res = shape["R"]
    k, m = n * c, 2 * n + res
    gcfg = kernel_config("variant_bwd", n, x.dtype, res=res)
    dgate = x.new_empty((t, m), dtype=_F32)
    dz = x.new_empty((t, m), dtype=_F32)
    coef = x.new_empty((t,), dtype=_F32)  # r's share of dx: coef * x
    precision = _precision(x.dtype)
    code = _kind_code(kind, res)
    perm = _permutations(n, x.device) if code == 1 else None
    tail, dx, dphi_parts = _plan_dx_dphi(x, phi, dz, coef, shape, smem, res)
    launches = [
        Launch(_k.variant_maps_bwd_kernel, (triton.cdiv(t, gcfg["BLOCK_T"]),),
               (alpha, b_pre, b_post, b_pre if b_res is None else b_res, perm, logits, r,
                g_pre, g_post, g_res, dgate, dz, coef, t, k),
               dict(**shape, KIND=code, BLOCK_T=gcfg["BLOCK_T"], PRECISION=precision),
               **_opts(gcfg)),
        *tail,
    ]
    return launches, (dx, dgate, dphi_parts)


def _no_res_grad(alpha: Tensor) -> Tensor:
    """b_res's gradient where there is no b_res (R = 0): custom ops return tensors, not None."""
    return alpha.new_empty((0,))


@torch.library.custom_op("torch_mhc::variant_maps_bwd", mutates_args=())
def _variant_bwd(
    kind: str, x: Tensor, phi: Tensor, alpha: Tensor, b_pre: Tensor, b_post: Tensor,
    b_res: Tensor | None, logits: Tensor, r: Tensor, g_pre: Tensor, g_post: Tensor,
    g_res: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of x, phi, alpha, b_pre, b_post, b_res (in their dtypes; b_res's empty where
    b_res is None)."""
    n = x.shape[1]
    launches, (dx, dgate, dphi_parts) = plan_variant_bwd(
        kind, x, phi, alpha, b_pre, b_post, b_res, logits, r, g_pre, g_post, g_res)
    _run(f"variant_maps {kind} (backward)", launches, x, phi)
    d_b = dgate.sum(dim=0)  # [M]: the biases' gradients in the logits' column order
    d_a = (dgate * logits).sum(dim=0)  # [M]: then summed per gate
    gates = [d_a[:n].sum(), d_a[n : 2 * n].sum()]
    if alpha.shape[0] > 2:
        gates.append(d_a[2 * n :].sum())
    # Custom ops may not return aliases of each other: copy the slices of d_b.
    return (
        dx,
        dphi_parts.sum(dim=0).to(phi.dtype),
        torch.stack(gates).to(alpha.dtype),
        d_b[:n].to(b_pre.dtype, copy=True),
        d_b[n : 2 * n].to(b_post.dtype, copy=True),
        _no_res_grad(alpha) if b_res is None else d_b[2 * n :].to(b_res.dtype, copy=True),
    )


@_variant_bwd.register_fake
def _(kind, x, phi, alpha, b_pre, b_post, b_res, logits, r, g_pre, g_post, g_res):
    return (
        torch.empty_like(x), torch.empty_like(phi), torch.empty_like(alpha),
        torch.empty_like(b_pre), torch.empty_like(b_post),
        _no_res_grad(alpha) if b_res is None else torch.empty_like(b_res),
    )


def _variant_setup(ctx, inputs, output):
    kind, x, phi, alpha, b_pre, b_post, b_res, _ = inputs
    _, _, _, logits, r = output
    ctx.kind, ctx.has_res = kind, b_res is not None
    ctx.save_for_backward(x, phi, alpha, b_pre, b_post, b_res, logits, r)


@_first_order
def _variant_backward(ctx, g_pre, g_post, g_res, _g_logits, _g_r):
    x, phi, alpha, b_pre, b_post, b_res, logits, r = ctx.saved_tensors
    g_pre, g_post, g_res = _dense_map_grads(x, g_pre, g_post, g_res)
    grads = torch.ops.torch_mhc.variant_maps_bwd(
        ctx.kind, x, phi, alpha, b_pre, b_post, b_res if ctx.has_res else None, logits, r,
        g_pre, g_post, g_res,
    )
    return (None, *grads[:5], grads[5] if ctx.has_res else None, None)


_variant_fwd.register_autograd(_variant_backward, setup_context=_variant_setup)
for _device_type in ("cuda", "cpu"):
    _register_maps_autocast(_device_type, "variant_maps_fwd")


def check_variant_shapes(kind, x, phi, alpha, b_pre, b_post, b_res) -> None:
    """ValueError unless, for streams x [..., n, C] and R = res_count(kind, n): phi
    [n C, 2n + R], alpha [3] ([2] when R = 0), b_pre, b_post [n], b_res [R] (None when R = 0)."""
    if x.dim() < 2:
        raise ValueError(f"variant_maps expects streams x [..., n, C], got {tuple(x.shape)}")
    n, c = x.shape[-2:]
    res = _succ.res_count(kind, n)  # checks kind and n
    want = {"phi": (phi, (n * c, 2 * n + res)), "alpha": (alpha, (3 if res else 2,)),
            "b_pre": (b_pre, (n,)), "b_post": (b_post, (n,))}
    if res or b_res is not None:
        want["b_res"] = (b_res, (res,))
    for name, (t, shape) in want.items():
        got = None if t is None else tuple(t.shape)
        if got != shape:
            raise ValueError(f"{kind} with n = {n}, C = {c} expects {name} of shape {shape}, "
                             f"got {got}")


def variant_maps(kind, x, phi, alpha, b_pre, b_post, b_res=None, norm_eps=1e-6):
    """Same contract as functional.successors.variant_maps; mHC's matmul kernels and the kind's
    per-token maps (ops/triton/kernels.py (e)). More than VARIANT_MAX_STREAMS streams: the
    reference maps."""
    check_tensors("variant_maps", x, phi)
    check_hc_scalars("variant_maps", norm_eps)
    check_variant_shapes(kind, x, phi, alpha, b_pre, b_post, b_res)
    lead, (n, c) = x.shape[:-2], x.shape[-2:]
    if n > VARIANT_MAX_STREAMS:
        return _succ.variant_maps(kind, x, phi, alpha, b_pre, b_post, b_res, norm_eps)
    h_pre, h_post, h_res, _, _ = _variant_fwd(
        kind, x.reshape(-1, n, c).contiguous(), phi.contiguous(), alpha.contiguous(),
        b_pre.contiguous(), b_post.contiguous(), None if b_res is None else b_res.contiguous(),
        float(norm_eps),
    )
    return h_pre.reshape(*lead, n), h_post.reshape(*lead, n), h_res.reshape(*lead, n, n)


def variant_maps_pre(kind, x, phi, alpha, b_pre, b_post, b_res=None, norm_eps=1e-6, *,
                     fused_dx: bool = False):
    """variant_maps plus pre_aggregate(x, H_pre) [..., C] in x's dtype (the kernels'
    pre-aggregation, as mhc_maps then pre_aggregate); fused_dx=True appends None (x's
    gradient is not fused for the successors here: the merge takes x)."""
    h_pre, h_post, h_res = variant_maps(kind, x, phi, alpha, b_pre, b_post, b_res, norm_eps)
    maps = (h_pre, h_post, h_res, pre_aggregate(x, h_pre))
    return (*maps, None) if fused_dx else maps


# ---------------------------------------------------------------------------------------------
# (f) x's gradient in one buffer: mhc_maps_pre and post_merge with fused_dx=True
# ---------------------------------------------------------------------------------------------
# x feeds a connection's maps, its aggregation and its merge, so autograd would add three
# [T, n, C] gradients (three writes, then two elementwise adds reading four and writing two,
# in the streams' dtype). With fused_dx the maps and the aggregation are one node that also
# returns x_for_merge (x itself, as a view); the merge's backward hands its upstream gradient
# g to x_for_merge unchanged, and the maps' backward writes sum_i H_res[i, j] g[i] +
# H_pre[j] da into dx (merge_dx_kernel, MODE 2) and adds its own share in place
# (mhc_dx_kernel, ADD): two writes and one read of dx, rounded to the streams' dtype twice.


@torch.library.custom_op("torch_mhc::mhc_maps_pre_bwd", mutates_args=())
def _maps_pre_bwd(
    x: Tensor, phi: Tensor, alpha: Tensor, b_pre: Tensor, b_post: Tensor, b_res: Tensor,
    logits: Tensor, r: Tensor, h_pre: Tensor, h_res: Tensor, g_pre: Tensor, g_post: Tensor,
    g_res: Tensor, da: Tensor, g_merge: Tensor, iters: int, sk_eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of x, phi, alpha, b_pre, b_post, b_res of the maps and the aggregation a
    (upstream da), x's including the merge's share H_res^T g_merge."""
    launches, (_, dh) = plan_pre_bwd(x, h_pre, da, write_dx=False)  # the aggregation's dH_pre
    _run("mhc_maps_pre (backward)", launches, x, h_pre)
    launches, (dx, dgate, dphi_parts) = plan_maps_bwd(
        x, phi, alpha, b_pre, b_post, b_res, logits, r, g_pre + dh, g_post, g_res, iters,
        sk_eps, fused=(h_pre, h_res, g_merge, da))
    _run("mhc_maps_pre (backward)", launches, x, phi)
    return _maps_grads(dx, dgate, dphi_parts, logits, phi, alpha, b_pre, b_post, b_res)


@_maps_pre_bwd.register_fake
def _(x, phi, alpha, b_pre, b_post, b_res, logits, r, h_pre, h_res, g_pre, g_post, g_res, da,
      g_merge, iters, sk_eps):
    return (
        torch.empty_like(x), torch.empty_like(phi), torch.empty_like(alpha),
        torch.empty_like(b_pre), torch.empty_like(b_post), torch.empty_like(b_res),
    )


def plan_maps_pre_bwd(x, phi, alpha, b_pre, b_post, b_res, logits, r, h_pre, h_res, g_pre,
                      g_post, g_res, da, g_merge, iters, sk_eps, smem=None):
    """mhc_maps_pre_bwd's launches (for the ahead-of-time check; the op adds the first
    launch's dH_pre to g_pre between the two groups) and outputs (dx, dgate, dphi parts)."""
    pre, _ = plan_pre_bwd(x, h_pre, da, write_dx=False)
    maps, out = plan_maps_bwd(x, phi, alpha, b_pre, b_post, b_res, logits, r, g_pre, g_post,
                              g_res, iters, sk_eps, smem, fused=(h_pre, h_res, g_merge, da))
    return pre + maps, out


@torch.library.custom_op("torch_mhc::post_merge_bwd_no_dx", mutates_args=())
def _merge_bwd_no_dx(
    x: Tensor, f: Tensor, h_post: Tensor, h_res: Tensor, g: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The merge's gradients but x's: f, H_post, H_res."""
    launches, (_, df, dh_post, dh_res) = plan_merge_bwd_no_dx(x, f, h_post, h_res, g)
    _run("post_merge (backward)", launches, x, f, h_res)
    return df, dh_post, dh_res


@_merge_bwd_no_dx.register_fake
def _(x, f, h_post, h_res, g):
    return torch.empty_like(f), torch.empty_like(h_post), torch.empty_like(h_res)


def plan_merge_bwd_no_dx(x, f, h_post, h_res, g):
    """post_merge_bwd_no_dx's launches and outputs (for the ahead-of-time check)."""
    return plan_merge_bwd(x, f, h_post, h_res, g, write_dx=False)


class _FusedMapsPre(torch.autograd.Function):
    """mhc_maps_pre(..., fused_dx=True) on [T, n, C]: H_pre, H_post, H_res, a and
    x_for_merge; the backward builds x's whole gradient in one buffer (section (f))."""

    @staticmethod
    def forward(ctx, x, phi, alpha, b_pre, b_post, b_res, iters, norm_eps, sk_eps, pre_eps):
        ctx.set_materialize_grads(False)  # unused outputs' gradients arrive as None
        h_pre, h_post, h_res, logits, r = torch.ops.torch_mhc.mhc_maps_fwd(
            x, phi, alpha, b_pre, b_post, b_res, iters, norm_eps, sk_eps, pre_eps)
        a = torch.ops.torch_mhc.pre_aggregate_fwd(x, h_pre)
        ctx.save_for_backward(x, phi, alpha, b_pre, b_post, b_res, logits, r, h_pre, h_res)
        ctx.iters, ctx.sk_eps = iters, sk_eps
        return h_pre, h_post, h_res, a, x.view_as(x)

    @staticmethod
    @_first_order
    def backward(ctx, g_pre, g_post, g_res, g_a, g_merge):
        x, phi, alpha, b_pre, b_post, b_res, logits, r, h_pre, h_res = ctx.saved_tensors
        t, n, c = x.shape
        g_pre, g_post, g_res = _dense_map_grads(x, g_pre, g_post, g_res)
        da = x.new_zeros((t, c)) if g_a is None else g_a.to(x.dtype).contiguous()
        g_merge = torch.zeros_like(x) if g_merge is None else g_merge.to(x.dtype).contiguous()
        grads = torch.ops.torch_mhc.mhc_maps_pre_bwd(
            x, phi, alpha, b_pre, b_post, b_res, logits, r, h_pre, h_res, g_pre, g_post,
            g_res, da, g_merge, ctx.iters, ctx.sk_eps)
        return (*grads, None, None, None, None)


class _FusedMerge(torch.autograd.Function):
    """post_merge(..., fused_dx=True) on [T, n, C]: the merge, whose backward hands g to
    x_for_merge unchanged (section (f))."""

    @staticmethod
    def forward(ctx, x, f, h_post, h_res):
        ctx.save_for_backward(x, f, h_post, h_res)
        return torch.ops.torch_mhc.post_merge_fwd(x, f, h_post, h_res)

    @staticmethod
    @_first_order
    def backward(ctx, g):
        x, f, h_post, h_res = ctx.saved_tensors
        g = g.to(x.dtype).contiguous()
        df, dh_post, dh_res = torch.ops.torch_mhc.post_merge_bwd_no_dx(x, f, h_post, h_res, g)
        return g, df, dh_post, dh_res


FUSED_DX = True  # ops.Ops.fused_dx: mhc_maps_pre and post_merge take fused_dx (section (f))


def _fusable(x: Tensor, *params: Tensor) -> bool:
    """Whether fused_dx makes one node: a gradient may be needed and no autocast region
    casts the maps' inputs (the maps' op casts x and phi there, the aggregation does not;
    the unfused ops keep exactly that)."""
    return (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params))
            and not torch.is_autocast_enabled(x.device.type))


def mhc_maps_pre(x, phi, alpha, b_pre, b_post, b_res, sinkhorn_iters=20, norm_eps=1e-6,
                 sinkhorn_eps=0.0, pre_eps=0.0, *, fused_dx: bool = False):
    """mhc_maps then pre_aggregate(x, H_pre); fused_dx=True also returns x_for_merge, for
    post_merge(x_for_merge, ..., fused_dx=True): the fused node's view of x (section (f)),
    or None where no gradient is taken or under autocast (the ops stay apart there, and the
    merge takes x unfused)."""
    params = (phi, alpha, b_pre, b_post, b_res)
    if not (fused_dx and _fusable(x, *params)):
        h_pre, h_post, h_res = mhc_maps(x, *params, sinkhorn_iters, norm_eps, sinkhorn_eps,
                                        pre_eps)
        maps = (h_pre, h_post, h_res, pre_aggregate(x, h_pre))
        return (*maps, None) if fused_dx else maps
    check_tensors("mhc_maps", x, phi)
    check_maps_scalars("mhc_maps", sinkhorn_iters, norm_eps, sinkhorn_eps, pre_eps)
    check_mhc_shapes("mhc_maps", x, *params)
    lead, (n, c) = x.shape[:-2], x.shape[-2:]
    h_pre, h_post, h_res, a, x_for_merge = _FusedMapsPre.apply(
        x.reshape(-1, n, c).contiguous(), *(p.contiguous() for p in params),
        int(sinkhorn_iters), float(norm_eps), float(sinkhorn_eps), float(pre_eps))
    return (h_pre.reshape(*lead, n), h_post.reshape(*lead, n), h_res.reshape(*lead, n, n),
            a.reshape(*lead, c), x_for_merge.reshape(x.shape))


def hc_maps_pre(x, w, s_alpha, s_beta, static_pre, static_post, static_res, norm_eps=1e-6, *,
                fused_dx: bool = False):
    """hc_maps then pre_aggregate; fused_dx=True appends None (HC's maps are torch ops here:
    no single node to hand the merge's gradient to)."""
    h_pre, h_post, h_res = hc_maps(x, w, s_alpha, s_beta, static_pre, static_post, static_res,
                                   norm_eps)
    maps = (h_pre, h_post, h_res, pre_aggregate(x, h_pre))
    return (*maps, None) if fused_dx else maps


# Every custom op's plan, for the ahead-of-time compile check (ops/triton/aot.py).
PLANS = {
    "mhc_maps_fwd": plan_maps_fwd,
    "mhc_maps_bwd": plan_maps_bwd,
    "pre_aggregate_fwd": plan_pre_fwd,
    "pre_aggregate_bwd": plan_pre_bwd,
    "post_merge_fwd": plan_merge_fwd,
    "post_merge_bwd": plan_merge_bwd,
    "sinkhorn_fwd": plan_sinkhorn_fwd,
    "sinkhorn_bwd": plan_sinkhorn_bwd,
    "variant_maps_fwd": plan_variant_fwd,
    "variant_maps_bwd": plan_variant_bwd,
    "mhc_maps_pre_bwd": plan_maps_pre_bwd,
    "post_merge_bwd_no_dx": plan_merge_bwd_no_dx,
}
