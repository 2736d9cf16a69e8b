"""The `triton` implementation of mHC's successors' maps (variant_maps, variant_maps_pre)
against `functional.successors`: kernels, custom ops, compile.

The kernels run as in tests/ops/test_triton.py (its docstring says why): on a GPU in this
process; without one in a fresh process with TRITON_INTERPRET=1 from the start, started by
`test_kernels_in_a_fresh_interpreter_process`; run directly that way, in-process:

    TRITON_INTERPRET=1 pytest tests/ops/test_triton_successors.py
"""


import pytest
import torch

pytest.importorskip("triton")

import torch_mhc.ops as ops  # noqa: E402
from tests.helpers.op_cases import Branch, assert_close, perturbed  # noqa: E402
from tests.helpers.triton_env import (  # noqa: E402
    DEVICE,
    DTYPES,
    ON_GPU,
    RUN_HERE,
    TOL,
    assert_connection_matches_reference,
    kernel_test,
    run_in_fresh_interpreter,
    tri,
)
from tests.ops.test_successor_maps import variant_inputs  # noqa: E402
from torch_mhc.functional import maps as reference_maps  # noqa: E402
from torch_mhc.functional import successors as ref  # noqa: E402

CASES = [("mhc-lite", n) for n in (2, 3, 4)] + [("kromhc", n) for n in (1, 2, 4, 8)] \
    + [("mhc-static-res", n) for n in (1, 3, 4)]
OUTPUTS = ("h_pre", "h_post", "h_res", "aggregate", "merged")
INPUTS = ("x", "phi", "alpha", "b_pre", "b_post", "b_res")


def _to(tensors, device, dtype=None):
    """Leaf copies on device (dtype: for floating tensors; None stays None)."""
    return [None if t is None else t.detach().to(device, dtype).requires_grad_()
            for t in tensors]


def _merged(maps_pre, merge, kind, inputs, f):
    """H_pre, H_post, H_res, the aggregation and the merge H_res x + H_post^T f."""
    h_pre, h_post, h_res, agg = maps_pre(kind, *inputs)
    return h_pre, h_post, h_res, agg, merge(inputs[0], f, h_post, h_res)


def _outputs_and_grads(maps_pre, merge, kind, inputs, f, upstream_dtype, seed=1):
    """The outputs and the gradients of every input (x, the parameters, f) for random upstream
    gradients, rounded to upstream_dtype so that both sides get the same values. Outputs that
    depend on nothing (the reference's constant H_res) take no upstream gradient; the
    kernels' H_res then gets one and must pass nothing back."""
    outs = _merged(maps_pre, merge, kind, inputs, f)
    g = torch.Generator().manual_seed(seed)
    ups = [torch.randn(o.shape, generator=g).to(upstream_dtype).to(o.device, o.dtype)
           for o in outs]
    keep = [i for i, o in enumerate(outs) if o.requires_grad]
    wrt = [t for t in (*inputs, f) if t is not None]
    grads = torch.autograd.grad([outs[i] for i in keep], wrt, [ups[i] for i in keep])
    return [o.detach().cpu() for o in outs], [g.cpu() for g in grads]


def check_against_reference(kind, n, tokens, dtype, c=12, x=None, phi=None):
    """Triton's variant_maps_pre and post_merge against functional.successors and
    functional.maps.post_merge in fp32 (from the same rounded x and f); x, phi: replace the
    drawn ones (non-contiguous views)."""
    inputs = variant_inputs(kind, tokens, n, c, dtype)
    if x is not None:
        inputs[0] = x
    if phi is not None:
        inputs[1] = phi
    f = torch.randn(*tokens, c, generator=torch.Generator().manual_seed(2)).to(dtype)
    ref_in = [inputs[0].detach().float().requires_grad_(), *_to(inputs[1:], "cpu")]
    out_ref, grad_ref = _outputs_and_grads(ref.variant_maps_pre, reference_maps.post_merge, kind,
                                           ref_in, f.float().requires_grad_(), dtype)
    tri_in = [t if t is None else t.detach().to(DEVICE).requires_grad_() for t in inputs]
    out_tri, grad_tri = _outputs_and_grads(tri.variant_maps_pre, tri.post_merge, kind, tri_in,
                                           f.to(DEVICE).requires_grad_(), dtype)
    # Matmuls run in TF32 for half-precision streams (ops/triton/ops.py, TF32).
    maps_tol = 2e-5 if dtype == torch.float32 else 2e-3
    for a, e, name in zip(out_tri, out_ref, OUTPUTS, strict=True):
        assert a.dtype == (torch.float32 if name.startswith("h_") else dtype), name
        assert_close(a, e, maps_tol if name.startswith("h_") else TOL[dtype])
    names = [name for name, t in zip(INPUTS, inputs, strict=True) if t is not None] + ["f"]
    for a, e, name in zip(grad_tri, grad_ref, names, strict=True):
        assert a.dtype == (dtype if name in ("x", "f") else torch.float32), name
        assert_close(a, e, TOL[dtype] if name in ("x", "f") else max(maps_tol, 1e-4))
    return out_tri


# ---------------------------------------------------------------------------------------------
# Maps, aggregation and merge against the reference
# ---------------------------------------------------------------------------------------------


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kind", "n"), CASES)
def test_variant_maps_pre_and_merge_match_reference(kind, n, dtype):
    """74 tokens: the per-token kernels' blocks of 32 and fp32's matmul blocks of 64 end in a
    ragged tail."""
    check_against_reference(kind, n, (2, 37), dtype)


@kernel_test
def test_mhc_lite_at_its_largest_n():
    """n = 5: 120 res logits, a res tile 128 wide."""
    check_against_reference("mhc-lite", 5, (3, 5), torch.float32)


@kernel_test
def test_h_res_is_exact_at_zero_logits():
    """Built in float64 and rounded once, as the reference: zero logits give mHC-lite's
    uniform mixture and KromHC's 1/2^m entries, 1/n each, exactly."""
    for kind, n in (("mhc-lite", 3), ("mhc-lite", 4), ("kromhc", 8)):
        r = ref.res_count(kind, n)
        x = torch.randn(5, n, 8, device=DEVICE)
        phi = torch.zeros(n * 8, 2 * n + r, device=DEVICE)
        alpha = torch.ones(3, device=DEVICE)
        zeros = torch.zeros(n, device=DEVICE)
        _, _, h_res = tri.variant_maps(kind, x, phi, alpha, zeros, zeros,
                                       torch.zeros(r, device=DEVICE))
        assert torch.equal(h_res.cpu(), torch.full((5, n, n), 1.0 / n))


@kernel_test
def test_variant_maps_of_an_empty_batch():
    for kind, n in (("mhc-lite", 3), ("kromhc", 4), ("mhc-static-res", 3)):
        inputs = _to(variant_inputs(kind, (0, 3), n, 8, torch.float32), DEVICE)
        h_pre, h_post, h_res, agg = tri.variant_maps_pre(kind, *inputs)
        assert h_pre.shape == h_post.shape == (0, 3, n) and h_res.shape == (0, 3, n, n)
        assert agg.shape == (0, 3, 8)
        wrt = [t for t in inputs if t is not None]
        grads = torch.autograd.grad([h_pre, h_post, h_res, agg], wrt,
                                    [torch.ones_like(o) for o in (h_pre, h_post, h_res, agg)])
        assert grads[0].shape == inputs[0].shape
        for g, p in zip(grads[1:], wrt[1:], strict=True):
            assert g.shape == p.shape and not g.abs().any()


@kernel_test
def test_variant_maps_accept_non_contiguous_inputs():
    """x as a transposed view [.., n, C] of [.., C, n] and phi as a transposed view."""
    for kind, n in (("mhc-lite", 3), ("kromhc", 4)):
        c, r = 10, ref.res_count(kind, n)
        g = torch.Generator().manual_seed(4)
        x = torch.randn(3, 2, c, n, generator=g).transpose(-1, -2).requires_grad_()
        phi = (torch.randn(2 * n + r, n * c, generator=g) / (n * c) ** 0.5).t().requires_grad_()
        assert not x.is_contiguous() and not phi.is_contiguous()
        check_against_reference(kind, n, (3, 2), torch.float32, c=c, x=x, phi=phi)


@pytest.fixture
def small_grid(monkeypatch):
    """Plans that aim at 4 programs and split K down to one BLOCK_K tile (as in
    tests/ops/test_triton.py), so that a few dozen tokens take the split paths."""
    monkeypatch.setattr(tri, "_PROGRAMS", 4)
    monkeypatch.setattr(tri, "_MIN_K_TILES", 1)


@kernel_test
@pytest.mark.parametrize(("kind", "n", "tokens"), [("mhc-lite", 4, (17,)),
                                                   ("kromhc", 8, (70,))])
def test_variant_maps_on_the_split_paths(kind, n, tokens, small_grid):
    """K = n * 40 over several splits (17 tokens: one token block; 70: two, the second
    ragged)."""
    from torch_mhc.ops.triton import aot

    args = aot.op_args(n, torch.float32, tokens[0], 40, 3)[f"variant_maps_fwd:{kind}"]
    launches = tri.plan_variant_fwd(*args)[0]
    assert launches[0].grid[1] > 1  # K split
    check_against_reference(kind, n, tokens, torch.float32, c=40)


# ---------------------------------------------------------------------------------------------
# Custom ops, dispatch, autocast, the connection compiled
# ---------------------------------------------------------------------------------------------


def _op_samples(kind, n):
    """Arguments of variant_maps_fwd and variant_maps_bwd (tiny: opcheck runs each often)."""
    x, phi, alpha, b_pre, b_post, b_res = [
        None if t is None else t.detach().to(DEVICE)
        for t in variant_inputs(kind, (3,), n, 5, torch.float32)]
    fwd = (kind, x, phi, alpha, b_pre, b_post, b_res, 1e-6)
    h_pre, h_post, h_res, logits, r = torch.ops.torch_mhc.variant_maps_fwd(*fwd)
    bwd = (*fwd[:7], logits, r, torch.randn_like(h_pre), torch.randn_like(h_post),
           torch.randn_like(h_res))
    return fwd, bwd


@kernel_test
@pytest.mark.parametrize(("kind", "n"), [("mhc-lite", 3), ("kromhc", 4), ("mhc-static-res", 2)])
def test_custom_ops_pass_opcheck(kind, n):
    fwd, bwd = _op_samples(kind, n)
    # differentiable: check the autograd registration too (copies: bwd holds the same tensors)
    fwd = tuple(a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else a
                for a in fwd)
    torch.library.opcheck(torch.ops.torch_mhc.variant_maps_fwd.default, fwd)
    torch.library.opcheck(torch.ops.torch_mhc.variant_maps_bwd.default, bwd)


@kernel_test
def test_triton_ops_take_the_kernels():
    impl = ops.get_impl("triton")
    assert impl.variant_maps is tri.variant_maps
    assert impl.variant_maps_pre is tri.variant_maps_pre


@kernel_test
def test_beyond_the_tiles_the_reference_maps_and_bad_arguments_are_refused():
    inputs = _to(variant_inputs("kromhc", (2,), 32, 2, torch.float32), DEVICE)
    got = tri.variant_maps("kromhc", *inputs)
    want = ref.variant_maps("kromhc", *inputs)
    for a, e in zip(got, want, strict=True):
        assert torch.equal(a, e)
    x, phi, alpha, b_pre, b_post, b_res = _to(variant_inputs("mhc-lite", (2,), 3, 4,
                                                             torch.float32), DEVICE)
    with pytest.raises(ValueError, match="phi of shape"):
        tri.variant_maps("mhc-lite", x, phi[:, :-1], alpha, b_pre, b_post, b_res)
    with pytest.raises(ValueError, match="b_res of shape"):
        tri.variant_maps("mhc-lite", x, phi, alpha, b_pre, b_post, None)
    with pytest.raises(ValueError, match="n <= 5"):
        tri.variant_maps("mhc-lite", torch.zeros(1, 6, 2, device=DEVICE), phi, alpha, b_pre,
                         b_post, b_res)
    with pytest.raises(TypeError, match="float64"):
        tri.variant_maps("mhc-lite", x.double(), phi, alpha, b_pre, b_post, b_res)


@kernel_test
def test_autocast_runs_the_maps_matmul_in_the_autocast_dtype(monkeypatch):
    device_type, dt = ("cuda", torch.bfloat16) if ON_GPU else ("cpu", torch.float16)
    seen = []
    plan = tri.plan_variant_fwd

    def recording(kind, x, phi, *args, **kwargs):
        seen.append((x.dtype, phi.dtype))
        return plan(kind, x, phi, *args, **kwargs)

    monkeypatch.setattr(tri, "plan_variant_fwd", recording)
    inputs = _to(variant_inputs("kromhc", (9,), 4, 8, torch.float32), DEVICE)
    with torch.autocast(device_type, dtype=dt):
        got = tri.variant_maps("kromhc", *inputs)
    want = ref.variant_maps("kromhc", inputs[0].to(dt).float(), inputs[1].to(dt).float(),
                            *inputs[2:])
    assert seen == [(dt, dt)]
    for a, e in zip(got, want, strict=True):
        assert a.dtype == torch.float32
        assert_close(a.cpu(), e.detach().cpu(), 2e-3)


@kernel_test
def test_connection_triton_equals_reference_and_compiles_fullgraph():
    from torch_mhc import MHCLite

    c, n = 12, 3
    torch.manual_seed(0)
    conn_ref = perturbed(MHCLite(c, n, 1, Branch(c), impl="reference"))
    conn_tri = MHCLite(c, n, 1, Branch(c), impl="triton")
    conn_tri.load_state_dict(conn_ref.state_dict())
    conn_tri.to(DEVICE)
    x = torch.randn(2, 5, n, c)
    upstream = torch.randn(2, 5, n, c)
    assert_connection_matches_reference(conn_ref, conn_tri, x, upstream)


@kernel_test
def test_connection_compiles_for_several_stream_counts_in_one_process():
    """Recompiling the connection's code for other shapes (here T, then n), torch.compile
    makes those dimensions dynamic; mHC-lite's n! must still come out an int
    (math.factorial refused the stream count as a SymInt)."""
    from torch_mhc import MHCLite

    torch._dynamo.reset()
    c = 12
    for n, t in ((2, 5), (2, 7), (3, 5), (4, 6)):
        torch.manual_seed(n)
        conn_ref = perturbed(MHCLite(c, n, 1, Branch(c), impl="reference"))
        conn_tri = MHCLite(c, n, 1, Branch(c), impl="triton")
        conn_tri.load_state_dict(conn_ref.state_dict())
        conn_tri.to(DEVICE)
        assert_connection_matches_reference(conn_ref, conn_tri, torch.randn(2, t, n, c),
                                            torch.randn(2, t, n, c))


@pytest.mark.skipif(RUN_HERE, reason="the kernel tests run in this process")
def test_kernels_in_a_fresh_interpreter_process():
    """Run this module's kernel tests where TRITON_INTERPRET=1 precedes any triton import."""
    run_in_fresh_interpreter(__file__)
