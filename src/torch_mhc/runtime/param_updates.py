"""A count of the parameter updates torch's versions miss, for the caches of tables made
from parameters: the optimizer steps taken in this process, and the caller's word.

The no-autograd paths of the CPU ops keep tables made from a connection's parameters (phi
padded, the gates in one row) and reuse them while every parameter is the same tensor at
the same version. torch's fused optimizers (`AdamW(fused=True)`, which transformers.Trainer
uses by default, and the fused Adam, SGD and Adagrad) write the parameters without counting
it in their versions (torch 2.13), and an optimizer outside torch may do the same. So the
caches also compare `COUNT`: every `step()` of a `torch.optim.Optimizer` (any subclass)
changes it, through global step hooks registered the first time a cache asks for the count
(`current()`), so that importing torch_mhc changes nothing in torch.

A write into `param.data` outside an optimizer (`p.data -= lr * p.grad`, an EMA written
that way) is counted in no version either, and no hook sees it: write into the parameter
under `torch.no_grad()` instead, or call `torch_mhc.parameters_changed()` after such writes.
"""

from __future__ import annotations

import threading

__all__ = ["COUNT", "current", "parameters_changed"]

COUNT = 0  # read directly by the decoding path, where a function call costs
_hooks: tuple | None = None
_lock = threading.Lock()


def _count(optimizer, args, kwargs) -> None:
    """Both before and after a step: a cache made while a step runs (on another thread)
    is made stale by the step's end, and a step that fails half-way has counted already."""
    global COUNT
    COUNT += 1


def current() -> int:
    """The count now, registering the hooks on the first call."""
    global _hooks
    if _hooks is None:
        from torch.optim import optimizer  # torch.optim leaves the module out of its names

        with _lock:
            if _hooks is None:
                _hooks = (optimizer.register_optimizer_step_pre_hook(_count),
                          optimizer.register_optimizer_step_post_hook(_count))
    return COUNT


def parameters_changed() -> None:
    """Say that parameters changed in a way torch does not count (a write into `param.data`):
    every connection's cached tables and prepared decoding calls are made again at their next
    call (inside an open `frozen_connections()` block, calls already checked there keep theirs
    until it ends: the block is the caller's promise that nothing changes). Optimizer steps,
    load_state_dict and in-place writes under torch.no_grad() need no call."""
    global COUNT
    COUNT += 1
