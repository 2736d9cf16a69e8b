"""Building connections by kind, the stream expansion and reduction around a stack of them,
and the optimizer's parameter groups."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable

import torch
from torch import nn

from torch_mhc.connections.base import (
    Connection,
    check_count,
    check_eps,
    check_mixing_streams,
)
from torch_mhc.connections.hc import HyperConnection
from torch_mhc.connections.mhc import ManifoldHyperConnection
from torch_mhc.connections.residual import Residual
from torch_mhc.connections.successors import (
    VARIANT_KINDS,
    KromHC,
    MHCLite,
    MHCStaticRes,
    make_variant,
)

__all__ = [
    "CONNECTION_KINDS",
    "check_streams",
    "connection_options",
    "expand_streams",
    "make_connection",
    "param_groups",
    "reduce_streams",
]

# the core kinds, then mHC's successors (torch_mhc.connections.successors)
CONNECTION_KINDS = ("residual", "hc", "mhc", *VARIANT_KINDS)

_SUCCESSORS = {cls.kind: cls for cls in (MHCLite, KromHC, MHCStaticRes)}
_CLASSES = {"residual": Residual, "hc": HyperConnection, "mhc": ManifoldHyperConnection,
            **_SUCCESSORS}
# what make_connection passes itself, not options
_POSITIONAL = {"self", "dim", "streams", "layer_index", "branch"}


def expand_streams(h: torch.Tensor, n: int) -> torch.Tensor:
    """[..., C] -> [..., n, C]: every stream starts as a copy of h (a broadcast view)."""
    n = check_count(n, "expand_streams", "n", 1)
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"expand_streams expects a tensor [..., C], got {type(h).__name__}")
    if h.dim() < 1:
        raise ValueError("expand_streams expects a tensor [..., C], got a scalar")
    return h.unsqueeze(-2).expand(*h.shape[:-1], n, h.shape[-1])


def reduce_streams(x: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """[..., n, C] -> [..., C]: the mean of the streams.

    The HC paper sums the streams; the mean differs by the factor n, which the final norm of
    a Pre-Norm network removes, and it makes an initialised network equal to the residual one.
    n: the number of streams, checked against x's dimension -2 when given (a [B, T, C]
    tensor would otherwise be averaged over T without a word).
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"reduce_streams expects a floating-point streams tensor, got {got}")
    if x.dim() < 2:
        raise ValueError(
            f"reduce_streams expects a streams tensor [..., n, C], got {tuple(x.shape)}"
        )
    if n is not None and x.shape[-2] != check_count(n, "reduce_streams", "n", 1):
        raise ValueError(
            f"reduce_streams expects a streams tensor [..., {n}, C] ({n} streams), got "
            f"{tuple(x.shape)} (expand_streams(h, {n}) makes one from h [..., C])"
        )
    return x.mean(dim=-2)


def make_connection(
    kind: str, dim: int, streams: int, layer_index: int, branch: Callable, **kwargs
) -> nn.Module:
    """Build a connection from a string: one of CONNECTION_KINDS.

    `streams` is ignored for "residual" (always one stream); kwargs go to the class. Every
    kind takes check_finite and impl (the residual has no maps for impl to choose the ops of),
    so one call serves every kind; an option the kind does not take is a TypeError naming the
    options it does.
    """
    if not isinstance(kind, str) or kind not in _CLASSES:
        raise ValueError(f"unknown connection kind {kind!r}; expected one of {CONNECTION_KINDS}")
    _check_options(kind, kwargs)
    if kind == "residual":
        return Residual(dim, branch, layer_index=layer_index, **kwargs)
    if kind == "hc":
        return HyperConnection(dim, streams, layer_index, branch, **kwargs)
    if kind == "mhc":
        return ManifoldHyperConnection(dim, streams, layer_index, branch, **kwargs)
    return make_variant(kind, dim, streams, layer_index, branch, **kwargs)


def connection_options(kind: str) -> tuple[str, ...]:
    """The keyword options make_connection takes for `kind` (one of CONNECTION_KINDS): its
    class's constructor parameters other than those make_connection passes itself."""
    params = inspect.signature(_CLASSES[kind].__init__).parameters.values()
    return tuple(p.name for p in params if p.name not in _POSITIONAL
                 and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def _check_options(kind: str, kwargs: dict) -> None:
    """TypeError unless every option is one the kind's class takes (Python's own message
    names the successors' shared base, MhcResVariant.__init__)."""
    cls, takes = _CLASSES[kind], connection_options(kind)
    unknown = sorted(set(kwargs) - set(takes))
    if unknown:
        raise TypeError(f"make_connection: {kind!r} ({cls.__name__}) takes no option(s) "
                        f"{unknown}{option_hints(unknown, takes)}; its options: "
                        f"{', '.join(takes)}")


def option_hints(unknown: Iterable[str], takes: Iterable[str]) -> str:
    """' (sinkhorn_iter: did you mean sinkhorn_iters?)' for each unknown option name close to
    one of takes; '' for none."""
    takes = list(takes)
    close = {u: difflib.get_close_matches(u, takes, n=1) for u in unknown}
    return "".join(f" ({u}: did you mean {c[0]}?)" for u, c in close.items() if c)


def check_streams(kind: str, n: int) -> None:
    """Raise a ValueError if connection kind `kind` cannot use n streams (a no-op for the
    kinds that take any n: the residual, which has one, and HC)."""
    if kind == "mhc" or kind in _SUCCESSORS:
        check_mixing_streams(n, _CLASSES[kind].__name__)
    if kind in _SUCCESSORS:
        _SUCCESSORS[kind].check_streams(n)


def param_groups(
    model: nn.Module, weight_decay: float = 0.1, extra_no_decay: Iterable[str] = ()
) -> list[dict]:
    """AdamW parameter groups: connection static maps and gates without weight decay.

    Also exempt (the usual practice for transformers): every parameter with fewer than two
    dimensions (biases, norm weights) and the parameters extra_no_decay names, by their full
    names in model.named_parameters() ("wpe.weight"); a name that is none of them is a
    ValueError (it would exempt nothing, silently).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"param_groups expects an nn.Module (the model; wrap a list of modules in "
            f"nn.ModuleList), got {type(model).__name__}"
        )
    weight_decay = check_eps(weight_decay, "param_groups", "weight_decay", positive=False)
    no_decay_ids = set()
    for module in model.modules():
        if isinstance(module, Connection):
            for name in module.no_weight_decay():
                no_decay_ids.add(id(getattr(module, name)))
    if isinstance(extra_no_decay, str):
        raise TypeError(f"param_groups expects extra_no_decay to be a list of parameter names, "
                        f"got the string {extra_no_decay!r}")
    extra = set(extra_no_decay)
    named = list(model.named_parameters(remove_duplicate=False))  # a tied weight's every name
    extra_ids = {id(p) for name, p in named if name in extra}
    unknown = extra - {name for name, _ in named}
    if unknown:
        raise ValueError(
            f"param_groups: extra_no_decay names no parameter of the model: "
            f"{sorted(unknown)}; expected full names from model.named_parameters(), e.g. "
            f"{next((n for n, _ in model.named_parameters()), 'none')!r}")
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in no_decay_ids or p.dim() < 2 or id(p) in extra_ids:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
