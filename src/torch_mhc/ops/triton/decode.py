"""Decoding without autograd on a GPU: a connection's step as prepared Triton launches.

A KV-cached decoding step calls every connection on one token per sequence. On a GPU its
kernels then take microseconds (one token, d = 2048, n = 4, bf16, an H200: 15.6 us), and
the call through the custom ops held the host for hundreds (benchmarks/README.md): three
custom ops' dispatch, each plan's launch parameters worked out again, the argument checks,
nine tensors allocated. A Decoder does that work once per connection, streams shape and
thread, keeps the maps in buffers of its own, and each call launches the same kernels with
the call's x, f and outputs put in place of those it was planned with:

    dec = decoder(kind, decode_args)   # None where this does not apply
    a = dec.mix_in(x)                  # x @ phi, the per-token maps, sum_j H_pre[j] x[j]
    out = dec.mix_out(x, branch(a))    # H_res x + H_post^T f

The kernels and their arguments are those of the ops' path, so the results are the same
bits (tests/ops/test_triton_decode.py, in Triton's interpreter). For mHC and its successors
(HC's maps stay in torch on this implementation: no decoder), float32, float16 and bfloat16
streams of at most MAX_TOKENS tokens in all (a decoding step of up to 32 sequences; a
longer prompt's prefill takes the ops' path: a decoder's buffers, its maps and x @ phi's
partial sums, grow with the tokens and are kept per shape), outside autocast (the ops'
path casts there), on the CUDA stream the Decoder was built on (another stream could run a
later call's maps over buffers an earlier call's merge has yet to read; each call asks
x's device for its current stream), and not while a CUDA graph is captured (a graph
replays into the buffers it saw, which a Decoder rebuilt for new parameters would let go;
the graph's own launches already spare the host). Streams on another GPU than the current
one launch under a device guard, as the ops' path does. The branch output f is checked as
the ops' post_merge checks it, then converted to the streams' dtype and made contiguous.
When a Decoder still applies: ops/decoding.py.
"""

from __future__ import annotations

import torch

from torch_mhc.functional import maps as _ref
from torch_mhc.functional.successors import VARIANT_KINDS
from torch_mhc.ops.checks import check_hc_scalars, check_maps_scalars, check_mhc_shapes
from torch_mhc.ops.decoding import PreparedDecoder, param_marks
from torch_mhc.ops.triton import ops as _tri

__all__ = ["MAX_TOKENS", "Decoder", "decoder"]

MAX_TOKENS = 32
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def decoder(kind: str, args: tuple) -> Decoder | None:
    """A Decoder for connection kind "mhc" (args: ops.mhc_maps' arguments) or a successor of
    mHC (ops.variant_maps' arguments after the kind), or None where the prepared launches do
    not apply (see the module docstring; arguments the ops' path would refuse: it says
    why)."""
    if kind != "mhc" and kind not in VARIANT_KINDS:
        return None
    x = args[0]
    if type(x) not in _PLAIN or x.dim() < 2 or not x.is_contiguous():
        return None
    n, c = x.shape[-2:]
    if not 0 < x.numel() <= MAX_TOKENS * n * c:
        return None
    if not (x.is_cuda or _tri.interpreted()) or torch.is_autocast_enabled(x.device.type):
        return None
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # a CUDA graph keeps what the ops' path allocates, not a Decoder's buffers
    if not all(type(t) in _PLAIN and t.device == x.device
               for t in args if isinstance(t, torch.Tensor)):
        return None  # meta, fake or wrapped tensors, or parameters elsewhere
    if kind != "mhc" and n > _tri.VARIANT_MAX_STREAMS:
        return None  # the reference maps (ops.triton.variant_maps)
    try:
        _tri.check_tensors("decoder", x, args[1])
        if kind == "mhc":
            check_maps_scalars("mhc_maps", *args[6:10])
            check_mhc_shapes("mhc_maps", *args[:6])
        else:
            check_hc_scalars("variant_maps", args[6])
            _tri.check_variant_shapes(kind, *args[:6])
        param_marks(args[1:])
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: inference-mode parameters
        return None
    return Decoder(kind, args)


class _Prepared:
    """One planned launch, ready to run again with some tensor arguments replaced: `slots`
    lists (argument index, name) of those the call supplies; the tensors the launch was
    planned with there are not kept (args holds None in their place)."""

    __slots__ = ("name", "constexprs", "num_warps", "run", "args", "slots", "kwargs")

    def __init__(self, launch: _tri.Launch, placeholders: dict[int, str]):
        self.name, self.num_warps = launch.name, launch.num_warps
        self.constexprs = launch.constexprs
        self.run = launch.kernel[launch.grid]
        self.slots = tuple((i, placeholders[id(a)]) for i, a in enumerate(launch.args)
                           if id(a) in placeholders)
        self.args = tuple(None if id(a) in placeholders else a for a in launch.args)
        self.kwargs = {**launch.constexprs, **launch.options}


class Decoder(PreparedDecoder):
    """One connection's prepared launches for streams of one shape, dtype and device."""

    __slots__ = ("device", "index", "stream", "a_shape", "maps", "_mix_in", "_mix_out")

    def __init__(self, kind: str, args: tuple):
        x, params = args[0], args[1:]
        super().__init__(x, params)
        *lead, n, c = x.shape
        t = x.numel() // (n * c)
        self.device, self.a_shape = x.device, torch.Size((*lead, c))
        self.index = x.device.index if x.is_cuda else None
        self.stream = _current_stream(self.index)
        x3 = x.view(t, n, c)
        phi, alpha, b_pre, b_post, b_res = (None if p is None else p.contiguous()
                                            for p in params[:5])
        if kind == "mhc":
            iters, norm_eps, sk_eps, pre_eps = params[5:9]
            maps_launches, maps = _tri.plan_maps_fwd(
                x3, phi, alpha, b_pre, b_post, b_res, int(iters), float(norm_eps),
                float(sk_eps), float(pre_eps))
        else:
            maps_launches, maps = _tri.plan_variant_fwd(kind, x3, phi, alpha, b_pre, b_post,
                                                        b_res, float(params[5]))
        h_pre, h_post, h_res = maps[:3]
        pre_launches, a = _tri.plan_pre_fwd(x3, h_pre)
        f = a.new_empty(a.shape)
        merge_launches, out = _tri.plan_merge_fwd(x3, f, h_post, h_res)
        # the buffers the launches write and read between calls (H_pre, H_post, H_res, the
        # logits, r and the partial sums): kept by the launches' arguments
        self.maps = maps
        names = {id(x3): "x", id(a): "a", id(f): "f", id(out): "out"}
        self._mix_in = [_Prepared(launch, names) for launch in (*maps_launches, *pre_launches)]
        self._mix_out = [_Prepared(launch, names) for launch in merge_launches]

    def runs_on(self, x: torch.Tensor) -> bool:
        if x.device != self.device or torch.is_autocast_enabled(x.device.type):
            return False
        return self.index is None or (_current_stream(self.index) == self.stream
                                      and not torch.cuda.is_current_stream_capturing())

    def mix_in(self, x: torch.Tensor) -> torch.Tensor:
        """The maps (kept for mix_out) and the branch input a = sum_j H_pre[j] x[j]
        [..., C] of contiguous x [..., n, C] (shape, dtype and device as built)."""
        a = x.new_empty(self.a_shape)
        self._launch("mhc_maps and pre_aggregate (decoding)", self._mix_in, {"x": x, "a": a})
        return a

    def mix_out(self, x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """H_res x + H_post^T f [..., n, C] with the maps of the last mix_in."""
        if f.shape != self.a_shape:
            _ref.check_merge_shapes(x, f, *self.maps[1:3])
        if f.dtype is not self.dtype or not f.is_contiguous() or f.device != self.device:
            _tri.check_tensors("post_merge", f)  # what the ops' path refuses, refused
            f = f.to(device=self.device, dtype=self.dtype).contiguous()
        out = torch.empty_like(x)  # x: contiguous, of the shape and dtype built for
        self._launch("post_merge (decoding)", self._mix_out, {"x": x, "f": f, "out": out})
        return out

    def _launch(self, op: str, prepared: list[_Prepared], tensors: dict) -> None:
        """Run each prepared launch with `tensors` in its slots, on this decoder's GPU
        (Triton launches on the current one)."""
        if self.index is not None and torch.cuda.current_device() != self.index:
            with torch.cuda.device(self.index):
                return self._launch(op, prepared, tensors)
        for p in prepared:
            args = list(p.args)
            for i, name in p.slots:
                args[i] = tensors[name]
            try:
                p.run(*args, **p.kwargs)
            except Exception as err:  # compile errors, launch failures: as the ops' path
                raise _tri.launch_failed(op, p, list(tensors.values()), err) from err


# the handle Triton launches on, without the torch.cuda.Stream object the public call makes
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(index: int | None) -> int | None:
    """The raw handle of GPU `index`'s current CUDA stream (None off a GPU)."""
    if index is None:
        return None
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream
