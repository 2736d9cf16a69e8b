"""Checks of the ops' scalar arguments, shared by every implementation, and the errors for
an implementation that does not exist or cannot run where it is asked to.

A kernel takes sinkhorn_iters as a loop count and writes 2 * iters normalisers per token to a
scratch buffer: zero iterations would index past an empty buffer, so the ops refuse it rather
than trusting every caller (a module checks its own configuration; a direct caller of an op
does not). The epsilons enter a square root, a sum or a denominator: a negative or non-finite
one gives NaN maps or Sinkhorn denominators that are no longer positive. The parameters'
shapes are checked against the streams for the same reason: the native loops and the kernels
index phi (or W) by n and C without bounds, so a misshapen one would be read past its end.
The fused backwards compute first derivatives only (first_derivatives_only).
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

__all__ = ["ImplUnavailableError", "UnknownImplError", "check_hc_scalars", "check_hc_shapes",
           "check_maps_scalars", "check_mhc_shapes", "check_sinkhorn_scalars",
           "first_derivatives_only"]


class UnknownImplError(ValueError):
    """An op implementation's name that is none of them (an argument, or TORCH_MHC_IMPL)."""


class ImplUnavailableError(RuntimeError):
    """An op implementation asked for where it cannot run (the triton ops on CPU tensors)."""


def first_derivatives_only(impl: str):
    """A fused backward (autograd.Function.backward, or an op's registered autograd) that
    refuses to run where autograd builds a graph of it (grad mode on inside a backward:
    create_graph=True). Its kernels' results are constants to autograd, so a second derivative
    taken through them (double backward: gradient penalties, Hessian-vector products) would
    come out wrong without a word, or fail later on "does not require grad"."""
    def decorate(backward):
        @functools.wraps(backward)
        def checked(*args, **kwargs):
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"torch_mhc's {impl!r} ops compute first derivatives only: a backward "
                    "with create_graph=True (double backward: gradient penalties, "
                    "Hessian-vector products) needs the connections built with "
                    "impl=\"reference\" (or TORCH_MHC_IMPL=reference for impl=\"auto\")"
                )
            return backward(*args, **kwargs)
        return checked
    return decorate


def _number(op: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op} expects {name} to be a number, got {value!r}")


def _positive_int(op: str, name: str, value) -> None:
    _number(op, name, value)
    if not math.isfinite(value) or int(value) != value or value < 1:
        raise ValueError(f"{op} expects {name} to be an integer >= 1, got {value!r}")


def _non_negative(op: str, name: str, value) -> None:
    _number(op, name, value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{op} expects {name} to be a finite number >= 0, got {value!r}")


def _positive(op: str, name: str, value) -> None:
    _number(op, name, value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{op} expects {name} to be a finite number > 0, got {value!r}")


def check_maps_scalars(op: str, sinkhorn_iters, norm_eps, sinkhorn_eps=0.0, pre_eps=0.0) -> None:
    """ValueError unless sinkhorn_iters >= 1, norm_eps > 0, sinkhorn_eps and pre_eps >= 0."""
    _positive_int(op, "sinkhorn_iters", sinkhorn_iters)
    _positive(op, "norm_eps", norm_eps)
    _non_negative(op, "sinkhorn_eps", sinkhorn_eps)
    _non_negative(op, "pre_eps", pre_eps)


def check_hc_scalars(op: str, norm_eps) -> None:
    """ValueError unless norm_eps > 0 (finite)."""
    _positive(op, "norm_eps", norm_eps)


def check_sinkhorn_scalars(op: str, iters, eps) -> None:
    """ValueError unless iters >= 1 and eps >= 0 (finite)."""
    _positive_int(op, "iters", iters)
    _non_negative(op, "eps", eps)


def _shapes(op: str, x, named: dict) -> None:
    for name, (t, shape) in named.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{op} expects {name} of shape {shape} for streams x of shape "
                             f"{tuple(x.shape)}, got {tuple(t.shape)}")


def check_mhc_shapes(op: str, x, phi, alpha, b_pre, b_post, b_res) -> None:
    """ValueError unless, for streams x [..., n, C]: phi [n C, n n + 2 n], alpha [3],
    b_pre [n], b_post [n], b_res [n, n]."""
    n, c = x.shape[-2:]
    _shapes(op, x, {"phi": (phi, (n * c, n * n + 2 * n)), "alpha": (alpha, (3,)),
                    "b_pre": (b_pre, (n,)), "b_post": (b_post, (n,)), "b_res": (b_res, (n, n))})


def check_hc_shapes(op: str, x, w, s_alpha, s_beta, static_pre, static_post, static_res) -> None:
    """ValueError unless, for streams x [..., n, C]: W [C, n + 2] (or None: static maps),
    one-element s_alpha and s_beta, static_pre [n], static_post [n], static_res [n, n]."""
    n, c = x.shape[-2:]
    named = {"static_pre": (static_pre, (n,)), "static_post": (static_post, (n,)),
             "static_res": (static_res, (n, n))}
    if w is not None:
        named["w"] = (w, (c, n + 2))
    _shapes(op, x, named)
    for name, t in (("s_alpha", s_alpha), ("s_beta", s_beta)):
        if t.numel() != 1:
            raise ValueError(f"{op} expects {name} to hold one number, got shape {tuple(t.shape)}")
