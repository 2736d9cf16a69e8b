"""The successors' maps op (variant_maps, variant_maps_pre): ops.cpu against the reference
functional.successors, forward and backward with random upstream gradients."""

import pytest
import torch

from tests.helpers.op_cases import TOL, assert_close
from torch_mhc import ops
from torch_mhc.functional import successors as ref
from torch_mhc.ops.cpu import native
from torch_mhc.ops.cpu import ops as cpu_ops
from torch_mhc.ops.cpu import variants as cpu_variants

CASES = [("mhc-lite", n) for n in (2, 3, 4, 5)] + [("kromhc", n) for n in (1, 2, 4, 8)] \
    + [("mhc-static-res", n) for n in (1, 3, 4, 8)]
SHAPES = [(1,), (3, 5), (2, 37)]  # leading shapes: one token, a batch, a tail past 64


def variant_inputs(kind, tokens, n, c, dtype, seed=0):
    """Streams x [*tokens, n, C] and a successor's parameters with O(1) logits (requiring
    grad; b_res None without res logits)."""
    g = torch.Generator().manual_seed(seed)
    r = ref.res_count(kind, n)
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    x = torch.randn(*tokens, n, c, generator=g).to(dtype)
    phi = (torch.randn(n * c, 2 * n + r, generator=g) / (n * c) ** 0.5).to(pdt)
    alpha = torch.tensor([0.8, 1.1, 1.5][: 3 if r else 2], dtype=pdt)
    b_pre = (torch.randn(n, generator=g) * 0.5).to(pdt)
    b_post = (torch.randn(n, generator=g) * 0.5).to(pdt)
    b_res = (torch.randn(r, generator=g) * 0.5).to(pdt) if r else None
    return [None if t is None else t.requires_grad_()
            for t in (x, phi, alpha, b_pre, b_post, b_res)]


def merged(maps_pre, kind, inputs, f, fused):
    """H_pre, H_post, H_res, the aggregation and the merge H_res x + H_post^T f, with the
    merge on ops.cpu.post_merge (fused_dx: through x_for_merge, as a connection does)."""
    if fused:
        h_pre, h_post, h_res, a, x_m = maps_pre(kind, *inputs, fused_dx=True)
        out = cpu_ops.post_merge(x_m, f, h_post, h_res, fused_dx=True)
    else:
        h_pre, h_post, h_res, a = maps_pre(kind, *inputs)
        out = cpu_ops.post_merge(inputs[0], f, h_post, h_res)
    return h_pre, h_post, h_res, a, out


def grads(outs, inputs, seed=1):
    """Gradients of every input for random upstream gradients of the outputs (the outputs
    that depend on nothing, as KromHC's H_res at n = 1, are left out)."""
    g = torch.Generator().manual_seed(seed)
    ups = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
    keep = [i for i, o in enumerate(outs) if o.requires_grad]
    wrt = [t for t in inputs if t is not None]
    return torch.autograd.grad([outs[i] for i in keep], wrt, [ups[i] for i in keep])


def check_against_reference(kind, n, tokens, dtype, fused, c=24):
    inputs = variant_inputs(kind, tokens, n, c, dtype)
    f = torch.randn(*tokens, c, generator=torch.Generator().manual_seed(2)).to(dtype)
    out_c = merged(cpu_variants.variant_maps_pre, kind, inputs, f, fused)
    out_r = merged(ref.variant_maps_pre, kind, inputs, f, False)
    tol = TOL[dtype]
    for a, e in zip(out_c, out_r, strict=True):
        assert a.dtype == e.dtype
        assert_close(a.detach(), e.detach(), tol)
    for a, e in zip(grads(out_c, inputs), grads(out_r, inputs), strict=True):
        assert_close(a, e, tol)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("tokens", SHAPES)
@pytest.mark.parametrize(("kind", "n"), CASES)
def test_cpu_matches_reference_float64(kind, n, tokens, fused):
    check_against_reference(kind, n, tokens, torch.float64, fused)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kind", "n"), CASES)
def test_cpu_native_matches_reference(kind, n, dtype, fused):
    """float32 / bf16 streams take the native loops (mhc-lite at n = 5 the torch ops)."""
    check_against_reference(kind, n, (2, 37), dtype, fused)


def test_native_path_is_taken():
    x = torch.randn(4, 4, 8)
    if not (native.supports(x) and native.load() is not None):
        pytest.skip("no native library")
    for kind in ref.VARIANT_KINDS:
        m = 8 + ref.res_count(kind, 4)
        assert cpu_variants.takes_native(x, m), kind
    assert not cpu_variants.takes_native(torch.randn(4, 5, 8), 10 + 120)  # mhc-lite n = 5


def test_gradcheck_float64():
    for kind, n in [("mhc-lite", 3), ("kromhc", 4), ("mhc-static-res", 2)]:
        inputs = variant_inputs(kind, (2, 3), n, 5, torch.float64)
        present = [t for t in inputs if t is not None]

        def fn(*ts, kind=kind, has_res=inputs[-1] is not None):
            args = list(ts) + ([] if has_res else [None])
            h_pre, h_post, h_res, a, x_m = cpu_variants.variant_maps_pre(kind, *args,
                                                                         fused_dx=True)
            f = torch.ones_like(a)
            return h_pre, h_post, a, cpu_ops.post_merge(x_m, f, h_post, h_res, fused_dx=True)

        assert torch.autograd.gradcheck(fn, present)


@pytest.mark.parametrize(("kind", "n"), [("mhc-lite", 4), ("kromhc", 4), ("mhc-static-res", 4)])
def test_no_grad_and_maps_without_pre(kind, n):
    inputs = variant_inputs(kind, (3,), n, 16, torch.float32)
    with torch.no_grad():
        got = cpu_variants.variant_maps(kind, *inputs)
        want = ref.variant_maps(kind, *inputs)
    for a, e in zip(got, want, strict=True):
        assert_close(a, e, TOL[torch.float32])


def test_res_maps_are_the_kinds():
    x, *params = variant_inputs("mhc-static-res", (5,), 3, 8, torch.float32)
    h_res = cpu_variants.variant_maps("mhc-static-res", x, *params)[2]
    assert torch.equal(h_res, torch.eye(3).expand(5, 3, 3))
    for kind, n in [("mhc-lite", 4), ("kromhc", 8)]:
        h_res = cpu_variants.variant_maps(kind, *variant_inputs(kind, (7,), n, 8,
                                                                torch.float64))[2]
        ones = torch.ones(7, n, dtype=torch.float64)
        torch.testing.assert_close(h_res.sum(-1), ones, rtol=0, atol=1e-15)
        torch.testing.assert_close(h_res.sum(-2), ones, rtol=0, atol=1e-15)


def test_errors():
    x = torch.randn(2, 6, 4)
    with pytest.raises(ValueError, match="n <= 5"):
        cpu_variants.variant_maps("mhc-lite", x, torch.zeros(24, 12 + 720), torch.ones(3),
                                  torch.zeros(6), torch.zeros(6), torch.zeros(720))
    with pytest.raises(ValueError, match="power of two"):
        cpu_variants.variant_maps("kromhc", torch.randn(2, 3, 4), torch.zeros(12, 7),
                                  torch.ones(3), torch.zeros(3), torch.zeros(3), torch.zeros(1))
    with pytest.raises(ValueError, match="unknown variant"):
        ref.variant_maps("mhc", x, None, None, None, None)
    for kind in ref.VARIANT_KINDS:  # (mhc-lite's n! table would take -1 as its last entry)
        for n in (0, -1):
            with pytest.raises(ValueError, match=rf"{kind} needs n >= 1 streams, got {n}"):
                ref.res_count(kind, n)
    with pytest.raises(ValueError, match="expects phi"):
        cpu_variants.variant_maps("kromhc", torch.randn(2, 4, 4), torch.zeros(16, 9),
                                  torch.ones(3), torch.zeros(4), torch.zeros(4), torch.zeros(2))


def test_ops_interface():
    cpu = ops.get_impl("cpu")
    assert cpu.variant_maps_pre is cpu_variants.variant_maps_pre
    assert cpu.variant_maps is cpu_variants.variant_maps
    reference = ops.get_impl("reference")
    inputs = variant_inputs("kromhc", (3,), 4, 8, torch.float64)
    got = reference.variant_maps_pre("kromhc", *inputs)
    want = ref.variant_maps_pre("kromhc", *inputs)
    for a, e in zip(got, want, strict=True):
        assert torch.equal(a, e)
    # no successor kernel on inductor: the reference maps, its own aggregation
    assert ops.get_impl("inductor").variant_maps is ref.variant_maps


@pytest.mark.parametrize("kind", ["mhc-lite", "kromhc", "mhc-static-res"])
@pytest.mark.parametrize("grad", [True, False])
def test_misshapen_parameters_are_refused_before_the_native_loops(kind, grad):
    """phi's n C rows and the n gates are read without bounds: another shape is one
    ValueError naming the parameter (a phi one row short once read past its end)."""
    x, phi, alpha, b_pre, b_post, b_res = variant_inputs(kind, (3,), 4, 16, torch.float32)
    x = x.detach().requires_grad_(grad)
    cases = {"phi": (phi[:-1], b_pre), "b_pre": (phi, b_pre[:3])}
    for name, (p, bp) in cases.items():
        with pytest.raises(ValueError, match=rf"{kind} with n = 4, C = 16 expects {name} of"):
            cpu_variants.variant_maps_pre(kind, x, p, alpha, bp, b_post, b_res)


@pytest.mark.parametrize(("kind", "n"), [("mhc-lite", 4), ("kromhc", 4), ("mhc-static-res", 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_empty_batch(kind, n, dtype):
    """No tokens: empty maps and aggregation, an empty dx and zero parameter gradients (a
    sum over no tokens), as the reference gives."""
    inputs = variant_inputs(kind, (0,), n, 16, dtype)
    f = torch.zeros(0, 16, dtype=dtype)
    out_c = merged(cpu_variants.variant_maps_pre, kind, inputs, f, True)
    out_r = merged(ref.variant_maps_pre, kind, inputs, f, False)
    for a, e in zip(out_c, out_r, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype
    wrt = [t for t in inputs if t is not None]
    for outs in (out_c, out_r):
        keep = [o for o in outs if o.requires_grad]
        got = torch.autograd.grad(keep, wrt, [torch.ones_like(o) for o in keep],
                                  allow_unused=True)
        for t, d in zip(wrt, got, strict=True):
            d = torch.zeros_like(t) if d is None else d  # unused: the reference's x
            assert d.shape == t.shape and torch.equal(d, torch.zeros_like(t))


@pytest.mark.parametrize(("kind", "n"), [("mhc-lite", 4), ("kromhc", 4), ("mhc-static-res", 2)])
def test_non_contiguous_input(kind, n):
    """Streams seen through a transpose give the contiguous copy's maps and gradients,
    bit for bit."""
    x, *params = variant_inputs(kind, (6,), n, 16, torch.float32)
    xt = x.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()  # [6, n, C]
    assert not xt.is_contiguous()
    xc = x.detach().clone().requires_grad_()
    ups = None
    results = []
    for xin in (xt, xc):
        outs = cpu_variants.variant_maps_pre(kind, xin, *params)
        if ups is None:
            g = torch.Generator().manual_seed(3)
            ups = [torch.randn(o.shape, generator=g) for o in outs]
        keep = [i for i, o in enumerate(outs) if o.requires_grad]
        dx = torch.autograd.grad([outs[i] for i in keep], xin, [ups[i] for i in keep])[0]
        results.append([o.detach() for o in outs] + [dx])
    for a, e in zip(*results, strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize(("kind", "n"), [("mhc-lite", 3), ("mhc-lite", 4), ("kromhc", 8)])
@pytest.mark.parametrize("only", ["h_pre", "h_post", "h_res"])
def test_native_gradient_of_one_map(kind, n, only):
    """A gradient arriving for one map only (the others None in the backward) matches the
    reference's."""
    inputs = variant_inputs(kind, (2, 37), n, 24, torch.float32)
    which = ["h_pre", "h_post", "h_res"].index(only)
    got = cpu_variants.variant_maps(kind, *inputs)[which]
    want = ref.variant_maps(kind, *inputs)[which]
    up = torch.randn(got.shape, generator=torch.Generator().manual_seed(4))
    wrt = [t for t in inputs if t is not None]
    for a, e in zip(torch.autograd.grad(got, wrt, up, allow_unused=True),
                    torch.autograd.grad(want, wrt, up, allow_unused=True), strict=True):
        if e is None:  # this map does not depend on the input (b_res for H_pre)
            assert a is None or torch.equal(a, torch.zeros_like(a))
        else:
            assert_close(a, e, TOL[torch.float32])


@pytest.mark.parametrize(("kind", "n"), [("mhc-lite", 2), ("mhc-lite", 3), ("mhc-lite", 4),
                                         ("kromhc", 2), ("kromhc", 4), ("kromhc", 8)])
def test_native_initial_res_map_is_the_references_bit_for_bit(kind, n):
    """At a connection's initialisation (phi = 0: H_res from b_res alone) the native H_res,
    built in double and rounded once, is the reference's exactly (0.625, 0.125, 9/16 ...)."""
    from torch_mhc.connections.successors import make_variant

    conn = make_variant(kind, 16, n, 0, torch.nn.Identity())
    x = torch.randn(5, n, 16)
    if not cpu_variants.takes_native(x, conn.phi.shape[1]):
        pytest.skip("native CPU library unavailable")
    args = conn.map_args(x)
    got = cpu_variants.variant_maps(*args)[2]
    want = ref.variant_maps(*args)[2]
    assert torch.equal(got, want)


@pytest.mark.parametrize(("kind", "n"), [("mhc-lite", 3), ("kromhc", 4), ("mhc-static-res", 2)])
def test_without_autograd_the_maps_are_the_autograd_paths_bit_for_bit(kind, n):
    """Under no_grad (decoding, evaluation: 300 tokens, past the prepared decode path) the
    maps come from the native loops without the logits a backward would keep: the same
    values as the autograd path's, bit for bit, with x itself as x_for_merge."""
    x, *params = variant_inputs(kind, (3, 100), n, 24, torch.float32)
    if not cpu_variants.takes_native(x, params[0].shape[1]):
        pytest.skip("native CPU library unavailable")
    with_grad = cpu_variants.variant_maps_pre(kind, x, *params, fused_dx=True)
    with torch.no_grad():
        without = cpu_variants.variant_maps_pre(kind, x, *params, fused_dx=True)
    assert without[-1] is x
    for a, e in zip(without[:-1], with_grad[:-1], strict=True):
        assert not a.requires_grad and torch.equal(a, e.detach())


def test_the_native_maps_ops_pass_opcheck_and_refuse_a_foreign_res_map():
    """cpu_mhc_maps_fwd / _bwd with a successor's H_res map (res): schema and fake
    implementation; a res code, or a number of logits, the kernels cannot take is a
    ValueError before the loops."""
    if native.load() is None:
        pytest.skip("native CPU library unavailable")
    x, phi, alpha, b_pre, b_post, b_res = (t.detach() for t in
                                           variant_inputs("mhc-lite", (15,), 3, 8,
                                                          torch.float32))
    phip, ab = cpu_variants.variant_tables(phi, alpha, b_pre, b_post, b_res)
    res = native.RES["mhc-lite"]
    fwd = (x, phip, ab, 1, 1e-6, 0.0, 0.0, True, res)
    torch.library.opcheck(torch.ops.torch_mhc.cpu_mhc_maps_fwd.default, fwd)
    lt, r, *_ = torch.ops.torch_mhc.cpu_mhc_maps_fwd(*fwd)
    g = torch.randn(15, 3, 8)
    bwd = (x, phi, ab, lt, r, torch.randn(15, 3), None, torch.randn(15, 3, 3),
           torch.randn(15, 8), g, 1, 0.0, 0.0, res)
    torch.library.opcheck(torch.ops.torch_mhc.cpu_mhc_maps_bwd.default, bwd)
    with pytest.raises(ValueError, match="res must be one of"):
        torch.ops.torch_mhc.cpu_mhc_maps_fwd(x, phip, ab, 1, 1e-6, 0.0, 0.0, True, 7)
    with pytest.raises(ValueError, match=r"mhc-lite maps with n = 3 expect M = 2 n \+ 6"):
        torch.ops.torch_mhc.cpu_mhc_maps_fwd(x, phip, ab[:, :-1], 1, 1e-6, 0.0, 0.0, True, res)
