"""The base class of every connection and the helpers the connection kinds share.

Every connection wraps a block F: [..., C] -> [..., C] and maps a streams tensor
x: [..., n, C] to [..., n, C] (the plain residual has n = 1):

    out[..., i, :] = sum_j H_res[i, j] x[..., j, :] + H_post[i] F(sum_j H_pre[j] x[..., j, :])

    h = embed(tokens)                       # [B, T, C]
    x = expand_streams(h, n)                # [B, T, n, C]
    for conn in connections: x = conn(x)    # each wraps one attention or MLP block
    h = reduce_streams(x)                   # [B, T, C]

Initialisation. All three start as the Pre-Norm residual network built from the same blocks:
`expand_streams` copies h into every stream, and each connection's initial maps keep equal
streams equal while adding F(h) once: H_pre sums to 1, H_post is all ones, H_res has rows
summing to 1. The dynamic parts start at zero (HC's W, mHC's phi), so the network computes
exactly the residual network's function, and `reduce_streams` (the mean) returns it.
Symmetry is broken by which stream each layer reads, so the streams separate as soon as
training moves the maps:
- HC (HC paper, Eq. 14): layer k reads stream k mod n (H_pre = e_k), H_post = 1, H_res = I,
  and the scales s_alpha, s_beta start at 0.01.
- mHC: H_pre = sigmoid(b_pre) = e_k / 2 + 1 / (2n) (half on stream k mod n, half spread),
  H_post = 2 sigmoid(0) = 1, H_res = sinkhorn(b_res) = I / 2 + J / (2n) (the same split:
  half kept, half averaged), and the gates alpha_pre, alpha_post, alpha_res start at 0.01 (the
  paper's value). For n = 4, H_res's initial weights (0.625, 0.125) are exact in binary;
  H_pre's are within one float32 rounding of theirs (sigmoid of a rounded logit). With n = 1,
  H_pre could not reach 1 through a sigmoid: mHC and its successors take n >= 2.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import numbers
import operator
import threading
import weakref
from collections.abc import Callable

import torch
from torch import nn

from torch_mhc import ops as _ops
from torch_mhc.functional.sinkhorn import func_transform_active
from torch_mhc.runtime import diagnostics as _diag
from torch_mhc.runtime import recompute as _recompute

__all__ = ["Connection", "assign_parameter", "check_count", "check_eps", "check_flag",
           "check_gate", "check_mixing_streams", "frozen_connections", "pre_bias",
           "prepared_decoder", "res_bias"]


def check_count(value, owner: str, name: str, least: int) -> int:
    """value as an int >= least (numpy integers included, bools not), else a clear error."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(
            f"{owner} expects {name} to be an int, got {value!r} ({type(value).__name__})"
        )
    value = operator.index(value)
    if value < least:
        raise ValueError(f"{owner} expects {name} >= {least}, got {value}")
    return value


def check_mixing_streams(streams: int, owner: str) -> None:
    """mHC and its successors need n >= 2: with one stream H_pre = sigmoid(b_pre) cannot be 1,
    so the connection would not start as the residual network does (HC's H_pre = e_k can)."""
    if streams < 2:
        raise ValueError(
            f"{owner} expects streams >= 2, got {streams}: with one stream its H_pre = "
            "sigmoid(b_pre) cannot be 1, so it would not start as the residual network; the "
            "one-stream network is kind 'residual'")


def check_eps(value, owner: str, name: str, positive: bool) -> float:
    """value as a finite float, > 0 when positive (an RMS norm's epsilon: 0 divides an all-zero
    token by 0), else >= 0 (an additive epsilon: a negative one can zero a denominator); numpy
    floats included, bools not. Else a TypeError or ValueError naming what was expected."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{owner} expects {name} to be a float, got {value!r} ({type(value).__name__})"
        )
    value = float(value)
    if not math.isfinite(value) or value < 0.0 or (positive and value == 0.0):
        want = "> 0" if positive else ">= 0"
        raise ValueError(f"{owner} expects {name} to be a finite number {want}, got {value!r}")
    return value


def check_flag(value, owner: str, name: str) -> bool:
    """value if it is a bool, else a TypeError (a saved option "false" is a truthy string)."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{owner} expects {name} to be True or False, got {value!r} ({type(value).__name__})"
        )
    return value


def check_gate(value, owner: str) -> float:
    """gate_init as a finite float, else a clear error (an inf or NaN gate poisons the maps)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{owner} expects gate_init to be a float, got {value!r} ({type(value).__name__})"
        )
    if not math.isfinite(value):
        raise ValueError(f"{owner} expects a finite gate_init, got {value!r}")
    return float(value)


# id(connection) -> {(streams shape, dtype, x.is_cpu, thread): Decoder}; outside the modules,
# whose deep copies and pickles must not carry native argument blocks. A plain dict (its get
# is one C call, a WeakKeyDictionary's three Python ones); an entry leaves with its module.
_DECODERS: dict[int, dict] = {}


_MAX_DECODERS = 8  # prepared shapes kept per connection (batch sizes, threads)

# This thread's open frozen_connections blocks (.open: their numbers, the innermost last). A
# list, not one number restored on exit: blocks held by generators close in any order, and
# a generator may close its block on another thread than the one it opened it on.
_FROZEN = threading.local()
_BLOCKS = itertools.count(1)


@contextlib.contextmanager
def frozen_connections():
    """A block inside which the connections' parameters and options do not change.

    A connection's decoding call without autograd (a KV-cached step) checks that its prepared
    native calls still match its parameters (identity, storage, version) and options at
    every token. Inside this block each prepared call is checked at its first use only: at
    batch 1 the per-token checks cost 2-3% of a decoding step's tokens/s (d = 512, 8 blocks,
    one thread, 2026-12-02; benchmarks/README.md). `LM.generate` runs inside one; wrap a
    Hugging Face `model.generate(...)` in it the same way.

    The promise is the caller's: a parameter changed inside the block (an optimizer step,
    load_state_dict, an in-place write) goes unseen by the calls already checked in it, which
    go on computing with the old values until the block ends. Per thread: another thread's
    calls are checked as usual. Blocks nest (an inner one checks each call once again).
    Autograd calls, the check of the input and of the implementation in use are unaffected.
    A generator suspended inside a block leaves the block open on its thread: whatever that
    thread runs meanwhile runs inside it.
    """
    blocks = getattr(_FROZEN, "open", None)
    if blocks is None:
        blocks = _FROZEN.open = []
    block = next(_BLOCKS)
    blocks.append(block)
    try:
        yield
    finally:
        blocks.remove(block)  # this thread's list, whichever thread closes the block


# Two checks _prepared_decoder makes at every decoding call, in one Python call fewer each:
# in a decoding step this code runs out of cache, where every call costs a microsecond or
# more. torch.compiler.is_compiling() returns this flag after a call to
# torch.jit.is_scripting(); torches with a compile session hold the flag True while
# torch.compile traces, older ones only while torch.export does (there, only the function
# answers True under torch.compile).
# Dynamo must not read the flag itself: it would guard on the flag's value while tracing
# (True) and recompile at every call of the compiled code (where it is False). Marked as
# torch._dynamo.assume_constant_result marks a function (without importing dynamo, seconds at
# import), Dynamo calls it once while tracing and takes the answer, True, as a constant.
if hasattr(torch.compiler, "_compile_session_context"):
    def _compiling() -> bool:
        return torch.compiler._is_compiling_flag

    _compiling._dynamo_marked_constant = True
else:
    _compiling = torch.compiler.is_compiling

# ops.cpu.dispatch_mode_active() without its Python frame: a dispatch mode is active
_dispatch_modes = torch._C._len_torch_dispatch_stack
# torch.jit.is_tracing() without its Python frame: torch.jit.trace (and the TorchScript ONNX
# exporter) records torch ops, and a native call would leave no trace of the connection
_tracing = torch._C._is_tracing


# names -> operator.itemgetter(*names), as fast as indexing a dict once per name. A plain dict,
# not functools.cache, at which torch.compile warns (own_tensors does not use it there).
_ITEM_GETTERS: dict[tuple[str, ...], Callable] = {}


class Connection(nn.Module):
    """Shared checks and the branch call; subclasses define `maps`."""

    kind = ""
    # Ops.decoder's name for this class's maps (ops/cpu/decode.py), or None: no prepared
    # decoding path. A subclass that changes how a call mixes (forward, mix_in, mix_out,
    # _maps_and_input) loses it, since the prepared path would skip its change, unless it
    # sets decode_kind itself.
    decode_kind: str | None = None
    # False for a subclass with its own check_input: its decoding calls check every input,
    # where a prepared call would skip the check (_prepared_decoder)
    _plain_input_check = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        if "decode_kind" not in own and any(
                name in own for name in ("forward", "mix_in", "mix_out", "_maps_and_input")):
            cls.decode_kind = None
        if "check_input" in own:
            cls._plain_input_check = False

    def __init__(
        self,
        dim: int,
        streams: int,
        branch: Callable,
        check_finite: bool = False,
        impl: str = "auto",
    ):
        super().__init__()
        dim = check_count(dim, type(self).__name__, "dim", 1)
        streams = check_count(streams, type(self).__name__, "streams", 1)
        if not callable(branch):
            raise TypeError(f"{type(self).__name__} expects a callable branch, got {branch!r}")
        self.dim, self.streams, self.branch = dim, streams, branch
        self.check_finite = check_flag(check_finite, type(self).__name__, "check_finite")
        # Op implementation (torch_mhc.ops): "auto" picks by device and dtype at each call.
        self.impl = _ops.check_impl_name(impl)

    def check_input(self, x: torch.Tensor) -> None:
        """Raise a TypeError or ValueError unless x is a floating-point [..., n, C] tensor."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{type(self).__name__} expects a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(
                f"{type(self).__name__} expects a floating-point streams tensor, got {x.dtype}"
            )
        if x.dim() < 2 or x.shape[-2] != self.streams or x.shape[-1] != self.dim:
            raise ValueError(
                f"{type(self).__name__} expects a streams tensor of shape "
                f"[..., {self.streams}, {self.dim}] (n={self.streams}, C={self.dim}), "
                f"got {tuple(x.shape)}"
            )

    def _check_maps(self, *maps: torch.Tensor) -> None:
        for name, m in zip(("H_pre", "H_post", "H_res"), maps, strict=True):
            self._check_finite(name, m)

    def _check_finite(self, what: str, t: torch.Tensor) -> None:
        if not torch.isfinite(t).all():
            raise FloatingPointError(
                f"{type(self).__name__}(layer {getattr(self, 'layer_index', '?')}): "
                f"{what} contains NaN or Inf"
            )

    def check_branch_output(self, f, h_in: torch.Tensor | None = None) -> None:
        """f must be a tensor of the branch input's shape h_in [..., C]: the merge would
        broadcast another (a [..., 1] output onto every channel) in the torch
        implementations, silently."""
        if not isinstance(f, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__}: the branch must return a tensor [..., {self.dim}], "
                f"got {type(f).__name__}"
            )
        if h_in is not None and f.shape != h_in.shape:
            raise ValueError(
                f"{type(self).__name__}: the branch must return a tensor of its input's shape "
                f"{tuple(h_in.shape)}, got {tuple(f.shape)}"
            )
        if self.check_finite:
            self._check_finite("the branch output", f)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        decoding = not torch.is_grad_enabled() and self.decode_kind is not None
        if decoding and type(x) is torch.Tensor and not x.is_contiguous():
            x = x.contiguous()  # expand_streams' broadcast view, at the first connection
        # a decoding loop's usual call: a decoder prepared for exactly this x, checked first
        dec = self._prepared_decoder(x) if decoding else None
        if dec is None:
            self.check_input(x)
            if self.check_finite:
                self._check_finite("the input streams", x)
            # expand_streams' broadcast view: copy once here rather than once inside every op.
            x = x if x.is_contiguous() else x.contiguous()
            if decoding:
                dec = self._decoder(x)
        if dec is not None:  # decoding: prepared calls (ops/cpu/decode.py, ops/triton/decode.py)
            dec.busy = True  # its maps wait in its buffers for mix_out
            try:
                f = self.branch(dec.mix_in(x), *args, **kwargs)
                if type(f) is not torch.Tensor:  # (no check_finite where a decoder runs)
                    self.check_branch_output(f)
                return dec.mix_out(x, f)
            finally:
                dec.busy = False
        # recomputation keeps its tensors through saved-tensor hooks, which torch.func's
        # transforms refuse: under one the connection runs as it would without
        if (_recompute.ACTIVE is not None and torch.is_grad_enabled()
                and not func_transform_active()):
            return _recompute.ACTIVE.run(self, x, args, kwargs)
        h_in, state = self.mix_in(x)
        f = self.branch(h_in, *args, **kwargs)
        self.check_branch_output(f, h_in)
        return self.mix_out(x, f, state)

    def _prepared_decoder(self, x):
        """The decoder this connection already made for x's shape, dtype and thread, if it
        still applies to x as it is (contiguous: forward made it so; on a GPU, the
        decoder's device and stream), to the parameters and options and to the
        implementation "auto" resolves to; else None (then _decoder decides).
        A decoding step calls every connection once per token, after the branches' weights
        have pushed this connection's objects out of cache: this path reads as few of them as
        it can, and no argument checks (a decoder exists only for arguments that passed
        them)."""
        if _compiling():  # (before any dict: dynamo traces this code)
            return None
        decoders = _DECODERS.get(id(self))
        if decoders is None or type(x) is not torch.Tensor or not self._plain_input_check:
            return None
        dec = decoders.get((x.shape, x.dtype, x.is_cpu, threading.get_ident()))  # _decoder_key
        # _may_decode's checks (the trace's made above), spelled out: each call costs here
        if (dec is None or dec.busy or _diag.ACTIVE is not None or self.check_finite
                or _dispatch_modes() or _tracing() or func_transform_active()
                or dec.impl_state != _ops.impl_state(self.impl)
                or (dec.checks_each_call and not dec.runs_on(x))):  # a GPU's stream, autocast
            return None
        blocks = getattr(_FROZEN, "open", None)
        block = blocks[-1] if blocks else 0  # the innermost open frozen_connections block
        if block and dec.frozen_in == block:  # checked at its first call in this block
            return dec
        # the key vouches for x's shape and dtype, so only the parameters and options are
        # compared; the decoder runs on this x, so decode_args must pass x itself
        args = self.decode_args(x)
        if args[0] is not x or not dec.params_current(args):
            return None
        dec.frozen_in = block
        return dec

    def _may_decode(self) -> bool:
        """False while diagnostics record the maps or check_finite checks them (the prepared
        path returns neither), under a trace (torch.compile's or torch.jit's) or a dispatch
        mode (they need the ops' custom ops and autograd Functions), and under a torch.func
        transform.
        _prepared_decoder spells the same checks out."""
        return (_diag.ACTIVE is None and not self.check_finite and not _compiling()
                and not _dispatch_modes() and not _tracing() and not func_transform_active())

    def _decoder(self, x: torch.Tensor):
        """The implementation's prepared no-autograd path for x (Ops.decoder), kept per
        streams shape, dtype and thread while it matches the parameters; None where there
        is none, and while diagnostics record the maps or check_finite checks them (the
        prepared path returns neither)."""
        if not self._may_decode():
            return None
        ops = _ops.get_impl(self.impl, x.device, x.dtype)
        if ops.decoder is None:
            return None
        args = self.decode_args(x)
        if args[0] is not x:  # the decoder would be built for another tensor than it runs on
            return None
        decoders = _DECODERS.get(id(self))
        if decoders is None:
            decoders = _DECODERS[id(self)] = {}
            weakref.finalize(self, _DECODERS.pop, id(self), None)
        key = _decoder_key(x)
        dec = decoders.get(key)
        if dec is not None and dec.busy:  # called again from its own branch: the ops' path
            return None
        state = _ops.impl_state(self.impl)
        if dec is None or dec.impl_state != state or not dec.current(args):
            new = ops.decoder(self.decode_kind, args)
            if new is None:  # this call only, maybe (autocast, another stream): an earlier
                return None  # decoder stays, checked again at the next call
            if key not in decoders and len(decoders) >= _MAX_DECODERS:
                del decoders[next(iter(decoders))]  # the oldest shape
            dec = decoders[key] = new
            dec.impl_state = state
        return dec

    def own_tensors(self, names: tuple[str, ...]) -> tuple:
        """The parameters (or buffers) called names (two or more), read from _parameters
        where they all are: Module.__getattr__ costs a decoding step time. Otherwise (a
        parametrization or a subclass moved one, or one is a buffer) the attributes; so too
        under torch.compile, which traces attributes but cannot call a stored itemgetter."""
        if _compiling():
            return tuple(getattr(self, name) for name in names)
        getter = _ITEM_GETTERS.get(names)
        if getter is None:
            getter = _ITEM_GETTERS[names] = operator.itemgetter(*names)
        try:
            return getter(self._parameters)
        except KeyError:
            return tuple(getattr(self, name) for name in names)

    def decode_args(self, x: torch.Tensor) -> tuple:
        """Ops.decoder's arguments for x: the maps op's (map_args), x first."""
        return self.map_args(x)

    def mix_in(self, x: torch.Tensor):
        """Maps and pre-aggregation: x [..., n, C] -> (h_in [..., C], state for mix_out)."""
        ops = _ops.get_impl(self.impl, x.device, x.dtype)
        h_pre, h_post, h_res, h_in, x_for_merge = self._maps_and_input(ops, x)
        if self.check_finite:
            self._check_maps(h_pre, h_post, h_res)
        if _diag.ACTIVE is not None and not _diag.in_backward():  # a replay recorded already
            _diag.ACTIVE.record(self, h_res, x=x, h_pre=h_pre, h_post=h_post)
        return h_in, (ops, h_post, h_res, x_for_merge)

    def mix_out(self, x: torch.Tensor, f: torch.Tensor, state) -> torch.Tensor:
        """Post-and-merge: H_res x + H_post^T f -> [..., n, C]."""
        ops, h_post, h_res, x_for_merge = state
        if x_for_merge is not None:  # x's gradient through the merge joins the maps' one dx
            return ops.post_merge(x_for_merge, f, h_post, h_res, fused_dx=True)
        return ops.post_merge(x, f, h_post, h_res)

    def _maps_and_input(self, ops, x: torch.Tensor):
        """(H_pre, H_post, H_res, branch input, x_for_merge or None) under implementation
        ops."""
        raise NotImplementedError

    def no_weight_decay(self) -> set[str]:
        """Names (relative to this module) of the static maps and gates."""
        return set()

    def reset_parameters(self) -> None:
        """Give this connection's own parameters their documented initial values (the branch
        is left alone: it has its own). For a model built on the meta device and then moved
        with `to_empty`, and for parameters sharded by FSDP2 or TP (DTensors)."""

    def extra_repr(self) -> str:
        return f"dim={self.dim}, streams={self.streams}"


def prepared_decoder(conn: Connection, x: torch.Tensor):
    """The prepared decoding path (Ops.decoder's Decoder) that conn keeps for streams of x's
    shape, dtype and kind of device on this thread, or None: for tools and tests that check
    a decoding call took it."""
    return _DECODERS.get(id(conn), {}).get(_decoder_key(x))


def _decoder_key(x: torch.Tensor) -> tuple:
    """A connection's decoders' key: the streams' shape, dtype and kind of device, and the
    thread (Connection._prepared_decoder's lookup, run at every token, spells it out)."""
    return x.shape, x.dtype, x.is_cpu, threading.get_ident()


def assign_parameter(param: torch.Tensor, value: torch.Tensor) -> None:
    """param <- value (the full tensor, built on the CPU), in param's dtype and device.

    A DTensor parameter (FSDP2, TP) takes its own shard of value: every rank builds the same
    full value, so no rank needs to send anything (src_data_rank=None). A meta parameter stays
    meta (copying into it does nothing).
    """
    with torch.no_grad():
        if param.is_meta:
            return
        value = value.to(device=param.device, dtype=param.dtype)
        if _is_dtensor(param):
            from torch.distributed.tensor import distribute_tensor

            value = distribute_tensor(
                value, param.device_mesh, param.placements, src_data_rank=None
            )
        param.copy_(value)


def _is_dtensor(t: torch.Tensor) -> bool:
    # Checked by name first: importing torch.distributed.tensor for a plain tensor costs time.
    if type(t).__name__ != "DTensor":
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def pre_bias(n: int, layer_index: int) -> torch.Tensor:
    """b_pre with sigmoid(b_pre) = e_{k mod n} / 2 + 1 / (2n), which sums to 1."""
    p = torch.full((n,), 0.5 / n, dtype=torch.float64)
    p[layer_index % n] += 0.5
    return torch.logit(p.clamp(max=0.99)).float()


def res_bias(n: int, diag: float) -> torch.Tensor:
    """b_res whose Sinkhorn projection is diag on the diagonal and equal elsewhere."""
    if n == 1:
        return torch.zeros(1, 1)
    return torch.eye(n) * math.log(diag * (n - 1) / (1.0 - diag))
