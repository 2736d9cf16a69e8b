"""The `inductor` implementation (the reference ops under torch.compile) against the reference.

On CPU, Inductor generates C++ and compiles it: a few seconds per graph, so the sizes are
tiny and the iterations few. Each test compiles forward and backward of one or two ops
(the connection test covers mhc_maps_pre and post_merge, the Sinkhorn test the far logits).
"""

import pytest
import torch

import torch_mhc.ops as ops
from tests.helpers.op_cases import assert_close, reference_and
from tests.helpers.references import sinkhorn_log_naive
from torch_mhc.ops import reference

pytestmark = pytest.mark.slow


def test_selectable_by_name_and_environment(monkeypatch):
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    impl = ops.get_impl("inductor")
    assert impl.name == "inductor"
    monkeypatch.setenv(ops.ENV_VAR, "inductor")
    assert ops.resolve_impl_name("auto", "cpu", torch.float32) == "inductor"
    assert ops.get_impl("auto", "cpu").mhc_maps is impl.mhc_maps


def test_sinkhorn_mixes_domains_like_the_reference():
    """Near and far matrices in one batch: the compiled graph evaluates both domains and
    selects per matrix (no data-dependent shapes), the function functional.sinkhorn defines."""
    ind = ops.get_impl("inductor")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, 3, generator=gen) * 2
    x[1] = torch.tensor([[100.0, 100.0, 0.0], [-100.0, -100.0, 0.0], [0.0, 0.0, 50.0]])
    upstream = torch.randn(6, 3, 3, generator=gen)
    outs = []
    for fn in (reference.sinkhorn, ind.sinkhorn):
        xi = x.clone().requires_grad_()
        out = fn(xi, 4)
        outs.append((out, *torch.autograd.grad(out, xi, upstream)))
    (out_ref, grad_ref), (out_ind, grad_ind) = outs
    assert torch.isfinite(out_ind).all() and torch.isfinite(grad_ind).all()
    assert_close(out_ind, out_ref, 1e-6)
    assert_close(grad_ind, grad_ref, 1e-5)
    xd = x[1:2].double()
    assert_close(out_ind[1:2], sinkhorn_log_naive(xd, 4), 1e-5)


def test_connection_with_inductor_ops_equals_reference():
    """mhc_maps_pre (maps + aggregation, one graph) and post_merge, forward and every
    gradient (streams and parameters)."""
    c, n = 12, 4
    conn_ref, conn_ind = reference_and("inductor", c, n, sinkhorn_iters=3)
    x = torch.randn(2, 5, n, c)
    upstream = torch.randn(2, 5, n, c)
    results = []
    for conn in (conn_ref, conn_ind):
        xi = x.clone().requires_grad_()
        out = conn(xi)
        results.append([out, *torch.autograd.grad(out, [xi, *conn.parameters()], upstream)])
    for a, e in zip(results[1], results[0], strict=True):
        assert_close(a, e, 2e-5)


def test_bench_sinkhorn_compares_the_inductor_ops():
    from torch_mhc.tools.bench.sinkhorn import bench_sinkhorn

    result = bench_sinkhorn(tokens=8, sizes=(3,), iters=3, repeats=1, inductor=True)
    entry = result["results"][0]["entries"]["ops.inductor"]
    assert entry["max_abs_diff"] <= 1e-6 and entry["median_ms"] > 0


def test_compiled_for_plain_tensors_reference_for_meta_and_dispatch_modes():
    """The ops compile for tensors with memory; on meta tensors and under a dispatch mode
    (FlopCounterMode here) they run the reference functions uncompiled, which torch.compile
    could not, and which the mode sees op by op (the FLOPs of impl="reference")."""
    from torch._dynamo.utils import counters
    from torch.utils.flop_counter import FlopCounterMode

    ind = ops.get_impl("inductor")
    x, h = torch.randn(3, 5, 4, 8), torch.rand(3, 5, 4)  # shapes no other test compiles
    graphs = counters["stats"]["unique_graphs"]
    with FlopCounterMode(display=False) as counted:
        out = ind.pre_aggregate(x, h)
    with FlopCounterMode(display=False) as counted_ref:
        expected = reference.pre_aggregate(x, h)
    assert counted.get_total_flops() == counted_ref.get_total_flops() > 0
    assert torch.equal(out, expected)
    meta = ind.pre_aggregate(x.to("meta"), h.to("meta"))
    assert meta.is_meta and meta.shape == expected.shape
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled for those
    assert_close(ind.pre_aggregate(x, h), expected, 1e-6)
    assert counters["stats"]["unique_graphs"] > graphs  # compiled for plain tensors
