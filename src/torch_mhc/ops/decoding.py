"""What every implementation's prepared decoding path shares: when a Decoder still applies.

A Decoder (ops/cpu/decode.py: native calls; ops/triton/decode.py: Triton launches) does a
connection's argument work once per streams shape and reuses it at every decoding call.
`current(args)` says whether it still describes the arguments: x of the shape, dtype and
device it was built for, the same parameter objects over the same storage at the same
version (load_state_dict or any in-place op on a parameter bumps the version;
`param.data = ...` swaps the storage), no optimizer step since it was made (torch's fused
optimizers bump no version: runtime.param_updates) and equal options. Not seen: a write into
`param.data` (`p.data.copy_(...)`) outside an optimizer, which torch does not count, until
`torch_mhc.parameters_changed()` says so.
"""

from __future__ import annotations

import torch

from torch_mhc.runtime import param_updates

__all__ = ["PreparedDecoder", "param_marks"]


def param_marks(params: tuple) -> tuple[list, int, tuple]:
    """What `current` compares (besides the optimizer steps): each tensor's identity (a view
    counts as its base: the DeepSeek-V4 connection passes slices of its `base` made at each
    call; the Decoder keeps the bases alive, so an identity cannot pass to a new tensor),
    storage and version; then the trailing options (the map arguments after the last tensor:
    iterations, epsilons) as one tuple, from their position on.
    Raises RuntimeError for parameters made in inference mode (no version to compare)."""
    last = max(i for i, t in enumerate(params) if isinstance(t, torch.Tensor))
    tensors = [(i, t if t._base is None else t._base, t.data_ptr(), t._version)
               for i, t in enumerate(params[:last + 1], start=1)  # x is argument 0
               if isinstance(t, torch.Tensor)]
    return tensors, last + 2, tuple(params[last + 1:])


class PreparedDecoder:
    """The bookkeeping of one connection's prepared decoding path for streams of one shape,
    dtype and device; subclasses add mix_in(x) -> a and mix_out(x, f) -> out, and say in
    `runs_on` which tensors their calls take."""

    __slots__ = ("size", "dtype", "steps", "tensor_marks", "options_from", "options", "busy",
                 "impl_state", "frozen_in")
    # whether Connection asks runs_on(x) at every call (a GPU's current stream, autocast), or
    # only when it builds or checks the decoder (the CPU's: x's key says it all)
    checks_each_call = True

    def __init__(self, x: torch.Tensor, params: tuple):
        self.steps = param_updates.current()  # before any tables: a step after is seen
        self.size, self.dtype = x.shape, x.dtype
        self.tensor_marks, self.options_from, self.options = param_marks(params)
        self.busy = False  # between mix_in and mix_out (Connection.forward sets it)
        self.impl_state = None  # ops.impl_state when made (Connection sets it)
        # the frozen_connections block in which Connection last checked it (0: none)
        self.frozen_in = 0

    def runs_on(self, x: torch.Tensor) -> bool:
        """Whether this decoder's calls take x's device (and, on a GPU, its current stream)."""
        raise NotImplementedError

    def current(self, args: tuple) -> bool:
        """Whether this Decoder computes the maps of args (see the module docstring)."""
        x = args[0]
        if x.shape != self.size or x.dtype is not self.dtype or not x.is_contiguous() \
                or not self.runs_on(x):
            return False
        return self.params_current(args)

    def params_current(self, args: tuple) -> bool:
        """current(args) for an x already known to be a contiguous tensor of the shape,
        dtype and device this Decoder was built for (Connection found it under that key):
        inside a decoding step every read of a cold tensor attribute costs, and x's were
        made."""
        if param_updates.COUNT != self.steps:
            return False
        for i, base, ptr, version in self.tensor_marks:
            t = args[i]
            if (t is not base and t._base is not base) or t._version != version \
                    or t.data_ptr() != ptr:
                return False
        return args[self.options_from:] == self.options
