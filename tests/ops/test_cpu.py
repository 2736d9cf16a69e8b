"""The `cpu` op implementation against `functional.maps`, and the implementation selection.

Forward values and the gradients of every input and parameter, with random upstream
gradients, on awkward shapes (C = 100, n = 3, 4, 8, odd token counts), in fp32 and bf16.
"""

import functools
import hashlib
import math
import os
import select
import shlex
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import torch_mhc.ops as ops
from tests.helpers.op_cases import (
    TOL,
    Branch,
    assert_close,
    clone_inputs,
    compiled_and_eager,
    maps_inputs,
    merge_inputs,
    perturbed,
    run,
)
from tests.helpers.references import sinkhorn_log_naive
from torch_mhc import HyperConnection, ManifoldHyperConnection, expand_streams, sinkhorn_unrolled
from torch_mhc.functional import maps as reference
from torch_mhc.functional.sinkhorn import LINEAR_RANGE
from torch_mhc.functional.successors import res_count
from torch_mhc.ops.cpu import build as native_build
from torch_mhc.ops.cpu import native
from torch_mhc.ops.cpu import ops as cpu


def _need_native():
    if native.load() is None:
        pytest.skip("native CPU library unavailable")


@pytest.fixture(params=["native", "torch"])
def cpu_path(request, monkeypatch):
    """Run a test on the native loops and again on the pure-torch fallback."""
    if request.param == "native":
        if native.load() is None:
            pytest.skip("native CPU library unavailable (no C compiler, or TORCH_MHC_NATIVE=0)")
    else:
        monkeypatch.setattr(cpu, "_native_available", lambda: False)
    return request.param


# ---------------------------------------------------------------------------------------------
# (a) maps, (d) Sinkhorn
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "tokens, n, c",
    [((7,), 4, 100), ((2, 5), 3, 100), ((63,), 8, 16), ((1,), 1, 8), ((5,), 2, 33),
     ((9,), 5, 24), ((18,), 6, 16), ((17,), 7, 16)],  # phi's gradient in 2 and 3 row blocks
)
def test_mhc_maps_match_reference(tokens, n, c, dtype, cpu_path):
    inputs = maps_inputs(tokens, n, c, dtype)
    out_ref, grad_ref = run(reference.mhc_maps, inputs)
    out_cpu, grad_cpu = run(cpu.mhc_maps, clone_inputs(inputs))
    maps_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for a, e in zip(out_cpu, out_ref, strict=True):
        assert a.dtype == e.dtype == maps_dtype
        assert_close(a, e, TOL[maps_dtype])
    for a, e, name in zip(grad_cpu, grad_ref, ("x", "phi", "alpha", "b_pre", "b_post", "b_res"),
                          strict=True):
        assert a.dtype == e.dtype, name
        assert_close(a, e, TOL[dtype] if name == "x" or dtype == torch.float64 else 1e-4)


def _maps_then_pre(*args, **kw):
    h_pre, h_post, h_res = reference.mhc_maps(*args, **kw)
    return h_pre, h_post, h_res, reference.pre_aggregate(args[0], h_pre)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("tokens, n, c", [((7,), 4, 100), ((3, 21), 3, 100), ((63,), 8, 16)])
def test_fused_maps_and_pre_aggregation_match_reference(tokens, n, c, dtype, cpu_path):
    """mhc_maps_pre: one node whose backward writes dx once (maps' and aggregation's shares)."""
    inputs = maps_inputs(tokens, n, c, dtype, seed=5)
    kw = dict(sinkhorn_iters=7, pre_eps=1e-2)
    out_ref, grad_ref = run(lambda *a: _maps_then_pre(*a, **kw), inputs)
    out_cpu, grad_cpu = run(lambda *a: cpu.mhc_maps_pre(*a, **kw), clone_inputs(inputs))
    maps_tol = 1e-12 if dtype == torch.float64 else 2e-5
    for a, e, tol in zip(out_cpu, out_ref, (maps_tol,) * 3 + (TOL[dtype],), strict=True):
        assert a.dtype == e.dtype
        assert_close(a, e, tol)
    for a, e, name in zip(grad_cpu, grad_ref, ("x", "phi", "alpha", "b_pre", "b_post", "b_res"),
                          strict=True):
        assert a.dtype == e.dtype, name
        # bf16: the reference rounds H_pre to bf16 before aggregating; the cpu path does not.
        exact = name == "x" or dtype != torch.float32
        assert_close(a, e, TOL[dtype] if exact else 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens, n, c", [((7,), 4, 100), ((3, 21), 3, 100), ((63,), 8, 16), ((5,), 1, 33),
                     ((5,), 9, 16)],  # n = 9: more streams than the native loops take
)
def test_fused_dx_maps_and_merge_match_reference(tokens, n, c, dtype, cpu_path):
    """mhc_maps_pre(fused_dx=True) + post_merge(x_for_merge, fused_dx=True), around a branch:
    the merge's share of x's gradient goes through the maps node (one dx)."""
    inputs = maps_inputs(tokens, n, c, dtype, seed=7)
    f_extra = torch.randn(*tokens, c, generator=torch.Generator().manual_seed(8))
    f_extra = f_extra.to(dtype).requires_grad_()

    def ref(x, *rest):
        *params, extra = rest
        h_pre, h_post, h_res = reference.mhc_maps(x, *params, sinkhorn_iters=7)
        a = reference.pre_aggregate(x, h_pre)
        return reference.post_merge(x, torch.tanh(a) + extra, h_post, h_res), a

    def fused(x, *rest):
        *params, extra = rest
        _, h_post, h_res, a, x_for_merge = cpu.mhc_maps_pre(x, *params, sinkhorn_iters=7,
                                                            fused_dx=True)
        return cpu.post_merge(x_for_merge, torch.tanh(a) + extra, h_post, h_res, fused_dx=True), a

    out_ref, grad_ref = run(ref, [*inputs, f_extra])
    out_cpu, grad_cpu = run(fused, clone_inputs([*inputs, f_extra]))
    for a, e in zip(out_cpu, out_ref, strict=True):
        assert a.dtype == e.dtype == dtype
        assert_close(a, e, TOL[dtype])
    names = ("x", "phi", "alpha", "b_pre", "b_post", "b_res", "f")
    for a, e, name in zip(grad_cpu, grad_ref, names, strict=True):
        assert a.dtype == e.dtype, name
        assert_close(a, e, TOL[dtype])


@pytest.mark.parametrize("tokens, n, c", [((7,), 4, 100), ((9,), 3, 16), ((5,), 9, 16)])
def test_fused_dx_merge_with_h_res_used_elsewhere_matches_reference(tokens, n, c, cpu_path):
    """With fused_dx the maps' backward adds the merge's dH_res = <g_i, x_j> to what
    H_res receives from elsewhere: here H_res is also an output of the loss."""
    inputs = maps_inputs(tokens, n, c, torch.float32, seed=9)

    def ref(x, *params):
        h_pre, h_post, h_res = reference.mhc_maps(x, *params, sinkhorn_iters=7)
        a = reference.pre_aggregate(x, h_pre)
        return reference.post_merge(x, torch.tanh(a), h_post, h_res), h_res

    def fused(x, *params):
        _, h_post, h_res, a, x_for_merge = cpu.mhc_maps_pre(x, *params, sinkhorn_iters=7,
                                                            fused_dx=True)
        return cpu.post_merge(x_for_merge, torch.tanh(a), h_post, h_res, fused_dx=True), h_res

    out_ref, grad_ref = run(ref, inputs)
    out_cpu, grad_cpu = run(fused, clone_inputs(inputs))
    for a, e in zip(out_cpu, out_ref, strict=True):
        assert_close(a, e, TOL[torch.float32])
    assert len(grad_cpu) == 6  # x, phi, alpha, b_pre, b_post, b_res
    for a, e in zip(grad_cpu, grad_ref, strict=True):
        assert_close(a, e, TOL[torch.float32])


def hc_inputs(tokens, n, c, dtype, seed=0):
    """Streams x [*tokens, n, C] and dynamic-HC parameters with O(1) tanh inputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*tokens, n, c, generator=g).to(dtype)
    w = torch.randn(c, n + 2, generator=g) / c**0.5
    s_alpha, s_beta = torch.tensor(0.7), torch.tensor(0.4)
    static_pre, static_post = torch.randn(n, generator=g), torch.randn(n, generator=g)
    static_res = torch.randn(n, n, generator=g)
    return [t.requires_grad_() for t in (x, w, s_alpha, s_beta, static_pre, static_post,
                                           static_res)]


# HC's maps have no torch fallback of their own: without the native library (or for other
# dtypes, or on few tokens) cpu.hc_maps is reference.hc_maps, so these tests run natively.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, n, c", [((17,), 4, 100), ((3, 21), 3, 100), ((63,), 8, 16),
                                          ((20,), 1, 33)])
def test_hc_maps_match_reference(tokens, n, c, dtype):
    """HC's dynamic maps on the native rows kernels (RMS divided after the matmul, one dx
    write), values and all seven gradients."""
    _need_native()
    inputs = hc_inputs(tokens, n, c, dtype, seed=4)
    out_ref, grad_ref = run(reference.hc_maps, inputs)
    out_cpu, grad_cpu = run(cpu.hc_maps, clone_inputs(inputs))
    maps_tol = 2e-5
    for a, e in zip(out_cpu, out_ref, strict=True):
        assert a.dtype == e.dtype
        assert_close(a, e, maps_tol)
    assert len(grad_cpu) == 7  # x, w, s_alpha, s_beta, static_pre, static_post, static_res
    for a, e in zip(grad_cpu, grad_ref, strict=True):
        assert a.dtype == e.dtype
    assert_close(grad_cpu[0], grad_ref[0], TOL[dtype])
    if dtype != torch.bfloat16:
        for a, e in zip(grad_cpu[1:], grad_ref[1:], strict=True):
            assert_close(a, e, maps_tol)
        return
    # With bf16 streams the parameters' float32 gradients are sums over all tokens that can
    # cancel (on tokens (20,), n = 1, C = 33, s_alpha's to 1/50 of its terms; there the
    # float32 reference is 2.0e-5 from the float64 value and the native path 1.5e-5). So
    # both are measured against the float64 evaluation of the same bf16 inputs, and the
    # cpu path must be within 2e-5 of it or no further than the float32 reference is.
    _, grad_f64 = run(reference.hc_maps, [t.detach().double().requires_grad_() for t in inputs])
    for a, e, exact in zip(grad_cpu[1:], grad_ref[1:], grad_f64[1:], strict=True):
        scale = exact.abs().max()
        ref_err = ((e.double() - exact).abs().max() / scale).item()
        assert_close(a, exact, max(maps_tol, ref_err))


def _hc_maps_then_pre(x, *params):
    h_pre, h_post, h_res = reference.hc_maps(x, *params)
    return h_pre, h_post, h_res, reference.pre_aggregate(x, h_pre)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, n, c", [((17,), 4, 100), ((3, 21), 3, 100), ((20,), 8, 16),
                                          ((20,), 1, 33), ((18,), 5, 40)])
def test_fused_dx_hc_maps_and_merge_match_reference(tokens, n, c, dtype):
    """hc_maps_pre(fused_dx=True) + post_merge(x_for_merge, fused_dx=True) around a branch,
    with H_pre and H_res also used elsewhere: the aggregation's and the merge's shares of x's
    gradient go through one node (NativeOps.hc_bwd), against the reference ops in float64."""
    _need_native()
    inputs = hc_inputs(tokens, n, c, dtype, seed=22)
    f_extra = torch.randn(*tokens, c, generator=torch.Generator().manual_seed(9))
    inputs.append(f_extra.to(dtype).requires_grad_())

    def ref(x, *rest):
        *params, extra = rest
        h_pre, h_post, h_res, a = _hc_maps_then_pre(x, *params)
        return reference.post_merge(x, torch.tanh(a) + extra, h_post, h_res), a, h_pre, h_res

    def fused(x, *rest):
        *params, extra = rest
        h_pre, h_post, h_res, a, x_for_merge = cpu.hc_maps_pre(x, *params, fused_dx=True)
        assert x_for_merge is not None  # one node was made
        merged = cpu.post_merge(x_for_merge, torch.tanh(a) + extra, h_post, h_res, fused_dx=True)
        return merged, a, h_pre, h_res

    def unfused(x, *rest):  # the cpu ops as separate nodes: three dx, added by autograd
        *params, extra = rest
        h_pre, h_post, h_res = cpu.hc_maps(x, *params)
        a = cpu.pre_aggregate(x, h_pre)
        return cpu.post_merge(x, torch.tanh(a) + extra, h_post, h_res), a, h_pre, h_res

    out_cpu, grad_cpu = run(fused, clone_inputs(inputs))
    _, grad_unfused = run(unfused, clone_inputs(inputs))
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    out_64, grad_64 = run(ref, inputs64, upstream_dtype=dtype)
    for a, exact in zip(out_cpu, out_64, strict=True):
        assert a.dtype == dtype or a.dtype == torch.float32
        assert_close(a, exact, TOL[dtype])
    names = ("x", "w", "s_alpha", "s_beta", "static_pre", "static_post", "static_res", "f")
    for a, split, exact, name in zip(grad_cpu, grad_unfused, grad_64, names, strict=True):
        assert a.dtype == split.dtype, name
        # Every float32 gradient is the separate nodes' to float32 rounding (measured: at
        # most 6.5e-7; the scales' equal).
        if a.dtype == torch.float32:
            assert_close(a, split, TOL[torch.float32])
        # Against float64: bf16 streams round a and the merge to bf16 on the way, so every
        # gradient is held to the bf16 tolerance; except, with bf16, the scales' (one sum
        # over all tokens that cancels: on (20,), n = 8, C = 16 s_beta's is 1.8e-2 from
        # float64 on the reference ops in bf16 and 2.6e-2 on the cpu ops, fused or not).
        if not (dtype == torch.bfloat16 and a.dim() == 0):
            assert_close(a, exact, TOL[dtype])


def test_hc_maps_pre_with_unused_outputs_matches_reference():
    """Only the aggregation and H_post feed the loss: the node's backward gets no gradient
    for H_pre, H_res and the merge, and the parameters' gradients are still the reference's
    (static_res's is zero)."""
    _need_native()
    inputs = hc_inputs((19,), 4, 24, torch.float32, seed=23)
    gen = torch.Generator().manual_seed(4)
    g_a, g_post = torch.randn(19, 24, generator=gen), torch.randn(19, 4, generator=gen)

    def grads(fn):
        leaves = clone_inputs(inputs)
        _, h_post, _, a = fn(*leaves)[:4]
        loss = (a * g_a).sum() + (h_post * g_post).sum()
        got = torch.autograd.grad(loss, leaves, allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for g, t in zip(got, leaves, strict=True)]

    got, want = grads(cpu.hc_maps_pre), grads(_hc_maps_then_pre)
    assert not want[6].any() and torch.equal(got[6], want[6])  # static_res: unused
    for a, e in zip(got[:6], want[:6], strict=True):
        assert_close(a, e, 2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, n", [((20,), 4), ((1, 1), 4), ((), 3), ((2, 3), 8)])
def test_hc_maps_without_autograd_match_the_autograd_path(tokens, n, dtype):
    """Under no_grad hc_maps and hc_maps_pre are one native call (native.c's hc_fwd)
    in the caller's shape: the autograd path's values to float32 rounding (tanhf and fused
    multiply-adds against torch's ops: at most 1.2e-7 of the largest entry in these cases),
    the aggregation too."""
    _need_native()
    inputs = hc_inputs(tokens, n, 48, dtype, seed=13)
    x = inputs[0]
    with_grad = [t.detach() for t in _hc_maps_then_pre(*inputs)]
    if math.prod(tokens) >= cpu._HC_NATIVE_MIN_TOKENS:  # the rows kernels' autograd path
        with_grad = [t.detach() for t in cpu.hc_maps_pre(*inputs)]
    with torch.no_grad():
        maps = cpu.hc_maps(*inputs)
        maps_pre = cpu.hc_maps_pre(*inputs)
    for a, e in zip([*maps, *maps_pre], [*with_grad[:3], *with_grad], strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype and not a.requires_grad
        assert_close(a, e, 2e-6 if a.dtype == torch.float32 else TOL[dtype])
    assert torch.equal(maps_pre[3], cpu.pre_aggregate(x.detach(), maps_pre[0]))


def test_hc_maps_on_few_tokens_are_the_reference():
    """With autograd, below cpu._HC_NATIVE_MIN_TOKENS tokens the reference's torch ops run."""
    _need_native()
    few = hc_inputs((cpu._HC_NATIVE_MIN_TOKENS - 1,), 4, 48, torch.float32, seed=14)
    for a, e in zip(cpu.hc_maps(*few), reference.hc_maps(*few), strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize("kind", ["mhc", "hc", "hc_pre"])
def test_native_maps_split_over_threads_match_reference(kind):
    """Tokens (or HC's stream rows) split over a thread pool: each thread's partial dphi
    (dW) is summed, and mHC's threads each have their own Sinkhorn scratch, HC's fused
    backward its own dx rows (200 tokens or rows on 3 threads; 64 is the least a thread
    gets)."""
    _need_native()
    if kind == "mhc":
        inputs = maps_inputs((200,), 4, 33, torch.float32, seed=11)
        fn, ref = cpu.mhc_maps_pre, _maps_then_pre
    elif kind == "hc_pre":
        inputs = hc_inputs((200,), 4, 40, torch.float32, seed=12)
        fn, ref = cpu.hc_maps_pre, _hc_maps_then_pre
    else:
        inputs = hc_inputs((50,), 4, 40, torch.float32, seed=12)  # 200 stream rows
        fn, ref = cpu.hc_maps, reference.hc_maps
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert native.load().threads_for(200) == 3
        out_cpu, grad_cpu = run(fn, clone_inputs(inputs))
    finally:
        torch.set_num_threads(threads)
    out_ref, grad_ref = run(ref, inputs)
    for a, e in zip([*out_cpu, *grad_cpu], [*out_ref, *grad_ref], strict=True):
        assert_close(a, e, 2e-5)


def test_inference_path_equals_autograd_path_and_sees_parameter_updates(cpu_path):
    """Without autograd (decode) the connection takes the native loops directly, with a
    cached copy of phi: same values as with autograd, and an in-place update is seen."""
    c, n = 40, 4
    torch.manual_seed(3)
    conn = perturbed(ManifoldHyperConnection(c, n, 1, Branch(c), impl="cpu"))
    ref = ManifoldHyperConnection(c, n, 1, Branch(c), impl="reference")
    x = torch.randn(2, 5, n, c)
    with_grad = conn(x.clone().requires_grad_()).detach()
    with torch.no_grad():
        without = conn(x)
    assert torch.equal(without, with_grad)
    with torch.no_grad():
        conn.phi.mul_(1.5)
        conn.b_res.add_(0.2)
        conn.alpha.mul_(2.0)
        updated = conn(x)
        ref.load_state_dict(conn.state_dict())
        expected = ref(x)
    assert (updated - without).abs().max() > 1e-3
    assert_close(updated, expected, 2e-6)


def test_hc_inference_sees_parameter_updates_and_replacements():
    """HC's decoding path caches W padded and its scalars while the parameters are unchanged:
    in-place updates (through the s_alpha.view(()) the connection passes) and a replaced
    parameter are both seen, against the reference connection."""
    _need_native()
    c, n = 40, 4
    torch.manual_seed(5)
    conn = perturbed(HyperConnection(c, n, 1, Branch(c), impl="cpu"))
    ref = HyperConnection(c, n, 1, Branch(c), impl="reference")
    x = torch.randn(2, 5, n, c)

    def check(previous):
        with torch.no_grad():
            out = conn(x)
            ref.load_state_dict(conn.state_dict())
            assert_close(out, ref(x), 2e-6)
        assert (out - previous).abs().max() > 1e-3
        return out

    with torch.no_grad():
        out = conn(x)
        conn.w.mul_(1.5)
        conn.s_alpha.add_(0.2)
        conn.static_res.add_(0.1)
    out = check(out)
    conn.s_beta = torch.nn.Parameter(conn.s_beta.detach() + 0.3)
    check(out)


def test_fused_maps_and_pre_aggregation_gradcheck_float64(cpu_path):
    inputs = [t.detach().double().requires_grad_() for t in maps_inputs((3,), 3, 5, torch.float32)]
    assert torch.autograd.gradcheck(
        lambda *a: cpu.mhc_maps_pre(*a, sinkhorn_iters=3, pre_eps=1e-3), inputs
    )


def test_mhc_maps_with_deepseek_epsilons_and_few_iterations(cpu_path):
    inputs = maps_inputs((9,), 4, 24, torch.float32, seed=3)
    kw = dict(sinkhorn_iters=3, norm_eps=1e-4, sinkhorn_eps=1e-2, pre_eps=1e-2)
    out_ref, grad_ref = run(lambda *a: reference.mhc_maps(*a, **kw), inputs)
    out_cpu, grad_cpu = run(lambda *a: cpu.mhc_maps(*a, **kw), clone_inputs(inputs))
    for a, e in zip([*out_cpu, *grad_cpu], [*out_ref, *grad_ref], strict=True):
        assert_close(a, e, 2e-5)


def test_mhc_maps_when_only_some_maps_are_used(cpu_path):
    inputs = maps_inputs((6,), 4, 20, torch.float32, seed=4)
    g = torch.randn(6, 4, 4)
    grads = []
    for impl in (reference, cpu):
        _, _, h_res = impl.mhc_maps(*inputs)
        grads.append(torch.autograd.grad(h_res, inputs, g, materialize_grads=True))
    for a, e in zip(*grads, strict=True):
        assert_close(a, e, 2e-5)


def test_mhc_maps_gradcheck_float64(cpu_path):
    inputs = [t.detach().double().requires_grad_() for t in maps_inputs((3,), 3, 5, torch.float32)]
    assert torch.autograd.gradcheck(
        lambda *a: cpu.mhc_maps(*a, sinkhorn_iters=4, sinkhorn_eps=1e-3, pre_eps=1e-3), inputs
    )


@pytest.mark.parametrize("n, iters, eps", [(3, 20, 0.0), (4, 1, 0.0), (8, 7, 1e-2), (4, 20, 1e-3)])
def test_sinkhorn_matches_unrolled_autograd(n, iters, eps):
    g = torch.Generator().manual_seed(n)
    logits = (torch.randn(2, 5, n, n, generator=g) * 2).requires_grad_()
    upstream = torch.randn(2, 5, n, n, generator=g)
    ref = sinkhorn_unrolled(logits, iters, eps=eps)
    out = cpu.sinkhorn(logits, iters, eps=eps)
    assert_close(out, ref, 1e-6)
    (g_ref,) = torch.autograd.grad(ref, logits, upstream)
    (g_cpu,) = torch.autograd.grad(out, logits, upstream)
    assert_close(g_cpu, g_ref, 1e-5)


def test_sinkhorn_bf16_computes_in_fp32():
    logits = torch.randn(7, 4, 4).bfloat16()
    out = cpu.sinkhorn(logits, 20)
    assert out.dtype == torch.bfloat16
    assert_close(out, sinkhorn_unrolled(logits.float(), 20).bfloat16(), 0.0)


def test_sinkhorn_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"\[\.\.\., n, n\]"):
        cpu.sinkhorn(torch.randn(3, 4, 5))
    with pytest.raises(ValueError, match="iters to be an integer >= 1"):
        cpu.sinkhorn(torch.randn(3, 4, 4), 0)


# ---------------------------------------------------------------------------------------------
# (b) pre-aggregation, (c) post-and-merge
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, n, c", [((7,), 4, 100), ((3, 21), 3, 100), ((63,), 8, 16)])
def test_pre_aggregate_and_post_merge_match_reference(tokens, n, c, dtype, cpu_path):
    x, f, h_pre, h_post, h_res = merge_inputs(tokens, n, c, dtype)
    for fn, inputs in ((reference.pre_aggregate, cpu.pre_aggregate), (x, h_pre)), (
        (reference.post_merge, cpu.post_merge), (x, f, h_post, h_res)
    ):
        ref_fn, cpu_fn = fn
        out_ref, grad_ref = run(ref_fn, list(inputs))
        out_cpu, grad_cpu = run(cpu_fn, clone_inputs(inputs))
        assert out_cpu[0].dtype == dtype
        for a, e in zip([*out_cpu, *grad_cpu], [*out_ref, *grad_ref], strict=True):
            assert a.dtype == e.dtype
            assert_close(a, e, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [(), (1, 1), (2, 3)])
def test_inference_maps_and_merge_keep_the_callers_shapes(tokens, dtype, cpu_path):
    """Without autograd (decoding) the maps and the merge come straight from the native
    loops in the caller's leading shape (none, [B, 1], [B, T]): the values of the autograd
    path, bit for bit."""
    n, c = 4, 40
    inputs = maps_inputs(tokens, n, c, dtype, seed=21)
    with_grad = [t.detach() for t in cpu.mhc_maps_pre(*inputs)]
    with torch.no_grad():
        without = cpu.mhc_maps_pre(*inputs)
    for a, e in zip(without, with_grad, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype and not a.requires_grad
        assert torch.equal(a, e)
    x = inputs[0].detach()
    _, h_post, h_res, f = without
    merged_grad = cpu.post_merge(x, f, h_post, h_res.requires_grad_()).detach()
    with torch.no_grad():
        merged = cpu.post_merge(x, f, h_post, h_res)
    assert merged.shape == x.shape and merged.dtype == dtype
    assert torch.equal(merged, merged_grad)
    assert_close(merged, reference.post_merge(x, f, h_post, h_res).detach(), TOL[dtype])


@pytest.mark.parametrize("tokens", [3, 520])
def test_merge_with_and_without_streaming_stores_matches_reference(tokens):
    """The merge's output takes streaming stores from 2^18 floats per call (520 tokens of
    4 x 128 on one thread) and ordinary stores below (3 tokens); the same values either way."""
    _need_native()
    x, f, _, h_post, h_res = (t.detach() for t in merge_inputs((tokens,), 4, 128, torch.float32))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        out = native.load().merge_fwd(x, f, h_post, h_res)
    finally:
        torch.set_num_threads(threads)
    assert_close(out, reference.post_merge(x, f, h_post, h_res), TOL[torch.float32])


def test_merge_ops_accept_broadcast_streams(cpu_path):
    """The first connection sees expand_streams' stride-0 view."""
    h = torch.randn(2, 5, 12, requires_grad=True)
    _, f, h_pre, h_post, h_res = merge_inputs((2, 5), 3, 12, torch.float32)
    grads = []
    for impl in (reference, cpu):
        x = expand_streams(h, 3)
        out = impl.post_merge(x, f, h_post, h_res) + impl.pre_aggregate(x, h_pre).unsqueeze(-2)
        grads.append(torch.autograd.grad(out, (h, f, h_pre, h_post, h_res), torch.ones_like(out)))
    for a, e in zip(*grads, strict=True):
        assert_close(a, e, 2e-6)


def test_merge_ops_gradcheck_float64(cpu_path):
    inputs = [t.detach().double().requires_grad_() for t in merge_inputs((3,), 3, 5, torch.float32)]
    x, f, h_pre, h_post, h_res = inputs
    assert torch.autograd.gradcheck(cpu.pre_aggregate, (x, h_pre))
    assert torch.autograd.gradcheck(cpu.post_merge, (x, f, h_post, h_res))


def _native_op_samples():
    x, f, h_pre, h_post, h_res = [t.detach() for t in merge_inputs((5,), 3, 20, torch.float32)]
    m = 3 * 3 + 2 * 3
    phi = torch.randn(60, m) / 60**0.5
    ab = torch.randn(2, m)
    lt, r, *_ = torch.ops.torch_mhc.cpu_mhc_maps_fwd(x, cpu.padded_table(phi), ab, 4, 1e-6, 0.0,
                                                    0.0, False)
    g = torch.randn_like(x)
    w = torch.randn(20, 3 + 2)  # HC's W [C, n + 2]
    return {
        "cpu_pre_aggregate_fwd": (x, h_pre),
        "cpu_pre_aggregate_bwd": (x, h_pre, f),
        "cpu_post_merge_fwd": (x, f, h_post, h_res),
        "cpu_post_merge_bwd": (x, f, h_post, h_res, g, True),
        "cpu_mhc_maps_fwd": (x, cpu.padded_table(phi), ab, 4, 1e-6, 0.0, 0.0, True),
        "cpu_mhc_maps_bwd": (x, phi, ab, lt, r, h_pre, h_post, h_res, f, g, 4, 0.0, 0.0),
        "cpu_rows_fwd": (x.view(15, 20), cpu.padded_table(w)),
        "cpu_rows_bwd": (x.view(15, 20), w.t().contiguous(), cpu.padded_table(torch.randn(15, 5)),
                         torch.randn(15)),
        "cpu_hc_maps_bwd": (x, w.t().contiguous(), torch.tanh(torch.randn(15, 5)),
                            torch.randn(15, 5), torch.rand(15) + 0.5, h_pre, h_res, h_pre, None,
                            h_res, f, g, torch.tensor([0.7, 0.4])),
    }


@pytest.mark.parametrize("name", list(_native_op_samples()))
def test_native_custom_ops_pass_opcheck(name):
    """Schema, fake implementation and autograd registration of the native ops."""
    _need_native()
    args = _native_op_samples()[name]
    if name == "cpu_pre_aggregate_fwd":  # the one with registered autograd
        args = tuple(a.requires_grad_() for a in args)
    torch.library.opcheck(getattr(torch.ops.torch_mhc, name).default, args)


def test_native_maps_backward_refuses_phi_of_another_shape():
    """phi transposed ([M, n C], the layout the native pass keeps inside) is refused by name."""
    _need_native()
    x, phi, ab, lt, r, *grads = _native_op_samples()["cpu_mhc_maps_bwd"]
    with pytest.raises(ValueError, match=r"phi must be \[n\*C, M\] = \[60, 15\].*got \(15, 60\)"):
        torch.ops.torch_mhc.cpu_mhc_maps_bwd(x, phi.t().contiguous(), ab, lt, r, *grads)


def _connection_step(conn, x):
    """A forward and backward through conn; returns x's gradient and conn's parameters'."""
    x = x.clone().requires_grad_()
    conn(x).square().sum().backward()
    grads = [x.grad, *(p.grad.clone() for p in conn.parameters())]
    conn.zero_grad(set_to_none=True)
    return grads


def test_eager_calls_skip_the_custom_ops_dispatch_that_modes_still_see(monkeypatch):
    """In plain eager mode the autograd Functions call the native functions directly (the
    custom ops' Python dispatch cost ~10 us a call); under a dispatch mode the custom ops
    still run, seen by the mode, with the same gradients to the bit, and torch.profiler
    lists them by name."""
    _need_native()
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []
    for name, fn in list(cpu._IMPLS.items()):
        def counted(*args, _fn=fn, _name=name):
            calls.append(_name)
            return _fn(*args)
        monkeypatch.setitem(cpu._IMPLS, name, counted)

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    conn = ManifoldHyperConnection(32, 4, 0, torch.nn.Linear(32, 32))
    x = expand_streams(torch.randn(2, 5, 32), 4)
    eager = _connection_step(conn, x)
    assert calls == ["cpu_mhc_maps_fwd", "cpu_post_merge_fwd", "cpu_post_merge_bwd",
                     "cpu_mhc_maps_bwd"]
    calls.clear()
    with Seen() as mode:
        seen = _connection_step(conn, x)
    assert calls == []
    assert {"torch_mhc.cpu_mhc_maps_fwd", "torch_mhc.cpu_post_merge_fwd",
            "torch_mhc.cpu_post_merge_bwd", "torch_mhc.cpu_mhc_maps_bwd"} <= set(mode.ops)
    for a, b in zip(eager, seen, strict=True):
        assert torch.equal(a, b)
    with torch.profiler.profile() as prof:
        profiled = _connection_step(conn, x)
    assert calls == []
    assert {"torch_mhc::cpu_mhc_maps_fwd", "torch_mhc::cpu_mhc_maps_bwd"} <= {
        e.key for e in prof.key_averages()}
    for a, b in zip(eager, profiled, strict=True):
        assert torch.equal(a, b)


def _fresh_load(monkeypatch, cache):
    """native.load() as in a new process, with its cache in `cache`."""
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setenv("TORCH_MHC_CACHE", str(cache))
    return native.load


def _copying_compiler(tmp_path, library: Path) -> Path:
    """A stand-in C compiler (a shell script) that writes a copy of `library` to its -o
    argument and counts its runs in calls.txt: the build logic without a real build."""
    script = tmp_path / "fake cc"  # a space: CC must be parsed as a shell would
    script.write_text(
        "#!/bin/sh\n"
        f"echo run >> '{tmp_path}/calls.txt'\n"
        'while [ "$#" -gt 1 ]; do\n'
        f'  if [ "$1" = "-o" ]; then cp \'{library}\' "$2"; fi\n'
        "  shift\n"
        "done\n"
    )
    script.chmod(0o755)
    return script


def _calls(tmp_path) -> int:
    path = tmp_path / "calls.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_native_library_builds_verifies_and_rebuilds_a_truncated_cache(monkeypatch, tmp_path):
    _need_native()
    real = native.load().path
    cc = _copying_compiler(tmp_path, real)
    monkeypatch.setenv("CC", f"'{cc}' --some-flag")
    monkeypatch.setenv("CFLAGS", "-DA='1 2' -O2")
    load = _fresh_load(monkeypatch, tmp_path / "cache")
    lib = load()
    assert lib is not None and lib.path.parent == tmp_path / "cache" and _calls(tmp_path) == 1
    sidecar = lib.path.with_name(lib.path.name + ".sha256")
    assert sidecar.read_text() == hashlib.sha256(real.read_bytes()).hexdigest()
    assert not [p for p in lib.path.parent.iterdir() if p.name.endswith(".tmp")]
    x, f, h_pre, h_post, h_res = [t.detach() for t in merge_inputs((200,), 4, 33, torch.float32)]
    assert_close(lib.merge_fwd(x, f, h_post, h_res), reference.post_merge(x, f, h_post, h_res),
                 1e-6)
    # A second process finds the verified library and builds nothing.
    assert _fresh_load(monkeypatch, tmp_path / "cache")().path == lib.path
    assert _calls(tmp_path) == 1
    # A library cut short (what a crash between write and rename left before fsync) is
    # rebuilt, never mapped (dlopen of a truncated file can die of SIGBUS).
    data = lib.path.read_bytes()
    cut = lib.path.with_name("cut")  # a new file: this process has the old one mapped
    cut.write_bytes(data[: len(data) // 3])
    os.replace(cut, lib.path)
    again = _fresh_load(monkeypatch, tmp_path / "cache")()
    assert again is not None and _calls(tmp_path) == 2
    assert again.path.read_bytes() == data


def test_compiler_and_flags_are_parsed_as_a_shell_would(monkeypatch):
    monkeypatch.setenv("CC", "ccache 'my gcc' -O2")
    assert native_build._compiler() == ["ccache", "my gcc", "-O2"]
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", "")
    assert native_build._compiler() is None


@pytest.mark.parametrize("cc", ["false", "no-such-compiler-here", None])
def test_native_library_falls_back_with_one_warning(monkeypatch, tmp_path, cc):
    if cc is None:  # no compiler at all
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setenv("PATH", "")
    else:
        monkeypatch.setenv("CC", cc)
    load = _fresh_load(monkeypatch, tmp_path)
    with pytest.warns(RuntimeWarning) as caught:
        assert load() is None
        assert load() is None  # asked again: no second warning, no second build
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "pure-torch fallback" in text and "TORCH_MHC_NATIVE=0" in text
    assert not cpu.use_native(torch.zeros(2, 4, 8))  # the ops take the torch path
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setenv("TORCH_MHC_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # silenced
        assert native.load() is None


def test_import_builds_nothing_spawns_nothing_loads_no_library(tmp_path):
    """`import torch_mhc` in a fresh interpreter: no process started, no shared library
    mapped (the native one included), nothing written to the cache, no optimizer step hook
    registered in torch (runtime.param_updates registers its own at first use)."""
    script = textwrap.dedent("""
        import os, subprocess, torch
        from torch.optim import optimizer

        def libraries():
            return {line.split()[-1] for line in open("/proc/self/maps")
                    if line.split()[-1].endswith(".so") or ".so." in line.split()[-1]}

        def refuse(*args, **kwargs):
            raise AssertionError(f"a process was started: {args}")

        before = libraries()
        subprocess.Popen.__init__ = refuse
        os.fork = os.posix_spawn = os.posix_spawnp = os.system = refuse
        import torch_mhc, torch_mhc.ops
        new = libraries() - before
        assert not new, new
        hooks = optimizer._global_optimizer_pre_hooks, optimizer._global_optimizer_post_hooks
        assert not any(hooks), hooks
        print("clean")
    """)
    env = {**os.environ, "TORCH_MHC_CACHE": str(tmp_path / "cache"), "CC": "false"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "clean", done.stderr[-2000:]
    assert not (tmp_path / "cache").exists()


def test_merge_ops_reject_mismatched_shapes():
    x, f, h_pre, h_post, h_res = merge_inputs((4,), 3, 8, torch.float32)
    with pytest.raises(ValueError, match=r"h_res of shape \(4, 3, 3\)"):
        cpu.post_merge(x, f, h_post, h_res[:, :2])
    with pytest.raises(ValueError, match=r"f of shape \(4, 8\)"):
        cpu.post_merge(x, f[:, :7], h_post, h_res)
    with pytest.raises(ValueError, match=r"h_pre of shape \(4, 3\)"):
        cpu.pre_aggregate(x, h_pre[:3])


# ---------------------------------------------------------------------------------------------
# Connections end to end, selection
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mhc", "hc"])
def test_connection_cpu_equals_reference(kind, cpu_path):
    c, n = 100, 4
    torch.manual_seed(0)
    if kind == "mhc":
        conns = [ManifoldHyperConnection(c, n, 1, Branch(c), impl=i) for i in ("cpu", "reference")]
    else:
        conns = [HyperConnection(c, n, 1, Branch(c), impl=i) for i in ("cpu", "reference")]
    perturbed(conns[0])
    conns[1].load_state_dict(conns[0].state_dict())
    x = torch.randn(3, 7, n, c)
    upstream = torch.randn(3, 7, n, c)
    results = []
    for conn in conns:
        xi = x.clone().requires_grad_()
        out = conn(xi)
        params = [xi, *conn.parameters()]
        results.append((out, torch.autograd.grad(out, params, upstream)))
    (out_cpu, g_cpu), (out_ref, g_ref) = results
    assert_close(out_cpu, out_ref, 2e-6)
    for a, e in zip(g_cpu, g_ref, strict=True):
        assert_close(a, e, 2e-5)


@pytest.mark.parametrize("kind", [ManifoldHyperConnection, HyperConnection])
def test_connection_cpu_compiles_fullgraph(kind, cpu_path):
    """The cpu ops' custom ops (HC's fused maps backward included: 18 tokens take the
    native path) under torch.compile(fullgraph=True), against eager."""
    c, n = 16, 4
    torch.manual_seed(1)
    conn = perturbed(kind(c, n, 0, Branch(c), impl="cpu"))
    x = torch.randn(2, 9, n, c, requires_grad=True)
    compiled = torch.compile(conn, fullgraph=True, backend="aot_eager")
    out_c, out_e = compiled(x), conn(x)
    assert_close(out_c, out_e, 1e-6)
    g = torch.randn_like(out_e)
    params = [x, *conn.parameters()]
    for a, e in zip(torch.autograd.grad(out_c, params, g), torch.autograd.grad(out_e, params, g),
                    strict=True):
        assert_close(a, e, 1e-6)


def test_every_implementation_has_maps_pre_ops():
    inputs = maps_inputs((4,), 3, 10, torch.float32)
    expected = _maps_then_pre(*inputs)
    hc = hc_inputs((20,), 3, 10, torch.float32)
    hc_expected = _hc_maps_then_pre(*hc)
    for name in ("reference", "cpu"):
        impl = ops.get_impl(name)
        for a, e in zip(impl.mhc_maps_pre(*inputs), expected, strict=True):
            assert_close(a.detach(), e.detach(), 2e-6)
        for a, e in zip(impl.hc_maps_pre(*hc), hc_expected, strict=True):
            assert_close(a.detach(), e.detach(), 2e-6)


def test_get_impl_selection(monkeypatch):
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    assert ops.get_impl("auto", torch.device("cpu")).name == "cpu"
    ref = ops.get_impl("reference", "cpu")
    assert ref.name == "reference" and ref.pre_aggregate is reference.pre_aggregate
    assert ops.resolve_impl_name("auto", "cuda", torch.float64) == "cpu"
    assert ops.resolve_impl_name("auto", "meta") == "reference"
    if ops._triton_available():
        assert ops.resolve_impl_name("auto", "cuda", torch.bfloat16) == "triton"
    monkeypatch.setenv(ops.ENV_VAR, "reference")
    assert ops.get_impl("auto", "cpu").name == "reference"
    assert ops.get_impl("cpu", "cpu").name == "cpu"  # an explicit name wins over the env
    try:
        ops.set_default_impl("cpu")  # the programmatic default wins over the env
        assert ops.get_impl("auto", "cpu").name == "cpu"
    finally:
        ops.set_default_impl(None)
    assert ops.get_impl("auto", "cpu").name == "reference"
    monkeypatch.setenv(ops.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="TORCH_MHC_IMPL.*'fast'.*'reference', 'cpu', 'triton'"):
        ops.get_impl("auto", "cpu")


def test_unknown_impl_names_are_rejected_with_the_choices():
    with pytest.raises(ValueError, match=r"'gpu'.*\('auto', 'reference', 'cpu', 'triton'"):
        ops.get_impl("gpu")
    with pytest.raises(ValueError, match="unknown op implementation"):
        ops.set_default_impl("gpu")
    with pytest.raises(ValueError, match="unknown op implementation 'fused'"):
        ManifoldHyperConnection(8, 4, 0, Branch(8), impl="fused")


def test_lm_trains_under_cpu_bf16_autocast():
    # Under autocast the backward must not mix autocast's bf16 logits with fp32 streams.
    from torch_mhc.lm.model import LM, ModelConfig

    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = {}
    for kind in ("residual", "hc", "mhc"):
        torch.manual_seed(0)
        model = LM(ModelConfig(dim=32, n_layers=2, max_seq_len=16, connection=kind))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        losses[kind] = loss.item()
    # At initialisation HC and mHC compute the residual network's function.
    assert losses["hc"] == pytest.approx(losses["residual"], rel=1e-3)
    assert losses["mhc"] == pytest.approx(losses["residual"], rel=1e-3)


# ---------------------------------------------------------------------------------------------
# The native ops' block pool
# ---------------------------------------------------------------------------------------------


def test_block_pool_reuses_a_block_only_when_no_tensor_holds_it():
    pool = native.BlockPool(cap_bytes=64 << 20)
    shape = (512, 1024)  # 2 MiB of float32
    a = pool.empty(shape, torch.float32)
    a.fill_(1.0)
    b = pool.empty(shape, torch.float32)
    b.fill_(2.0)
    assert b.data_ptr() != a.data_ptr() and bool((a == 1.0).all())
    view = a[10:20]  # a view keeps the block in use
    base_ptr = a.data_ptr()
    del a
    c = pool.empty(shape, torch.float32)
    assert c.data_ptr() != base_ptr
    del view
    d = pool.empty(shape, torch.float32)
    assert d.data_ptr() == base_ptr and d.shape == shape
    assert pool.held == 3 * 2 * (1 << 20)
    bf = pool.empty((1024, 1024), torch.bfloat16)  # same byte size, another dtype
    assert bf.dtype == torch.bfloat16 and bf.shape == (1024, 1024)


def test_block_pool_respects_its_cap_and_minimum():
    pool = native.BlockPool(cap_bytes=5 << 20)
    kept = [pool.empty((512, 1024), torch.float32) for _ in range(3)]  # 3 x 2 MiB > 5 MiB
    assert pool.held == 4 << 20  # the third is an ordinary tensor
    small = pool.empty((16, 16), torch.float32)
    assert pool.held == 4 << 20 and small.shape == (16, 16)
    assert len({t.data_ptr() for t in kept}) == 3  # the ordinary tensor aliases no block
    off = native.BlockPool(cap_bytes=0)
    off.empty((512, 1024), torch.float32)
    assert off.held == 0


def test_block_pool_cap_from_environment(monkeypatch):
    monkeypatch.setenv("TORCH_MHC_CPU_POOL_MB", "2.5")
    assert native._pool_cap() == int(2.5 * (1 << 20))
    monkeypatch.setenv("TORCH_MHC_CPU_POOL_MB", "lots")
    with pytest.raises(ValueError, match="TORCH_MHC_CPU_POOL_MB must be a number of MiB"):
        native._pool_cap()


def test_training_steps_are_identical_with_and_without_the_pool(monkeypatch):
    """Pooled outputs are reused across steps: two steps of a small mHC stack give the same
    gradients, bit for bit, as with the pool off."""
    _need_native()
    c, n = 256, 4
    torch.manual_seed(5)
    conns = [perturbed(ManifoldHyperConnection(c, n, i, Branch(c), impl="cpu"), seed=i)
             for i in range(3)]
    x0 = torch.randn(2, 512, n, c)  # [T, n, C] outputs of 4 MiB: pooled

    def two_steps():
        grads = []
        for _ in range(2):
            x = x0.clone().requires_grad_()
            h = x
            for conn in conns:
                h = conn(h)
            (h * h).sum().backward()
            grads.append([x.grad, *[p.grad.clone() for conn in conns for p in conn.parameters()]])
            for conn in conns:
                conn.zero_grad(set_to_none=True)
        return grads

    blocks = native.load().blocks
    monkeypatch.setattr(blocks, "cap_bytes", 256 << 20)
    pooled = two_steps()
    assert blocks.held > 0
    monkeypatch.setattr(blocks, "cap_bytes", 0)
    plain = two_steps()
    for step_p, step_q in zip(pooled, plain, strict=True):
        for a, b in zip(step_p, step_q, strict=True):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Sinkhorn finite wherever the exact answer is (torch_mhc/functional/sinkhorn.py): far logits
# ---------------------------------------------------------------------------------------------


def test_sinkhorn_far_apart_logits_are_exact():
    x = torch.tensor([[100.0, 100.0], [-100.0, -100.0]]).requires_grad_()
    out = cpu.sinkhorn(x, 20)
    torch.testing.assert_close(out, torch.full((2, 2), 0.5), rtol=0, atol=0)
    g = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    (got,) = torch.autograd.grad(out, x, g)
    xd = x.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(sinkhorn_log_naive(xd, 20), xd, g.double())
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype, tokens, threads", [(torch.float32, 45, 1),
                                                    (torch.bfloat16, 45, 1),
                                                    (torch.float32, 200, 3)])
def test_mhc_maps_with_far_apart_res_logits_match_float64(dtype, tokens, threads, cpu_path):
    """Gates so large that the Sinkhorn logits of some tokens span more than LINEAR_RANGE
    (log domain) and of others less (linear domain), in one call: maps and all gradients
    against the reference evaluated in float64. 45 tokens: two full lane groups of 16 and a
    partial one; 200 tokens on 3 threads: each thread's own scratch for the log domain."""
    n, c = 4, 24
    inputs = maps_inputs((tokens,), n, c, dtype, seed=9)
    with torch.no_grad():
        inputs[2][2] = 9.0  # alpha_res
    res = inputs[2][2] * (inputs[0].detach().float().flatten(1) @ inputs[1].detach())[:, 2 * n:]
    res = res / inputs[0].detach().float().flatten(1).square().mean(1, keepdim=True).sqrt()
    res = res + inputs[5].detach().flatten()  # [T, n n] the Sinkhorn logits
    spans = res.amax(1) - res.amin(1)
    assert (spans > LINEAR_RANGE).sum() >= 5 and (spans <= LINEAR_RANGE).sum() >= 5
    fn = functools.partial(cpu.mhc_maps_pre, sinkhorn_iters=20)
    old_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        outs, grads = run(fn, inputs)
    finally:
        torch.set_num_threads(old_threads)
    wide = [t.detach().double().requires_grad_() for t in inputs]
    want_outs, want_grads = run(functools.partial(ops.get_impl("reference").mhc_maps_pre,
                                                  sinkhorn_iters=20), wide,
                                upstream_dtype=dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    for got, want in zip([*outs, *grads], [*want_outs, *want_grads], strict=True):
        assert torch.isfinite(got).all()
        assert_close(got, want, tol)


# ---------------------------------------------------------------------------------------------
# After fork: private memory, and threads the child starts itself
# ---------------------------------------------------------------------------------------------


def _wait_for(fd: int, what: str, timeout_s: float = 120.0) -> bytes:
    """One byte from a pipe, or fail after timeout_s (a hang must fail, not block the run)."""
    ready, _, _ = select.select([fd], [], [], timeout_s)
    if not ready:
        raise AssertionError(f"timed out waiting for {what}")
    return os.read(fd, 1)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_native_ops_after_fork_are_right_in_parent_and_child():
    """The repro of a shared pool: parent and child each run an mHC connection (outputs of
    2 MiB, pooled) after fork, the parent while the child still holds its output. Both must
    equal the values computed before the fork; the child also runs a native op on 2 of its
    own threads, which must finish."""
    _need_native()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(3)
        conn = perturbed(ManifoldHyperConnection(256, 4, 0, torch.nn.Identity(), impl="cpu"))
        xs = [torch.randn(512, 4, 256) for _ in range(3)]
        with torch.no_grad():
            want = [conn(x).numpy().tobytes() for x in xs]
            kept, spare = conn(xs[0]), conn(xs[1])
            del spare  # the pool now has a block in use and a free one: both sides take it
        merge_args = [t.detach() for t in merge_inputs((512,), 4, 64, torch.float32)]
        merged_want = native.load().merge_fwd(*merge_args[:2], *merge_args[3:])
        merged_want = merged_want.numpy().tobytes()
        from_parent, to_child = os.pipe()
        from_child, to_parent = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: compare bytes (no torch op that could use libgomp's team)
            code = 1
            try:
                with torch.no_grad():
                    out = conn(xs[1])
                    os.write(to_parent, b"r")  # ran; the parent now runs its own
                    _wait_for(from_parent, "the parent")
                    ok = out.numpy().tobytes() == want[1]
                    lib = native.load()
                    x, f, _, h_post, h_res = merge_args
                    merged = lib.merge_fwd(x, f, h_post, h_res)  # on two threads of the child's
                    ok = ok and lib.threads_for(512) == 2 and lib.own_threads
                    ok = ok and merged.numpy().tobytes() == merged_want
                os.write(to_parent, b"1" if ok else b"0")
                code = 0
            finally:
                os._exit(code)
        try:
            assert _wait_for(from_child, "the child's first run") == b"r"
            with torch.no_grad():
                out = conn(xs[2])
            os.write(to_child, b"g")
            assert _wait_for(from_child, "the child's check") == b"1"
        finally:
            if os.waitpid(pid, os.WNOHANG) == (0, 0):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        assert out.numpy().tobytes() == want[2]
        assert kept.numpy().tobytes() == want[0]
    finally:
        torch.set_num_threads(threads)


def test_mhc_maps_with_rows_hundreds_apart_are_finite_and_exact(cpu_path):
    """Static biases putting H_res's rows hundreds apart: in float32's linear domain a whole
    row underflows after the first column step and 0 / 0 follows (NaN); the log domain gives
    the float64 reference's maps and gradients."""
    tokens, n, c = 40, 4, 24
    inputs = maps_inputs((tokens,), n, c, torch.float32, seed=4)
    with torch.no_grad():
        inputs[5].copy_(torch.tensor([100.0, -100.0, 0.0, 50.0]).unsqueeze(1).expand(n, n))
    h = inputs[5].detach().unsqueeze(0)
    linear = torch.softmax(h, dim=-2)
    assert not torch.isfinite(linear / linear.sum(-1, keepdim=True)).all()  # would be NaN
    outs, grads = run(functools.partial(cpu.mhc_maps_pre, sinkhorn_iters=20), inputs)
    wide = [t.detach().double().requires_grad_() for t in inputs]
    want_outs, want_grads = run(functools.partial(ops.get_impl("reference").mhc_maps_pre,
                                                  sinkhorn_iters=20), wide)
    for got, want in zip([*outs, *grads], [*want_outs, *want_grads], strict=True):
        assert torch.isfinite(got).all()
        assert_close(got, want, 2e-5)


def test_cpuinfo_reads_a_field_by_its_whole_key(monkeypatch):
    """"model" is the model number's line, not "model name" nor "model id" before it; the
    value comes without its key."""
    monkeypatch.setattr(native_build, "_cpuinfo_lines", lambda: (
        "vendor_id\t: AuthenticAMD", "model name\t: AMD EPYC", "model id\t: 7",
        "model\t\t: 2", "vmx flags\t: ept", "flags\t\t: fpu avx512f"))
    assert native_build._cpuinfo("model") == "2"
    assert native_build._cpuinfo("flags") == "fpu avx512f"
    assert native_build._cpuinfo("cpu family") == ""


def test_tuning_flags_ask_for_wide_vectors_where_512_bit_fmas_are_whole(monkeypatch):
    monkeypatch.delenv("CFLAGS", raising=False)
    lines = {"vendor_id": "GenuineIntel", "flags": "fpu avx2 avx512f", "cpu family": "6",
             "model": "143"}
    monkeypatch.setattr(native_build, "_cpuinfo", lambda field: lines[field])
    assert native_build.tuning_flags() == ["-DTORCH_MHC_SKINNY_W=16"]
    lines["flags"] = "fpu avx2"
    assert native_build.tuning_flags() == []
    # Zen 4 splits a 512-bit FMA in two halves; Zen 5 (family 26) and later do not
    lines.update({"vendor_id": "AuthenticAMD", "flags": "fpu avx512f", "cpu family": "25"})
    assert native_build.tuning_flags() == []
    lines.update({"cpu family": "26", "model": "2"})  # an EPYC
    assert native_build.tuning_flags() == ["-DTORCH_MHC_SKINNY_W=16"]
    lines["model"] = "36"  # Strix Point (0x24): AVX-512 on 256-bit datapaths
    assert native_build.tuning_flags() == []
    lines["model"] = "68"  # a desktop part (0x44)
    assert native_build.tuning_flags() == ["-DTORCH_MHC_SKINNY_W=16"]
    lines["flags"] = "fpu avx2"
    assert native_build.tuning_flags() == []
    lines.update({"flags": "fpu avx512f", "cpu family": ""})  # no such line
    assert native_build.tuning_flags() == []


def test_library_flags_let_cflags_defines_take_the_place_of_ours(monkeypatch):
    """$CFLAGS (or a benchmark's flags) choosing the width itself: its define replaces the
    CPU's, in either spelling, and nothing else of ours is dropped."""
    monkeypatch.setattr(native_build, "tuning_flags",
                        lambda: ["-DTORCH_MHC_SKINNY_W=16", "-DKEEP"])
    monkeypatch.delenv("CFLAGS", raising=False)
    ours = [*native_build.FLAGS, *native_build.OPENMP]
    assert native_build.library_flags() == [*ours, "-DTORCH_MHC_SKINNY_W=16", "-DKEEP"]
    monkeypatch.setenv("CFLAGS", "-mno-avx512f -DTORCH_MHC_SKINNY_W=8")  # None: $CFLAGS
    assert native_build.library_flags() == [*ours, "-DKEEP", "-mno-avx512f",
                                            "-DTORCH_MHC_SKINNY_W=8"]
    for cflags in (["-O2", "-DTORCH_MHC_SKINNY_W=8"], ["-D", "TORCH_MHC_SKINNY_W=8"]):
        assert native_build.library_flags(cflags=cflags) == [*ours, "-DKEEP", *cflags]
    assert native_build.library_flags(openmp=False, cflags=["-DKEEP=2"]) == [
        *native_build.FLAGS, "-DTORCH_MHC_SKINNY_W=16", "-DKEEP=2"]


@pytest.fixture(scope="module")
def narrow_library(tmp_path_factory) -> native.NativeOps:
    """The library built with 8-float skinny vectors whatever the CPU."""
    _need_native()
    out = tmp_path_factory.mktemp("narrow") / "narrow.so"
    cflags = [*shlex.split(os.environ.get("CFLAGS", "")), "-DTORCH_MHC_SKINNY_W=8"]
    native_build._compile(native_build._compiler(),
                          native_build.library_flags(openmp=False, cflags=cflags), out)
    return native.NativeOps(out)


@pytest.mark.parametrize("n,res,dtype", [
    (4, "mhc", torch.float32), (4, "mhc", torch.bfloat16), (4, "mhc-lite", torch.float32),
    (4, "kromhc", torch.float32), (4, "mhc-static-res", torch.float32),
    (2, "mhc", torch.float32), (3, "mhc", torch.float32), (5, "mhc", torch.float32),
    (6, "mhc", torch.float32), (7, "mhc", torch.float32), (8, "mhc", torch.bfloat16),
])  # 1 to 5 16-float vectors a row
def test_wide_and_narrow_forward_give_the_same_bits(narrow_library, n, res, dtype):
    """The training forward's x @ phi on 16-float vectors over phi padded to 16 columns
    (xphi_tile16) sums each logit in the same order as the 8-float loops over the unpadded
    rows: every output is bit for bit the same. The narrow library is built here with the
    width forced to 8; on CPUs where build.py asks for 16, the loaded one is the wide one."""
    wide = native.load()
    if native_build.tuning_flags() and not os.environ.get("CFLAGS", "").strip():
        assert wide.skinny_width == 16  # CFLAGS may take it back (-DTORCH_MHC_SKINNY_W=8)
    assert narrow_library.skinny_width == 8
    c, t = 40, 37  # 37 tokens: full tiles and single tokens; C not a multiple of 16
    g = torch.Generator().manual_seed(n)
    m = 2 * n + (n * n if res == "mhc" else res_count(res, n))
    x = torch.randn(t, n, c, generator=g).to(dtype)
    phi = torch.randn(n * c, m, generator=g) / (n * c) ** 0.5
    ab = torch.randn(2, m, generator=g)
    iters = 20 if res == "mhc" else 1
    outs = []
    for lib in (wide, narrow_library):
        phip = torch.nn.functional.pad(phi, (0, native.padded_width(m, lib.skinny_width) - m))
        outs.append(lib.maps_fwd(x, phip.contiguous(), ab, iters, 1e-6, 0.0, 0.0, True,
                                 native.RES[res]))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cols, rows, dtype", [(88, 160, torch.float32), (16, 160, torch.float32),
                                               (28, 160, torch.float32), (24, 100, torch.float32),
                                               (24, 160, torch.float64)])
def test_maps_refuse_a_table_the_loops_would_overrun(cols, rows, dtype):
    """phi's padded table sizes the loops' register tiles: one wider than 80 columns wrote
    past them, one narrower than M read past its rows. A clear error instead, through the
    custom op too; the right table passes."""
    _need_native()
    n, c, m = 4, 40, 24
    x = torch.randn(5, n, c)
    ab = torch.randn(2, m)
    good = torch.zeros(n * c, 24)
    native.load().maps_fwd(x, good, ab, 20, 1e-6, 0.0, 0.0, True)
    bad = torch.zeros(rows, cols, dtype=dtype)
    with pytest.raises(ValueError, match=r"phi's table as float32 \[160, Mp\]"):
        native.load().maps_fwd(x, bad, ab, 20, 1e-6, 0.0, 0.0, True)
    with pytest.raises(ValueError, match="phi's table"):
        native.load().maps_infer(x, bad, ab, 20, 1e-6, 0.0, 0.0)
    with pytest.raises(ValueError, match="phi's table"):
        torch.ops.torch_mhc.cpu_mhc_maps_fwd(x, bad, ab, 20, 1e-6, 0.0, 0.0, True)


def test_compiled_cpu_sinkhorn_differentiates_the_loop_itself(monkeypatch):
    """Under torch.compile ops.cpu.sinkhorn runs the loop through autograd, as
    functional.sinkhorn does there, not its recomputing autograd function (torch 2.11
    compiled such a function to a zero gradient): the gradients equal eager's."""
    from torch_mhc.functional import sinkhorn as functional_sinkhorn
    from torch_mhc.ops.cpu import ops as cpu_ops

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 3, 3, generator=gen)
    x[::2] *= 40.0  # the log domain for these
    upstream = torch.randn(5, 3, 3, generator=gen)
    (out_e, grad_e), (out_c, grad_c) = compiled_and_eager(
        lambda h: cpu_ops.sinkhorn(h, 5), x, upstream, monkeypatch,
        [cpu_ops._Sinkhorn, functional_sinkhorn._Sinkhorn])
    assert grad_e.abs().max() > 0.1
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad_c, grad_e, rtol=0, atol=1e-6)
