"""Decoding without autograd: a connection's step as two prepared native calls.

A KV-cached decode step calls every connection on one token (or one per sequence of a
batch). The arithmetic is then a few microseconds: mHC's maps are a [1, n C] x [n C, M]
product, a 20-iteration n x n Sinkhorn and an aggregation over n C numbers. Through the op
interface the same call spent most of its time around the arithmetic: checks of the
scalars, the cache lookup of phi's padded copy, five output tensors, and twenty ctypes
arguments converted one by one. A Decoder does that work once per connection, streams
shape and thread:

    dec = decoder(conn.decode_kind, conn.decode_args(x))  # None where this does not apply
    a = dec.mix_in(x)                        # H_pre, H_post, H_res and sum_j H_pre[j] x[j]
    out = dec.mix_out(x, branch(a))          # H_res x + H_post^T f

For fewer than native.SINGLE_THREAD_TOKENS tokens only (more take the ops' path, which
splits them over torch's threads). Each call passes the prepared argument block (native.c's
decode_call) and its tensors' addresses to one native function, through decode_calls.c's
built-ins where they build (NativeOps.decoding_calls; else ctypes), and runs on the
caller's thread; it allocates only the tensor it returns. The maps live in buffers of the
Decoder, written by mix_in and read by the following mix_out, so one Decoder serves one call
at a time: Connection keys them by thread and takes the ops' path when its branch calls it
again in between (`busy`).

`current(args)` says whether a Decoder still describes the arguments (ops/decoding.py: the
same parameter objects at the same version, no optimizer step since). The padded parameter
tables are copies made once per parameter version and optimizer step
(ops.cpu.cached_tables), shared by the shapes.
"""

from __future__ import annotations

import ctypes

import torch

from torch_mhc.functional import maps as _ref
from torch_mhc.functional.successors import VARIANT_KINDS, check_variant, res_count
from torch_mhc.ops.checks import (
    check_hc_scalars,
    check_hc_shapes,
    check_maps_scalars,
    check_mhc_shapes,
)
from torch_mhc.ops.cpu import native as _native
from torch_mhc.ops.cpu.ops import (
    cached_tables,
    hc_tables,
    mhc_tables,
    plain_eager,
    use_native,
)
from torch_mhc.ops.cpu.variants import variant_tables
from torch_mhc.ops.decoding import PreparedDecoder, param_marks

__all__ = ["Decoder", "decoder"]

# native.c's decode_call.kind: 0 for mHC and its successors (maps_fwd), 1 for HC
_KINDS = {"mhc": 0, "hc": 1} | {kind: 0 for kind in VARIANT_KINDS}


def decoder(kind: str, args: tuple) -> Decoder | None:
    """A Decoder for connection kind "mhc" (args: ops.mhc_maps' arguments), "hc"
    (ops.hc_maps' arguments, dynamic W) or a successor of mHC (ops.variant_maps' arguments
    after the kind), or None where the native loops do not apply
    (another kind, dtype, device or n; no native library; HC without W; parameters made
    in inference mode, which have no version to check)."""
    if kind not in _KINDS:
        return None
    x = args[0]
    if not (x.is_contiguous() and use_native(x)):
        return None
    if x.dim() < 2 or x.numel() >= _native.SINGLE_THREAD_TOKENS * x.shape[-2] * x.shape[-1]:
        return None  # many tokens: the ops' path splits them over torch's threads
    if not plain_eager(t for t in args if isinstance(t, torch.Tensor)):
        return None  # meta, fake or wrapped tensors (no memory for the loops to read), or a
        # trace or dispatch mode that must see the custom ops
    if not _shapes_fit(kind, x, args[1:]):
        return None  # the ops' own path says what is wrong
    try:
        param_marks(args[1:])
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None
    return Decoder(_native.load(), kind, args)


def _shapes_fit(kind: str, x: torch.Tensor, params: tuple) -> bool:
    """Whether the parameters have the shapes the native loops read (they index without
    bounds; ops.checks) and HC has a W (without it the maps are static: nothing to
    prepare)."""
    n, c = x.shape[-2:]
    try:
        if kind == "mhc":
            check_mhc_shapes("mhc_maps", x, *params[:5])
        elif kind == "hc":
            check_hc_shapes("hc_maps", x, *params[:6])
        else:  # phi [n C, 2 n + R], b_pre [n], b_post [n], b_res [R] or None
            check_variant(kind, n)
            r = res_count(kind, n)
            phi, _, b_pre, b_post, b_res = params[:5]
            if (tuple(phi.shape) != (n * c, 2 * n + r) or tuple(b_pre.shape) != (n,)
                    or tuple(b_post.shape) != (n,)
                    or (b_res is None) != (r == 0) or (r and tuple(b_res.shape) != (r,))):
                return False
    except ValueError:
        return False
    if kind == "hc":
        return params[0] is not None
    return params[0].shape[1] <= _native.MAX_MAP_LOGITS


class Decoder(PreparedDecoder):
    """One connection's prepared decoding calls for CPU streams of one shape and dtype."""

    __slots__ = ("a_shape", "tables", "maps", "_a_like", "_call", "_addr", "_maps_call",
                 "_merge_call", "_lib")

    def __init__(self, lib: _native.NativeOps, kind: str, args: tuple):
        x, params = args[0], args[1:]
        *lead, n, c = x.shape
        super().__init__(x, params)  # the optimizer steps first: a step after is seen
        self.a_shape = torch.Size((*lead, c))
        # the branch inputs are made by empty_like of this: half the time of torch.empty
        # with a shape and a dtype to parse
        self._a_like = torch.empty(self.a_shape, dtype=x.dtype)
        call = _native.DecodeCall()
        lib.entry_points(call)
        if kind == "mhc":
            phi, alpha, b_pre, b_post, b_res, iters, norm_eps, sk_eps, pre_eps = params
            check_maps_scalars("mhc_maps", iters, norm_eps, sk_eps, pre_eps)
            # phi [K, Mp], [2, M]: one copy per parameter version, shared by every shape
            self.tables = cached_tables(mhc_tables, phi, alpha, b_pre, b_post, b_res)
            call.M, call.iters = self.tables[1].shape[1], int(iters)
            call.sk_eps, call.pre_eps = float(sk_eps), float(pre_eps)
        elif kind in VARIANT_KINDS:  # mHC's maps with the kind's H_res (native.RES)
            phi, alpha, b_pre, b_post, b_res, norm_eps = params
            check_hc_scalars("variant_maps", norm_eps)
            self.tables = cached_tables(variant_tables, phi, alpha, b_pre, b_post,
                                        *([] if b_res is None else [b_res]))
            call.M, call.iters, call.res = self.tables[1].shape[1], 1, _native.RES[kind]
        else:
            w, s_alpha, s_beta, static_pre, static_post, static_res, norm_eps = params
            check_hc_scalars("hc_maps", norm_eps)
            self.tables = cached_tables(hc_tables, w, s_alpha, s_beta, static_pre, static_post,
                                        static_res)
            call.M = n + 2
        # H_pre [..., n], H_post [..., n], H_res [..., n, n]: read by mix_out only
        f32 = torch.float32
        self.maps = (torch.empty((*lead, n), dtype=f32), torch.empty((*lead, n), dtype=f32),
                     torch.empty((*lead, n, n), dtype=f32))
        call.table, call.gates = self.tables[0].data_ptr(), self.tables[1].data_ptr()
        call.hpre, call.hpost, call.hres = (m.data_ptr() for m in self.maps)
        call.t, call.n, call.C = x.numel() // (n * c) if x.numel() else 0, n, c
        call.MV, call.bf, call.kind = self.tables[0].shape[1] // 8, int(x.dtype != f32), \
            _KINDS[kind]
        call.norm_eps = float(norm_eps)
        self._call, self._addr = call, ctypes.addressof(call)
        self._maps_call, self._merge_call = lib.decoding_calls()
        self._lib = lib  # whose entry points the block holds: loaded while the block is used

    checks_each_call = False

    def runs_on(self, x: torch.Tensor) -> bool:
        return x.is_cpu

    def mix_in(self, x: torch.Tensor) -> torch.Tensor:
        """The maps (kept for mix_out) and the branch input a = sum_j H_pre[j] x[j]
        [..., C] of contiguous x [..., n, C] (shape and dtype as built)."""
        a = torch.empty_like(self._a_like)
        self._maps_call(self._addr, x.data_ptr(), a.data_ptr())
        return a

    def mix_out(self, x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """H_res x + H_post^T f [..., n, C] with the maps of the last mix_in."""
        if f.shape != self.a_shape:
            _ref.check_merge_shapes(x, f, *self.maps[1:])
        if f.dtype is not self.dtype or not f.is_contiguous() or not f.is_cpu:
            f = f.to(device="cpu", dtype=self.dtype).contiguous()
        out = torch.empty_like(x)  # x: contiguous, of the shape and dtype built for
        self._merge_call(self._addr, x.data_ptr(), f.data_ptr(), out.data_ptr())
        return out
