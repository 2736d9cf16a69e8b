"""The `inductor` implementation: the reference ops compiled by torch.compile (Inductor).

The same functions as functional.maps (the definition), each compiled as one graph with
fullgraph=True: Inductor fuses the elementwise work and the Sinkhorn loop into a few
generated kernels (Triton on CUDA, C++/OpenMP on CPU), and autograd through the graph gives
the reference's exact gradients. A second GPU path beside the hand-written Triton kernels
(`impl="triton"`), and a comparator for them in `mhc bench`.

Selecting it: impl="inductor" (connections, models, `get_impl`), or TORCH_MHC_IMPL=inductor.
Nothing compiles when this module is imported: torch.compile wraps the functions here, and
the first call of each op (per input shape class, dtype and device) compiles it.

Meta tensors, and calls under a dispatch mode (FakeTensorMode, FlopCounterMode), run the
reference functions uncompiled: there is nothing to compile for tensors without memory (the
compiler stopped with BackendCompilerFailed on meta tensors and an assertion under
FakeTensorMode), and the maths and shapes are the same.
"""

from __future__ import annotations

import functools

import torch

from torch_mhc.functional import maps as _ref
from torch_mhc.ops.checks import check_hc_scalars, check_maps_scalars, check_sinkhorn_scalars

__all__ = ["hc_maps", "mhc_maps", "mhc_maps_pre", "post_merge", "pre_aggregate", "sinkhorn"]


def _maps_pre(x, phi, alpha, b_pre, b_post, b_res, sinkhorn_iters=20, norm_eps=1e-6,
              sinkhorn_eps=0.0, pre_eps=0.0):
    """mhc_maps then pre_aggregate in one graph (the maps' x read fused with the aggregation's)."""
    h_pre, h_post, h_res = _ref.mhc_maps(x, phi, alpha, b_pre, b_post, b_res, sinkhorn_iters,
                                         norm_eps, sinkhorn_eps, pre_eps)
    return h_pre, h_post, h_res, _ref.pre_aggregate(x, h_pre)


def _sinkhorn(logits, iters=20, *, eps=0.0):
    return _ref.sinkhorn(logits, iters, eps=eps)


def _compile(fn):
    # dynamic=None: the first call specialises on shapes, a second token count makes the
    # token dimension dynamic (decoding changes it every step).
    return torch.compile(fn, fullgraph=True, dynamic=None)


def _compiled_or_plain(fn):
    """fn compiled, but for meta tensors and under a dispatch mode (the module docstring):
    fn itself there. Inside a torch.compile trace (a model compiled around these ops) the
    compiled function, which Dynamo inlines (the checks are not traced)."""
    compiled = _compile(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not torch.compiler.is_compiling() and (
                torch._C._len_torch_dispatch_stack() > 0
                or any(isinstance(a, torch.Tensor) and a.is_meta for a in args)):
            return fn(*args, **kwargs)
        return compiled(*args, **kwargs)

    return call


_mhc_maps, _mhc_maps_pre = _compiled_or_plain(_ref.mhc_maps), _compiled_or_plain(_maps_pre)
_hc_maps, _sinkhorn_compiled = _compiled_or_plain(_ref.hc_maps), _compiled_or_plain(_sinkhorn)
pre_aggregate = _compiled_or_plain(_ref.pre_aggregate)
post_merge = _compiled_or_plain(_ref.post_merge)


# The scalar checks run before the compiled graphs (ops/checks.py says why they exist).
def mhc_maps(x, phi, alpha, b_pre, b_post, b_res, sinkhorn_iters=20, norm_eps=1e-6,
             sinkhorn_eps=0.0, pre_eps=0.0):
    check_maps_scalars("mhc_maps", sinkhorn_iters, norm_eps, sinkhorn_eps, pre_eps)
    return _mhc_maps(x, phi, alpha, b_pre, b_post, b_res, sinkhorn_iters, norm_eps,
                     sinkhorn_eps, pre_eps)


def mhc_maps_pre(x, phi, alpha, b_pre, b_post, b_res, sinkhorn_iters=20, norm_eps=1e-6,
                 sinkhorn_eps=0.0, pre_eps=0.0):
    check_maps_scalars("mhc_maps_pre", sinkhorn_iters, norm_eps, sinkhorn_eps, pre_eps)
    return _mhc_maps_pre(x, phi, alpha, b_pre, b_post, b_res, sinkhorn_iters, norm_eps,
                         sinkhorn_eps, pre_eps)


def hc_maps(x, w, s_alpha, s_beta, static_pre, static_post, static_res, norm_eps=1e-6):
    check_hc_scalars("hc_maps", norm_eps)
    return _hc_maps(x, w, s_alpha, s_beta, static_pre, static_post, static_res, norm_eps)


def sinkhorn(logits, iters=20, *, eps=0.0):
    check_sinkhorn_scalars("sinkhorn", iters, eps)
    return _sinkhorn_compiled(logits, iters, eps=eps)
