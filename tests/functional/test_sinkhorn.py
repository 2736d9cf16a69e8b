"""Sinkhorn-Knopp projection: definition, doubly stochastic error, exact recomputed backward."""

import pytest
import torch

from tests.helpers.op_cases import compiled_and_eager
from tests.helpers.references import sinkhorn_log_naive, sinkhorn_naive
from torch_mhc import sinkhorn, sinkhorn_unrolled
from torch_mhc.functional.sinkhorn import LINEAR_RANGE, sinkhorn_backward, sinkhorn_forward
from torch_mhc.ops import reference


def _logits(shape, scale=10.0, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).mul(scale).to(dtype)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_forward_matches_naive_definition(n):
    x = _logits((3, 5, n, n))
    torch.testing.assert_close(sinkhorn(x, 20), sinkhorn_naive(x, 20), rtol=0, atol=1e-14)


def test_doubly_stochastic_error_after_20_iterations():
    # Random logits in [-10, 10], n = 4, 20 iterations (the paper's setting). Rows are
    # normalised last, so they sum to 1 to rounding; columns carry the remaining error.
    x = _logits((4096, 4, 4), seed=1)
    p = sinkhorn(x, 20)
    row_err = (p.sum(-1) - 1).abs()
    col_err = (p.sum(-2) - 1).abs()
    assert row_err.max() < 1e-14
    # Measured (seeds 0-3, 4096 matrices each): mean column error 0.0095-0.0100, worst
    # matrix 0.084-0.092. 20 iterations do not converge for logits this spread (the paper's
    # observation). The column bounds fail if the column step were dropped; the row bound
    # fails if the order (columns, then rows) were reversed.
    assert col_err.mean() < 0.02
    assert col_err.max() < 0.2
    assert (p >= 0).all()
    # More iterations converge further: the error must shrink.
    assert (sinkhorn(x, 200).sum(-2) - 1).abs().mean() < col_err.mean() / 10


def test_error_falls_with_iterations_on_mild_logits():
    x = _logits((512, 4, 4), scale=1.0, seed=2)
    errs = [(sinkhorn(x, k).sum(-2) - 1).abs().max().item() for k in (1, 3, 10, 20)]
    assert errs == sorted(errs, reverse=True)
    assert errs[-1] < 1e-12


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_backward_equals_autograd_through_the_unrolled_loop(n, eps):
    x = _logits((6, n, n), scale=3.0, seed=n).requires_grad_()
    g = torch.randn(6, n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    (got,) = torch.autograd.grad(sinkhorn(x, 20, eps=eps), x, g)
    (want,) = torch.autograd.grad(sinkhorn_unrolled(x, 20, eps=eps), x, g)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    if eps == 0.0:
        (naive,) = torch.autograd.grad(sinkhorn_naive(x, 20), x, g)
        torch.testing.assert_close(got, naive, rtol=0, atol=1e-12)


def test_gradcheck_small_iters():
    x = _logits((2, 3, 3), scale=2.0).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: sinkhorn(t, 5), (x,))
    assert torch.autograd.gradcheck(lambda t: sinkhorn(t, 5, eps=1e-2), (x,))


def test_saves_only_the_input():
    # O(n^2) per matrix saved for backward, not O(iters * n^2).
    x = _logits((64, 4, 4)).requires_grad_()
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sinkhorn(x, 20)
    assert sum(saved) == x.numel()
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sinkhorn_unrolled(x, 20)
    assert sum(saved) > 20 * x.numel()  # what the custom backward avoids


def test_log_domain_matches_and_survives_large_logits():
    x = _logits((32, 4, 4), scale=10.0)
    torch.testing.assert_close(sinkhorn(x, 20, log_domain=True), sinkhorn(x, 20), rtol=0,
                               atol=1e-12)
    # Logits spanning +-200 in fp32: exp underflows for the small entries, so the direct path
    # loses columns whose entries all vanish relative to the max; the log domain stays finite
    # and doubly stochastic in its rows.
    big = _logits((32, 4, 4), scale=200.0, dtype=torch.float32, seed=3)
    p = sinkhorn(big, 20, log_domain=True)
    assert torch.isfinite(p).all()
    assert (p.sum(-1) - 1).abs().max() < 1e-5
    x = _logits((4, 4, 4), scale=3.0).requires_grad_()
    g = torch.randn(4, 4, 4, dtype=torch.float64)
    (a,) = torch.autograd.grad(sinkhorn(x, 20, log_domain=True), x, g)
    (b,) = torch.autograd.grad(sinkhorn(x, 20), x, g)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_implicit_gradient_approaches_unrolled_at_convergence():
    x = _logits((8, 4, 4), scale=1.0, seed=4).requires_grad_()
    g = torch.randn(8, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    (exact,) = torch.autograd.grad(sinkhorn(x, 200), x, g)
    (implicit,) = torch.autograd.grad(sinkhorn(x, 200, implicit_grad=True), x, g)
    torch.testing.assert_close(implicit, exact, rtol=0, atol=1e-10)
    # Far from convergence (1 iteration) it is only an approximation.
    (exact1,) = torch.autograd.grad(sinkhorn(x, 1), x, g)
    (implicit1,) = torch.autograd.grad(sinkhorn(x, 1, implicit_grad=True), x, g)
    assert (exact1 - implicit1).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_computed_in_fp32(dtype):
    x = _logits((16, 4, 4), scale=5.0, dtype=torch.float32)
    p = sinkhorn(x.to(dtype), 20)
    assert p.dtype == dtype
    ref = sinkhorn(x.to(dtype).float(), 20)  # same input values, fp32 arithmetic
    torch.testing.assert_close(p.float(), ref.to(dtype).float(), rtol=0, atol=0)
    xg = x.to(dtype).requires_grad_()
    g = torch.randn(16, 4, 4)
    (gx,) = torch.autograd.grad(sinkhorn(xg, 20), xg, g.to(dtype))
    assert gx.dtype == dtype
    x32 = x.to(dtype).float().requires_grad_()
    (g32,) = torch.autograd.grad(sinkhorn(x32, 20), x32, g.to(dtype).float())
    torch.testing.assert_close(gx.float(), g32.to(dtype).float(), rtol=0, atol=0)


def test_bad_input():
    with pytest.raises(ValueError, match=r"square matrices .*got \(3, 4\)"):
        sinkhorn(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="iters >= 1, got 0"):
        sinkhorn(torch.zeros(4, 4), iters=0)
    with pytest.raises(TypeError, match="floating-point tensor, got dtype torch.int64"):
        sinkhorn(torch.zeros(4, 4, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# Finite wherever the exact answer is: far-apart logits take the log domain per matrix
# ---------------------------------------------------------------------------------------------


def _far_cases():
    """Logits whose float32 linear-domain iteration underflows to 0 / 0, with the exact
    answers where they are known in closed form (None: compare with the float64 reference)."""
    half = torch.full((2, 2), 0.5)
    small = _logits((4, 4), scale=1.0, dtype=torch.float32, seed=11)
    return {
        "rows +-100": (torch.tensor([[100.0, 100.0], [-100.0, -100.0]]), half),
        "columns +-100": (torch.tensor([[100.0, -100.0], [100.0, -100.0]]), half),
        "row shifts of hundreds": (small + torch.tensor([[300.0], [0.0], [-250.0], [120.0]]), None),
        "column shifts of hundreds": (small + torch.tensor([[-400.0, 0.0, 200.0, 30.0]]), None),
    }


@pytest.mark.parametrize("case", list(_far_cases()))
@pytest.mark.parametrize("impl", ["sinkhorn", "reference"])
def test_far_apart_logits_give_the_exact_matrix(case, impl):
    x, exact = _far_cases()[case]
    fn = sinkhorn if impl == "sinkhorn" else reference.sinkhorn
    want = sinkhorn_log_naive(x, 20)
    if exact is not None:
        torch.testing.assert_close(want, exact.double(), rtol=0, atol=1e-12)
    xg = x.clone().requires_grad_()
    got = fn(xg, 20)
    assert torch.isfinite(got).all()
    # float32 log-domain iterates hold log-entries as large as the logits' span, so each
    # carries about one rounding of the span (2^-24 span; measured errors are 0.1 of this).
    span = (x.max() - x.min()).item()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2**-24 * span)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    (grad,) = torch.autograd.grad(got, xg, g)
    xd = x.double().requires_grad_()
    (want_grad,) = torch.autograd.grad(sinkhorn_log_naive(xd, 20), xd, g.double())
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad.double(), want_grad, rtol=0,
                               atol=2**-24 * span * want_grad.abs().max().item())


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_random_logits_of_scale_100_match_the_float64_log_domain(n):
    # Uniform in [-100, 100]: nearly every matrix spans more than LINEAR_RANGE.
    x = _logits((64, n, n), scale=100.0, seed=n)
    g = torch.randn(64, n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    xd = x.clone().requires_grad_()
    want = sinkhorn_log_naive(xd, 20)
    (want_grad,) = torch.autograd.grad(want, xd, g)
    # float64: the same function evaluated in the same domain, to rounding.
    got = sinkhorn(xd, 20)
    (grad,) = torch.autograd.grad(got, xd, g)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-12 * want_grad.abs().max().item())
    # float32 (measured: forward <= 1e-6, gradient <= 4e-6 of its largest entry).
    x32 = x.float().requires_grad_()
    got32 = sinkhorn(x32, 20)
    (grad32,) = torch.autograd.grad(got32, x32, g.float())
    torch.testing.assert_close(got32.double(), want.detach(), rtol=0, atol=5e-6)
    assert (grad32.double() - want_grad).abs().max() <= 2e-5 * want_grad.abs().max()


def test_each_matrix_takes_its_own_domain():
    """A batch mixing near and far matrices: each result equals that matrix run alone, and
    the near ones are bit-identical to the linear-domain definition."""
    near = _logits((5, 4, 4), scale=3.0, dtype=torch.float32, seed=5)
    far = _logits((3, 4, 4), scale=150.0, dtype=torch.float32, seed=6)
    x = torch.cat([near[:2], far[:1], near[2:], far[1:]])  # [8, 4, 4]
    got = sinkhorn(x, 20)
    torch.testing.assert_close(got[[0, 1, 3, 4, 5]], sinkhorn_unrolled(near, 20), rtol=0, atol=0)
    for k, i in enumerate([2, 6, 7]):
        torch.testing.assert_close(got[i], sinkhorn(far[k], 20), rtol=0, atol=0)
    assert torch.isfinite(got).all()


def test_linear_range_boundary():
    """At exactly LINEAR_RANGE the linear domain runs and stays finite and accurate (the
    bound of the module docstring); just above, the log domain runs and agrees."""
    g = torch.Generator().manual_seed(8)
    base = (torch.rand(256, 4, 4, generator=g, dtype=torch.float64) > 0.5).double()
    for spread in (LINEAR_RANGE, LINEAR_RANGE + 0.5):
        x = (base * spread).float()
        want = sinkhorn_log_naive(x.double(), 20)
        got = sinkhorn(x, 20)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)


def test_forward_and_backward_along_other_axes():
    """sinkhorn_forward / sinkhorn_backward on token-last [n, n, T] (dims (0, 1)) equal the
    batch-first evaluation, including far matrices."""
    x = torch.cat([_logits((6, 3, 3), scale=2.0), _logits((2, 3, 3), scale=200.0, seed=1)])
    g = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    tl = (0, 1)
    out = sinkhorn_forward(x.permute(1, 2, 0), 20, dims=tl).permute(2, 0, 1)
    torch.testing.assert_close(out, sinkhorn_forward(x, 20), rtol=0, atol=1e-15)
    grad = sinkhorn_backward(x.permute(1, 2, 0), g.permute(1, 2, 0), 20, dims=tl)
    torch.testing.assert_close(grad.permute(2, 0, 1), sinkhorn_backward(x, g, 20), rtol=0,
                               atol=1e-15)


@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_backward_with_output_returns_the_forward(eps):
    """sinkhorn_backward(..., with_output=True) gives the same gradient and, as its second
    value, sinkhorn_forward's output, near and far matrices alike, along either layout."""
    x = torch.cat([_logits((5, 4, 4), scale=2.0), _logits((3, 4, 4), scale=200.0, seed=3)])
    g = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    for h, gh, dims in ((x, g, (-2, -1)), (x.permute(1, 2, 0), g.permute(1, 2, 0), (0, 1))):
        grad, out = sinkhorn_backward(h, gh, 20, eps, dims, with_output=True)
        torch.testing.assert_close(grad, sinkhorn_backward(h, gh, 20, eps, dims), rtol=0, atol=0)
        torch.testing.assert_close(out, sinkhorn_forward(h, 20, eps, dims), rtol=0, atol=0)


def test_column_error_depends_on_the_logit_spread():
    # The figures the module docstring quotes: 10,000 4 x 4 matrices of logits uniform on
    # [0, S], float32, 20 iterations. Measured max |column sum - 1|: 1.2e-7 (S = 1),
    # 3.1e-4 (4), 0.026 (8), 0.26 (32), 1.0 (64), 1.98 (100), 2.0 (200); median <= 0.045.
    worst, median = {}, {}
    for spread in (1, 4, 8, 32, 100, 200):
        g = torch.Generator().manual_seed(0)
        x = (torch.rand(10_000, 4, 4, generator=g, dtype=torch.float64) * spread).float()
        p = sinkhorn(x, 20)
        assert (p.sum(-1) - 1).abs().max() < 1e-6  # rows: exact up to rounding, any spread
        col_err = (p.sum(-2) - 1).abs().amax(-1)
        worst[spread], median[spread] = col_err.max().item(), col_err.median().item()
    assert worst[1] < 1e-6
    assert 1e-4 < worst[4] < 1e-3
    assert 0.01 < worst[8] < 0.05
    assert 0.1 < worst[32] < 0.5
    assert 1.5 < worst[100] <= 3.0 and 1.5 < worst[200] <= 3.0  # n - 1 = 3 bounds any input
    assert max(median.values()) < 0.05


@pytest.mark.parametrize("iters", [20, 200])
def test_column_error_decays_like_one_over_iters_where_exp_underflows(iters):
    # exp of [[0, 0], [0, -100]] is [[1, 1], [1, ~0]]: the limit is the swap matrix and the
    # column error after k iterations is 1 / (2k + 1), not geometric.
    p = sinkhorn(torch.tensor([[0.0, 0.0], [0.0, -100.0]], dtype=torch.float64), iters)
    torch.testing.assert_close(p.sum(-1), torch.ones(2, dtype=torch.float64))
    err = (p.sum(-2) - 1).abs().max().item()
    assert err == pytest.approx(1 / (2 * iters + 1), rel=1e-9)


@pytest.mark.parametrize("eps", [-1e-3, float("inf"), float("nan"), -float("inf")])
def test_eps_must_be_finite_and_non_negative(eps):
    for call in (lambda: sinkhorn(torch.zeros(4, 4), eps=eps),
                 lambda: sinkhorn_unrolled(torch.zeros(4, 4), eps=eps)):
        with pytest.raises(ValueError, match=rf"finite eps >= 0, got {eps!r}"):
            call()


@pytest.mark.parametrize("dtype, eps", [(torch.float32, 0.0), (torch.float32, 1e-2),
                                        (torch.bfloat16, 0.0), (torch.float64, 0.0)])
def test_compiled_sinkhorn_differentiates_the_loop_itself(monkeypatch, dtype, eps):
    """Under torch.compile the loop is differentiated by autograd, never through the
    recomputing autograd function (torch 2.11 traced its backward to zero gradients): the
    compiled gradients equal eager's, near and far matrices alike."""
    from torch_mhc.functional import sinkhorn as module

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, 4, generator=gen)
    x[::2] *= 40.0  # spread past LINEAR_RANGE: the log domain (where eps is 0)
    x, upstream = x.to(dtype), torch.randn(6, 4, 4, generator=gen).to(dtype)
    (out_e, grad_e), (out_c, grad_c) = compiled_and_eager(
        lambda h: sinkhorn(h, 5, eps=eps), x, upstream, monkeypatch, [module._Sinkhorn])
    assert grad_e.abs().max() > 0.1 and out_c.dtype == grad_c.dtype == dtype
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad_c, grad_e, rtol=0, atol=1e-6)
