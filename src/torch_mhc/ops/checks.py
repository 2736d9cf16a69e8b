"""Checks of the ops' scalar arguments, shared by every implementation.

A kernel takes sinkhorn_iters as a loop count and writes 2 * iters normalisers per token to a
scratch buffer: zero iterations would index past an empty buffer, so the ops refuse it rather
than trusting every caller (a module checks its own configuration; a direct caller of an op
does not). The epsilons enter a square root, a sum or a denominator: a negative or non-finite
one gives NaN maps or Sinkhorn denominators that are no longer positive.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["check_hc_scalars", "check_maps_scalars", "check_sinkhorn_scalars"]


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
