"""The `triton` op implementation against `functional.maps`: kernels, custom ops, compile.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (fp32 and fp16; bf16
only on a GPU). TRITON_INTERPRET must be set before triton is first imported (triton's own
@jit library functions are decorated then), and in a full test run another module has
usually imported triton already. So on a machine without a GPU this module's tests run in a
fresh process started by `test_kernels_in_a_fresh_interpreter_process`, with
TRITON_INTERPRET=1 from the start; run directly that way, they run in-process:

    TRITON_INTERPRET=1 pytest tests/ops/test_triton.py

Sizes are small: the interpreter runs every kernel instruction as a numpy call.
"""


import pytest
import torch

pytest.importorskip("triton")

import torch_mhc.ops as ops  # noqa: E402
from tests.helpers.op_cases import (  # noqa: E402
    assert_close,
    clone_inputs,
    maps_inputs,
    merge_inputs,
    reference_and,
    run,
)
from tests.helpers.references import sinkhorn_log_naive  # noqa: E402
from tests.helpers.triton_env import (  # noqa: E402
    DEVICE,
    DTYPES,
    INTERPRETER_CHILD,
    ON_GPU,
    RUN_HERE,
    TOL,
    assert_connection_matches_reference,
    kernel_test,
    run_in_fresh_interpreter,
    tri,
)
from torch_mhc import sinkhorn_unrolled  # noqa: E402
from torch_mhc.functional import maps as reference  # noqa: E402

NAMES = ("x", "phi", "alpha", "b_pre", "b_post", "b_res")


def _to(inputs, device):
    return [t.detach().to(device).requires_grad_() for t in inputs]


# ---------------------------------------------------------------------------------------------
# (a) maps, (d) Sinkhorn
# ---------------------------------------------------------------------------------------------


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens, n, c, iters",
    [((7,), 4, 100, 20), ((2, 5), 3, 100, 6), ((63,), 8, 16, 4), ((3,), 2, 9, 3)],
)
def test_mhc_maps_match_reference(tokens, n, c, iters, dtype):
    inputs = maps_inputs(tokens, n, c, dtype)
    ref_inputs = [inputs[0].detach().float().requires_grad_(), *clone_inputs(inputs[1:])]
    out_ref, grad_ref = run(lambda *a: reference.mhc_maps(*a, sinkhorn_iters=iters), ref_inputs)
    out_tri, grad_tri = run(lambda *a: tri.mhc_maps(*a, sinkhorn_iters=iters),
                            _to(inputs, DEVICE))
    # Matmuls run in TF32 for half-precision streams: phi and dz rounded to 10 bits, on a GPU
    # and in the interpreter alike (ops/triton/ops.py, TF32).
    maps_tol = 2e-5 if dtype == torch.float32 else 2e-3
    for a, e in zip(out_tri, out_ref, strict=True):
        assert a.dtype == torch.float32
        assert_close(a.cpu(), e, maps_tol)
    for a, e, name in zip(grad_tri, grad_ref, NAMES, strict=True):
        assert a.dtype == (dtype if name == "x" else torch.float32), name
        assert_close(a.cpu(), e, TOL[dtype] if name == "x" else max(maps_tol, 1e-4))


@kernel_test
def test_mhc_maps_with_deepseek_epsilons_and_missing_gradients():
    inputs = maps_inputs((9,), 4, 24, torch.float32, seed=3)
    kw = dict(sinkhorn_iters=3, norm_eps=1e-4, sinkhorn_eps=1e-2, pre_eps=1e-2)
    out_ref, grad_ref = run(lambda *a: reference.mhc_maps(*a, **kw), inputs)
    out_tri, grad_tri = run(lambda *a: tri.mhc_maps(*a, **kw), _to(inputs, DEVICE))
    for a, e in zip([*out_tri, *grad_tri], [*out_ref, *grad_ref], strict=True):
        assert_close(a.cpu(), e, 2e-5)
    # Only H_post used downstream: the other maps' gradients are absent (None) upstream.
    g = torch.randn(9, 4)
    grads = []
    for impl, dev in ((reference, "cpu"), (tri, DEVICE)):
        ins = _to(inputs, dev)
        _, h_post, _ = impl.mhc_maps(*ins, **kw)
        grads.append(torch.autograd.grad(h_post, ins, g.to(dev), materialize_grads=True))
    for a, e in zip(*grads, strict=True):
        assert_close(a.cpu(), e, 2e-5)


def _made_by(t: torch.Tensor, name: str) -> bool:
    """Whether an autograd node of class `name` made t (through reshapes and views)."""
    node = t.grad_fn
    while node is not None and name not in type(node).__name__:
        parents = [n for n, _ in node.next_functions if n is not None]
        node = parents[0] if len(parents) == 1 else None
    return node is not None


def _connection_ops(impl, fused: bool, iters: int = 5):
    """A connection's ops around a branch f = a / 2 + b: its maps, branch input and merged
    streams, with fused_dx (mhc_maps_pre and post_merge of `impl`) or the ops apart."""

    def fn(x, phi, alpha, b_pre, b_post, b_res, b):
        params = (phi, alpha, b_pre, b_post, b_res)
        if fused:
            h_pre, h_post, h_res, a, x_for_merge = impl.mhc_maps_pre(
                x, *params, sinkhorn_iters=iters, fused_dx=True)
            assert _made_by(x_for_merge, "_FusedMapsPre")  # the fused node's view of x
            out = impl.post_merge(x_for_merge, a / 2 + b, h_post, h_res, fused_dx=True)
        else:
            h_pre, h_post, h_res = impl.mhc_maps(x, *params, sinkhorn_iters=iters)
            a = impl.pre_aggregate(x, h_pre)
            out = impl.post_merge(x, a / 2 + b, h_post, h_res)
        return h_pre, h_post, h_res, a, out

    return fn


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, n, c", [((2, 5), 4, 40), ((7,), 3, 33), ((3,), 8, 16)])
def test_fused_dx_gives_the_gradients_of_the_ops_apart(tokens, n, c, dtype):
    """mhc_maps_pre(..., fused_dx=True) with post_merge(..., fused_dx=True): x's gradient
    through maps, aggregation and merge written once (mhc_maps_pre_bwd). Against the same
    ops apart: the same outputs and parameter gradients, bit for bit (the same kernels and
    float32 sums), x's gradient within the dtype's rounding (rounded twice, not three times);
    against the float32 reference: every gradient in float32, x's in every dtype (the
    parameters' gradients in half precision take the rounded branch input and output, which
    the reference does not round: tests of the ops apart hold those)."""
    b = torch.randn(*tokens, c, generator=torch.Generator().manual_seed(n)).to(dtype)
    inputs = [*maps_inputs(tokens, n, c, dtype), b.requires_grad_()]
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    out_ref, grad_ref = run(_connection_ops(reference, False), ref_inputs)
    out_fused, grad_fused = run(_connection_ops(tri, True), _to(inputs, DEVICE))
    out_apart, grad_apart = run(_connection_ops(tri, False), _to(inputs, DEVICE))
    for a, b in zip(out_fused, out_apart, strict=True):
        assert torch.equal(a, b)  # the same forward kernels
    for a, b, e, name in zip(grad_fused, grad_apart, grad_ref, (*NAMES, "b"), strict=True):
        assert a.dtype == b.dtype, name
        if name == "x":
            assert_close(a.cpu().float(), b.cpu().float(), TOL[dtype])
            assert_close(a.cpu().float(), e, TOL[dtype])
        else:
            assert torch.equal(a, b), name
            if dtype == torch.float32:
                assert_close(a.cpu(), e, 2e-5 if name == "b" else 1e-4)


@kernel_test
def test_fused_dx_with_missing_gradients_autocast_and_without_autograd():
    inputs = [*maps_inputs((6,), 4, 24, torch.float32, seed=2), torch.randn(6, 24)]
    # only H_post reaches the loss: the aggregation's and the merge's gradients are None
    grads = []
    for impl, fused, dev in ((reference, False, "cpu"), (tri, True, DEVICE)):
        ins = _to(inputs, dev)
        _, h_post, *_ = _connection_ops(impl, fused)(*ins)
        grads.append(torch.autograd.grad(h_post.sum(), ins[:6], materialize_grads=True))
    for a, e in zip(*grads, strict=True):
        assert_close(a.cpu(), e, 2e-5)
    x, *params = _to(inputs[:6], DEVICE)
    with torch.no_grad():
        assert tri.mhc_maps_pre(x, *params, fused_dx=True)[4] is None  # nothing to fuse
    with torch.autocast(DEVICE, dtype=torch.bfloat16):  # the ops apart cast as before
        assert tri.mhc_maps_pre(x, *params, fused_dx=True)[4] is None


@kernel_test
def test_mhc_maps_half_parameters():
    """A model cast to fp16 has fp16 phi and gates: loaded, computed in fp32."""
    inputs = [t.detach().half().requires_grad_() for t in maps_inputs((5,), 4, 24, torch.float32)]
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    out_ref, grad_ref = run(lambda *a: reference.mhc_maps(*a, sinkhorn_iters=5), ref_inputs)
    out_tri, grad_tri = run(lambda *a: tri.mhc_maps(*a, sinkhorn_iters=5), _to(inputs, DEVICE))
    for a, e in zip(out_tri, out_ref, strict=True):
        assert_close(a.cpu(), e, 2e-3 if ON_GPU else 2e-5)
    for a, e in zip(grad_tri, grad_ref, strict=True):
        assert a.dtype == torch.float16
        assert_close(a.cpu(), e, 2e-3)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, iters, eps", [(3, 20, 0.0), (4, 1, 0.0), (8, 7, 1e-2), (4, 5, 1e-3)])
def test_sinkhorn_matches_unrolled_autograd(n, iters, eps, dtype):
    g = torch.Generator().manual_seed(n)
    logits = (torch.randn(3, 11, n, n, generator=g) * 2).to(dtype)
    upstream = torch.randn(3, 11, n, n, generator=g).to(dtype)
    ref_in = logits.float().requires_grad_()
    ref = sinkhorn_unrolled(ref_in, iters, eps=eps)
    (g_ref,) = torch.autograd.grad(ref, ref_in, upstream.float())
    tri_in = logits.to(DEVICE).requires_grad_()
    out = tri.sinkhorn(tri_in, iters, eps=eps)
    (g_tri,) = torch.autograd.grad(out, tri_in, upstream.to(DEVICE))
    assert out.dtype == g_tri.dtype == dtype
    assert_close(out.cpu(), ref, 1e-6 if dtype == torch.float32 else TOL[dtype])
    assert_close(g_tri.cpu(), g_ref, 1e-5 if dtype == torch.float32 else TOL[dtype])


@kernel_test
@pytest.mark.skipif(ON_GPU, reason="counts interpreted calls of the kernels' helpers")
@pytest.mark.parametrize("iters", [3, 8])
def test_sinkhorn_backward_is_linear_in_the_iterations(iters, monkeypatch):
    """Passes over the matrices, counted in the interpreter: the forward's 2*iters - 1
    normalisations, the backward's recomputed 2*iters - 1 plus 2*iters - 1 reversed."""
    counts = {}
    for name in ("_normalise", "_reverse_step", "_col_softmax"):
        inner = getattr(tri._k, name).fn

        def counted(*args, _inner=inner, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _inner(*args, **kwargs)

        monkeypatch.setattr(tri._k, name, counted)
    x = torch.randn(4, 3, 3).requires_grad_()
    out = tri.sinkhorn(x, iters)
    assert counts == {"_col_softmax": 1, "_normalise": 2 * iters - 1}
    counts.clear()
    torch.autograd.grad(out, x, torch.randn_like(out))
    assert counts == {"_col_softmax": 2, "_normalise": 2 * iters - 1,
                      "_reverse_step": 2 * iters - 1}


# Far-apart logits (functional.sinkhorn's design): per matrix, a logit range above LINEAR_RANGE
# runs the same unrolled function in the log domain; held to a float64 log-domain evaluation.
FAR_CASES = {
    "rows +-100": torch.tensor([[100.0, 100.0], [-100.0, -100.0]]),
    "columns +-100": torch.tensor([[100.0, -100.0], [100.0, -100.0]]),
    "row shifts of hundreds": torch.randn(4, 4, generator=torch.Generator().manual_seed(11))
    + torch.tensor([[300.0], [0.0], [-250.0], [120.0]]),
}


def _against_log_domain(x, got, grad, upstream, iters):
    """Forward and gradient within one rounding of the logits' span (as tests/test_sinkhorn)."""
    xd = x.double().requires_grad_()
    want = sinkhorn_log_naive(xd, iters)
    (want_grad,) = torch.autograd.grad(want, xd, upstream.double())
    span = (x.max() - x.min()).item()
    assert torch.isfinite(got).all() and torch.isfinite(grad).all()
    assert (got.double() - want).abs().max() <= 2**-24 * span
    assert (grad.double() - want_grad).abs().max() <= 2**-24 * span * want_grad.abs().max()


@kernel_test
@pytest.mark.parametrize("case", list(FAR_CASES))
def test_sinkhorn_far_apart_logits_match_the_float64_log_domain(case):
    x = FAR_CASES[case].unsqueeze(0)
    xt = x.clone().to(DEVICE).requires_grad_()
    out = tri.sinkhorn(xt, 20)
    if case != "row shifts of hundreds":
        assert_close(out.cpu(), torch.full_like(x, 0.5), 1e-6)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    (grad,) = torch.autograd.grad(out, xt, g.to(DEVICE))
    _against_log_domain(x, out.cpu(), grad.cpu(), g, 20)


@kernel_test
def test_sinkhorn_each_token_takes_its_own_domain():
    """A block mixing near and far matrices: the near ones as the linear definition, the far
    ones as the float64 log domain, forward and backward (the log path is block-wide)."""
    gen = torch.Generator().manual_seed(5)
    near = torch.randn(5, 4, 4, generator=gen) * 3
    far = (torch.rand(3, 4, 4, generator=gen) * 2 - 1) * 100
    x = torch.cat([near[:2], far[:1], near[2:], far[1:]])  # [8, 4, 4]
    upstream = torch.randn(8, 4, 4, generator=gen)
    xt = x.to(DEVICE).requires_grad_()
    out = tri.sinkhorn(xt, 7)
    (grad,) = torch.autograd.grad(out, xt, upstream.to(DEVICE))
    out, grad = out.cpu(), grad.cpu()
    near_in = near.clone().requires_grad_()
    want = sinkhorn_unrolled(near_in, 7)
    (want_grad,) = torch.autograd.grad(want, near_in, upstream[[0, 1, 3, 4, 5]])
    assert_close(out[[0, 1, 3, 4, 5]], want, 1e-6)
    assert_close(grad[[0, 1, 3, 4, 5]], want_grad, 1e-5)
    _against_log_domain(x[[2, 6, 7]], out[[2, 6, 7]], grad[[2, 6, 7]], upstream[[2, 6, 7]], 7)


@kernel_test
def test_mhc_maps_with_far_apart_residual_logits_match_reference():
    """The map kernels' fused Sinkhorn takes the log domain too (alpha_res large)."""
    inputs = maps_inputs((6,), 4, 16, torch.float32, seed=4)
    with torch.no_grad():
        inputs[2][2] = 60.0  # alpha_res: residual logits spanning hundreds
    out_ref, grad_ref = run(lambda *a: reference.mhc_maps(*a, sinkhorn_iters=5), inputs)
    out_tri, grad_tri = run(lambda *a: tri.mhc_maps(*a, sinkhorn_iters=5), _to(inputs, DEVICE))
    for a, e in zip([*out_tri, *grad_tri], [*out_ref, *grad_ref], strict=True):
        assert torch.isfinite(a).all()
        assert_close(a.cpu(), e, 1e-4)


@kernel_test
def test_empty_batches_run_forward_and_backward():
    from tests.ops.test_op_arguments import check_empty_batch

    check_empty_batch(ops.get_impl("triton"), DEVICE)


@kernel_test
def test_bad_scalars_are_refused_by_the_ops():
    from tests.ops.test_op_arguments import check_bad_scalars

    check_bad_scalars(ops.get_impl("triton"), DEVICE)


@kernel_test
def test_a_failing_kernel_names_op_shape_dtype_and_the_alternatives(monkeypatch):
    class Broken:
        __name__ = "merge_fwd_kernel"

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("out of resources: shared memory")
            return launch

    monkeypatch.setattr(tri._k, "merge_fwd_kernel", Broken())
    x, f, _, h_post, h_res = [t.detach().to(DEVICE) for t in merge_inputs((3,), 3, 5,
                                                                           torch.float32)]
    with pytest.raises(RuntimeError) as info:
        tri.post_merge(x, f, h_post, h_res)
    msg = str(info.value)
    for part in ("merge_fwd_kernel", "post_merge", "(3, 3, 5) torch.float32", "out of resources",
                 "impl='inductor'", "TORCH_MHC_IMPL"):
        assert part in msg, (part, msg)


def to_tf32(t, truncate=False):
    """t rounded (or truncated) to TF32's 11 significant bits, by frexp (not by its bits)."""
    m, e = torch.frexp(t)
    s = m.abs() * 2048
    s = torch.floor(s) if truncate else torch.floor(s + 0.5)  # ties away from zero
    return torch.ldexp(torch.sign(m) * s / 2048, e)


class _GpuMatmul(torch.autograd.Function):
    """x @ phi as the map kernels compute it for half streams on a GPU: the forward as fp32
    (tf32x3), the backward's dots single TF32 with phi and dz rounded (or truncated)."""

    @staticmethod
    def forward(ctx, v, phi, truncate):
        ctx.save_for_backward(v, phi)
        ctx.truncate = truncate
        return v @ phi

    @staticmethod
    def backward(ctx, dz):
        v, phi = ctx.saved_tensors
        dz = to_tf32(dz, ctx.truncate)
        return dz @ to_tf32(phi, ctx.truncate).T, v.T @ dz, None


def _gpu_emulated_maps(x, phi, alpha, b_pre, b_post, b_res, iters, truncate=False):
    n = x.shape[-2]
    v = x.flatten(-2).float()
    r = torch.sqrt(v.square().mean(-1, keepdim=True) + 1e-6)
    logits = _GpuMatmul.apply(v, phi, truncate) / r
    h_pre = torch.sigmoid(alpha[0] * logits[..., :n] + b_pre)
    h_post = 2 * torch.sigmoid(alpha[1] * logits[..., n : 2 * n] + b_post)
    res = (alpha[2] * logits[..., 2 * n :]).unflatten(-1, (n, n)) + b_res
    return h_pre, h_post, reference.sinkhorn(res, iters)


def _emulated_errors(truncate):
    """Worst error per output and gradient over 20 seeds x 2 shapes (bf16 streams, fp32 phi)."""
    worst = {}
    names = ("h_pre", "h_post", "h_res", *NAMES)
    for seed in range(20):
        for n, c in ((4, 100), (8, 64)):
            inputs = maps_inputs((7,), n, c, torch.bfloat16, seed=seed)
            ins = [inputs[0].detach().float().requires_grad_(), *clone_inputs(inputs[1:])]
            out_ref, grad_ref = run(lambda *a: reference.mhc_maps(*a, sinkhorn_iters=20), ins)
            out, grad = run(lambda *a: _gpu_emulated_maps(*a, 20, truncate), clone_inputs(ins))
            for name, a, e in zip(names, [*out, *grad], [*out_ref, *grad_ref], strict=True):
                err = float((a - e).abs().max() / e.abs().max())
                worst[name] = max(worst.get(name, 0.0), err)
    return worst


@pytest.mark.skipif(INTERPRETER_CHILD, reason="plain torch: runs in the parent process")
def test_tf32_rounding_stays_within_the_gpu_tolerance():
    """The GPU's TF32 arithmetic for half streams with fp32 phi (autocast), emulated on the
    CPU (the interpreter ignores input_precision): every map and gradient within the GPU
    tests' tolerances (maps and parameter gradients 2e-3, bf16 x 1.6e-2) over 20 seeds; as
    the kernels do it (rounded) it stays well inside, truncating would not."""
    worst = _emulated_errors(truncate=False)
    for name, err in worst.items():
        assert err <= (TOL[torch.bfloat16] if name == "x" else 2e-3), (name, err)
        assert err <= 1e-3, (name, err)
    truncated = _emulated_errors(truncate=True)
    assert truncated["x"] > worst["x"] and truncated["phi"] > worst["phi"]


@kernel_test
def test_round_tf32_rounds_to_nearest_ties_away():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(4096, generator=g) * torch.logspace(-30, 30, 4096)
    t = torch.cat([t, torch.tensor([1 + 2**-11, -(1 + 2**-11), 1 + 2**-12, float("inf"),
                                    float("-inf")])])
    got = tri.round_tf32(t)
    assert torch.equal(got, to_tf32(t))
    assert got[-5] == 1 + 2**-10 and got[-4] == -(1 + 2**-10) and got[-3] == 1.0
    assert torch.isnan(tri.round_tf32(torch.tensor([float("nan")]))).all()


# ---------------------------------------------------------------------------------------------
# The maps' matmul paths: K split over programs (few tokens), one split (many tokens)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def small_grid(monkeypatch):
    """Plans that aim at 4 programs and split K down to one BLOCK_K tile, so that a few dozen
    tokens cross every boundary the default (256 programs, 4 tiles a split) draws only at
    tens of thousands."""
    monkeypatch.setattr(tri, "_PROGRAMS", 4)
    monkeypatch.setattr(tri, "_MIN_K_TILES", 1)


def _grids(t, n, c, dtype=torch.float32, param_dtype=None):
    """{kernel: grid} of the maps' forward and backward at this size (the plans on meta
    tensors, as the ops call them)."""
    from torch_mhc.ops.triton import aot

    launches = aot.op_launches(n, dtype, t, c, 3, param_dtype=param_dtype,
                               ops=("mhc_maps_fwd", "mhc_maps_bwd"))
    return {launch.name: launch.grid for _, launch in launches}


# (tokens, streams, channels, (token blocks, K splits) of mhc_xphi_kernel and mhc_dx_kernel):
# K = n * C = 296 .. 300 is 5 tiles of 64, so the last split is ragged; fp32 token blocks are
# 64 tokens (32 at n = 8), fewer (at least 16) for fewer tokens.
PATHS = [
    (1, 2, 150, (1, 3)), (16, 4, 75, (1, 3)), (17, 8, 37, (1, 3)),
    (33, 8, 37, (2, 2)), (65, 2, 150, (2, 2)), (130, 4, 75, (3, 2)),
    (200, 2, 150, (4, 1)), (97, 8, 37, (4, 1)),
]


@kernel_test
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("t, n, c, grid", PATHS)
def test_maps_split_and_block_paths_match_reference(t, n, c, grid, seed, small_grid):
    grids = _grids(t, n, c)
    assert grids["mhc_xphi_kernel"] == grids["mhc_dx_kernel"] == grid
    inputs = maps_inputs((t,), n, c, torch.float32, seed=seed)
    out_ref, grad_ref = run(lambda *a: reference.mhc_maps(*a, sinkhorn_iters=4), inputs)
    out_tri, grad_tri = run(lambda *a: tri.mhc_maps(*a, sinkhorn_iters=4), _to(inputs, DEVICE))
    for a, e in zip([*out_tri, *grad_tri], [*out_ref, *grad_ref], strict=True):
        assert_close(a.cpu(), e, 2e-5)


@kernel_test
def test_maps_split_paths_in_half_precision_match_reference(small_grid):
    """fp16 streams beside fp32 phi: the forward's token blocks are 64 and its K tiles 32
    (tf32x3; K = 300 is 10 tiles), here split in 4 (17 tokens) and 2 (129 tokens)."""
    for t, grid in ((17, (1, 4)), (129, (3, 2))):
        assert _grids(t, 4, 75, torch.float16, torch.float32)["mhc_xphi_kernel"] == grid
        inputs = maps_inputs((t,), 4, 75, torch.float16, seed=t)
        ref_inputs = [inputs[0].detach().float().requires_grad_(), *clone_inputs(inputs[1:])]
        out_ref, grad_ref = run(lambda *a: reference.mhc_maps(*a, sinkhorn_iters=4), ref_inputs)
        out_tri, grad_tri = run(lambda *a: tri.mhc_maps(*a, sinkhorn_iters=4),
                                _to(inputs, DEVICE))
        for a, e, name in zip([*out_tri, *grad_tri], [*out_ref, *grad_ref],
                              ("h_pre", "h_post", "h_res", *NAMES), strict=True):
            assert_close(a.cpu(), e, TOL[torch.float16] if name == "x" else 2e-3)


@kernel_test
def test_maps_of_an_empty_batch_on_the_split_path(small_grid):
    inputs = maps_inputs((1,), 4, 75, torch.float32)
    empty = [inputs[0].detach()[:0].requires_grad_(), *clone_inputs(inputs[1:])]
    out, grads = run(lambda *a: tri.mhc_maps(*a, sinkhorn_iters=4), _to(empty, DEVICE))
    assert [tuple(o.shape) for o in out] == [(0, 4), (0, 4), (0, 4, 4)]
    assert tuple(grads[0].shape) == (0, 4, 75)
    for g in grads[1:]:
        assert torch.count_nonzero(g) == 0


@kernel_test
@pytest.mark.parametrize("t", [5, 200])
def test_maps_are_bitwise_reproducible(t, small_grid):
    """Split sums are added in a fixed order (no atomics): two runs are bitwise equal, on the
    split path (5 tokens, 3 splits) and the one-split path (200 tokens)."""
    inputs = maps_inputs((t,), 2, 150, torch.float32, seed=7)
    g = torch.Generator().manual_seed(8)
    ups = [torch.randn(t, 2, generator=g), torch.randn(t, 2, generator=g),
           torch.randn(t, 2, 2, generator=g)]
    results = []
    for _ in range(2):
        ins = _to(inputs, DEVICE)
        outs = tri.mhc_maps(*ins, sinkhorn_iters=4)
        grads = torch.autograd.grad(outs, ins, [u.to(DEVICE) for u in ups])
        results.append([*outs, *grads])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Autocast: the maps' matmul in the autocast dtype, aggregation and merge in the streams'
# ---------------------------------------------------------------------------------------------


@kernel_test
def test_autocast_runs_the_maps_matmul_in_the_autocast_dtype(monkeypatch):
    """fp32 streams and parameters under autocast (CPU: float16 in the interpreter; GPU:
    bfloat16): the maps op gets x and phi in the autocast dtype, and its maps and gradients
    are the reference's on those rounded inputs."""
    device_type, dt = ("cuda", torch.bfloat16) if ON_GPU else ("cpu", torch.float16)
    seen = []
    plan = tri.plan_maps_fwd

    def recording(x, phi, *args, **kwargs):
        seen.append((x.dtype, phi.dtype))
        return plan(x, phi, *args, **kwargs)

    monkeypatch.setattr(tri, "plan_maps_fwd", recording)
    inputs = maps_inputs((9,), 4, 24, torch.float32, seed=5)

    def rounded_reference(x, phi, *rest):
        return reference.mhc_maps(x.to(dt).float(), phi.to(dt).float(), *rest, sinkhorn_iters=5)

    def autocast_triton(*args):
        with torch.autocast(device_type, dtype=dt):
            return tri.mhc_maps(*args, sinkhorn_iters=5)

    out_ref, grad_ref = run(rounded_reference, clone_inputs(inputs))
    out_tri, grad_tri = run(autocast_triton, _to(inputs, DEVICE))
    assert seen == [(dt, dt)]
    for a, e in zip(out_tri, out_ref, strict=True):
        assert a.dtype == torch.float32
        assert_close(a.cpu(), e, 2e-3)
    for a, e, name in zip(grad_tri, grad_ref, NAMES, strict=True):
        assert a.dtype == torch.float32, name  # through the cast, back to the parameters'
        # x's and phi's gradients are the op's in the autocast dtype (it got them cast), then
        # cast back: that dtype's tolerance (bf16's held phi's at 2.2-2.5x of 2e-3 on an H200)
        assert_close(a.cpu(), e, TOL[dt] if name in ("x", "phi") else 2e-3)


@kernel_test
def test_autocast_leaves_aggregation_and_merge_in_the_streams_dtype():
    """A residual add under autocast stays in its dtype: so do pre_aggregate and post_merge
    of fp32 streams, with the block's output f arriving in the autocast dtype."""
    device_type, dt = ("cuda", torch.bfloat16) if ON_GPU else ("cpu", torch.float16)
    x, f, h_pre, h_post, h_res = [t.detach() for t in merge_inputs((6,), 4, 20, torch.float32)]
    f_half = f.to(dt)
    want_agg = reference.pre_aggregate(x, h_pre)
    want_out = reference.post_merge(x, f_half.float(), h_post, h_res)
    dev = [t.to(DEVICE) for t in (x, f_half, h_pre, h_post, h_res)]
    with torch.autocast(device_type, dtype=dt):
        agg = tri.pre_aggregate(dev[0], dev[2])
        out = tri.post_merge(dev[0], dev[1], dev[3], dev[4])
    assert agg.dtype == out.dtype == torch.float32
    assert_close(agg.cpu(), want_agg, TOL[torch.float32])
    assert_close(out.cpu(), want_out, TOL[torch.float32])


# ---------------------------------------------------------------------------------------------
# (b) pre-aggregation, (c) post-and-merge
# ---------------------------------------------------------------------------------------------


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, n, c", [((7,), 4, 100), ((3, 21), 3, 100), ((63,), 8, 16),
                                             ((5,), 2, 300)])  # two channel blocks, one partial
def test_pre_aggregate_and_post_merge_match_reference(tokens, n, c, dtype):
    inputs = merge_inputs(tokens, n, c, dtype)
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    x, f, h_pre, h_post, h_res = range(5)
    for ref_fn, tri_fn, idx in ((reference.pre_aggregate, tri.pre_aggregate, (x, h_pre)),
                                (reference.post_merge, tri.post_merge, (x, f, h_post, h_res))):
        out_ref, grad_ref = run(ref_fn, [ref_inputs[i] for i in idx], upstream_dtype=dtype)
        out_tri, grad_tri = run(tri_fn, _to([inputs[i] for i in idx], DEVICE))
        assert out_tri[0].dtype == dtype
        for a, e, i in zip([*out_tri, *grad_tri], [*out_ref, *grad_ref], (x, *idx), strict=True):
            assert a.dtype == inputs[i].dtype
            assert_close(a.cpu(), e, TOL[a.dtype])


@kernel_test
def test_merge_ops_accept_non_contiguous_inputs():
    h = torch.randn(2, 5, 12)
    x = h.unsqueeze(-2).expand(2, 5, 3, 12)  # expand_streams' stride-0 view
    _, f, h_pre, h_post, h_res = merge_inputs((2, 5), 3, 12, torch.float32)
    h_res_t = h_res.detach().transpose(-1, -2)  # a transposed view
    results = []
    for impl, dev in ((reference, "cpu"), (tri, DEVICE)):
        xi, fi = x.to(dev), f.detach().to(dev)
        out = impl.post_merge(xi, fi, h_post.detach().to(dev), h_res_t.to(dev))
        agg = impl.pre_aggregate(xi, h_pre.detach().to(dev))
        results.append(out.cpu() + agg.cpu()[..., None, :])
    assert_close(results[1], results[0], 2e-6)


# ---------------------------------------------------------------------------------------------
# Custom ops: schema, fake implementations, autograd registration, torch.compile
# ---------------------------------------------------------------------------------------------


OP_NAMES = ["mhc_maps_fwd", "mhc_maps_bwd", "pre_aggregate_fwd", "pre_aggregate_bwd",
            "post_merge_fwd", "post_merge_bwd", "sinkhorn_fwd", "sinkhorn_bwd",
            "mhc_maps_pre_bwd", "post_merge_bwd_no_dx"]


def _op_samples():
    """Sample arguments of each custom op (tiny: opcheck runs each op several times)."""
    d = DEVICE
    x, f, h_pre, h_post, h_res = [t.detach().to(d) for t in merge_inputs((3,), 3, 5, torch.float32)]
    mx, phi, alpha, b_pre, b_post, b_res = [
        t.detach().to(d) for t in maps_inputs((3,), 3, 5, torch.float32)
    ]
    h_pre_m, h_post_m, h_res_m, logits, r = torch.ops.torch_mhc.mhc_maps_fwd(
        mx, phi, alpha, b_pre, b_post, b_res, 2, 1e-6, 0.0, 0.0
    )
    g = torch.randn_like(x)
    return [
        ("mhc_maps_fwd", (mx, phi, alpha, b_pre, b_post, b_res, 2, 1e-6, 0.0, 0.0)),
        ("mhc_maps_bwd", (mx, phi, alpha, b_pre, b_post, b_res, logits, r,
                          torch.randn_like(h_pre_m), torch.randn_like(h_post_m),
                          torch.randn_like(h_res_m), 2, 0.0)),
        ("pre_aggregate_fwd", (x, h_pre)),
        ("pre_aggregate_bwd", (x, h_pre, f)),
        ("post_merge_fwd", (x, f, h_post, h_res)),
        ("post_merge_bwd", (x, f, h_post, h_res, g)),
        ("sinkhorn_fwd", (h_res, 3, 0.0)),
        ("sinkhorn_bwd", (h_res, torch.randn_like(h_res), 3, 0.0)),
        ("mhc_maps_pre_bwd", (mx, phi, alpha, b_pre, b_post, b_res, logits, r, h_pre_m, h_res_m,
                              torch.randn_like(h_pre_m), torch.randn_like(h_post_m),
                              torch.randn_like(h_res_m), torch.randn(3, 5, device=d),
                              torch.randn_like(mx), 2, 0.0)),
        ("post_merge_bwd_no_dx", (x, f, h_post, h_res, g)),
    ]


@kernel_test
@pytest.mark.parametrize("name", OP_NAMES)
def test_custom_ops_pass_opcheck(name):
    args = dict(_op_samples())[name]
    if name.endswith("_fwd"):  # differentiable ops: check the autograd registration too
        args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                     else a for a in args)
    torch.library.opcheck(getattr(torch.ops.torch_mhc, name).default, args)


@kernel_test
def test_connection_triton_equals_reference_and_compiles_fullgraph():
    c, n = 20, 4
    conn_ref, conn_tri = reference_and("triton", c, n, sinkhorn_iters=5)
    conn_tri.to(DEVICE)
    x = torch.randn(2, 7, n, c)
    upstream = torch.randn(2, 7, n, c)
    assert_connection_matches_reference(conn_ref, conn_tri, x, upstream)


@kernel_test
def test_the_kernels_backwards_refuse_to_build_a_graph():
    """Second derivatives through the kernels would be wrong (their results are constants to
    autograd): a backward with create_graph=True is refused, naming the reference."""
    c, n = 20, 4
    _, conn_tri = reference_and("triton", c, n, sinkhorn_iters=5)
    conn_tri.to(DEVICE)
    x = torch.randn(2, 7, n, c, device=DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match="torch_mhc's 'triton' ops compute first "
                       "derivatives only"):
        torch.autograd.grad(conn_tri(x).square().sum(), x, create_graph=True)


@kernel_test
def test_auto_picks_triton_for_cuda_tensors(monkeypatch):
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    assert ops.get_impl("auto", "cuda", torch.bfloat16).mhc_maps is tri.mhc_maps
    assert ops.get_impl("triton", "cpu").post_merge is tri.post_merge


@kernel_test
def test_clear_errors_for_unsupported_inputs(monkeypatch):
    x, f, h_pre, h_post, h_res = merge_inputs((3,), 3, 5, torch.float32)
    with pytest.raises(TypeError, match="float32, float16 and bfloat16.*float64"):
        tri.pre_aggregate(x.double(), h_pre)
    monkeypatch.setattr(tri, "_INTERPRETED", False)
    with pytest.raises(RuntimeError, match="needs CUDA tensors.*TRITON_INTERPRET=1"):
        tri.post_merge(x.cpu(), f.cpu(), h_post.cpu(), h_res.cpu())


@pytest.mark.skipif(RUN_HERE, reason="the kernel tests run in this process")
def test_kernels_in_a_fresh_interpreter_process():
    """Run this module's kernel tests where TRITON_INTERPRET=1 precedes any triton import."""
    run_in_fresh_interpreter(__file__)
