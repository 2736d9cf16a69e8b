"""The `triton` op implementation against `ops.reference`: kernels, custom ops, compile.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (fp32 and fp16; bf16
only on a GPU). TRITON_INTERPRET must be set before triton is first imported (triton's own
@jit library functions are decorated then), and in a full test run another module has
usually imported triton already. So on a machine without a GPU this module's tests run in a
fresh process started by `test_kernels_in_a_fresh_interpreter_process`, with
TRITON_INTERPRET=1 from the start; run directly that way, they run in-process:

    TRITON_INTERPRET=1 pytest tests/test_ops_triton.py

Sizes are small: the interpreter runs every kernel instruction as a numpy call.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import torch_mhc.ops as ops  # noqa: E402
from test_ops_cpu import (  # noqa: E402
    Branch,
    _perturbed,
    assert_close,
    clone_inputs,
    maps_inputs,
    merge_inputs,
    run,
)
from torch_mhc import ManifoldHyperConnection, sinkhorn_unrolled  # noqa: E402
from torch_mhc.ops import reference  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
INTERPRETER_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
RUN_HERE = ON_GPU or INTERPRETER_CHILD

if RUN_HERE:
    from torch_mhc.ops import triton_ops as tri

    assert tri.interpreted() == (not ON_GPU)
else:
    tri = None

kernel_test = pytest.mark.skipif(
    not RUN_HERE,
    reason="runs in a fresh TRITON_INTERPRET=1 process (see the module docstring)",
)

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# The kernels compute in fp32 and round once on store; compare with the reference run in
# fp32 (from the same rounded inputs) at the storage dtype's resolution.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
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
    # Matmuls run in TF32 for half-precision streams on a GPU (phi rounded to 10 bits).
    maps_tol = 2e-5 if dtype == torch.float32 or not ON_GPU else 2e-3
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


# ---------------------------------------------------------------------------------------------
# (b) pre-aggregation, (c) post-and-merge
# ---------------------------------------------------------------------------------------------


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, n, c", [((7,), 4, 100), ((3, 21), 3, 100), ((63,), 8, 16)])
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
            "post_merge_fwd", "post_merge_bwd", "sinkhorn_fwd", "sinkhorn_bwd"]


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
    torch.manual_seed(0)
    conn_ref = _perturbed(ManifoldHyperConnection(c, n, 1, Branch(c), sinkhorn_iters=5,
                                                  impl="reference"))
    conn_tri = ManifoldHyperConnection(c, n, 1, Branch(c), sinkhorn_iters=5, impl="triton")
    conn_tri.load_state_dict(conn_ref.state_dict())
    conn_tri.to(DEVICE)
    x = torch.randn(2, 7, n, c)
    upstream = torch.randn(2, 7, n, c)
    compiled = torch.compile(conn_tri, fullgraph=True, backend="aot_eager")
    results = []
    for conn, dev in ((conn_ref, "cpu"), (conn_tri, DEVICE), (compiled, DEVICE)):
        xi = x.to(dev).requires_grad_()
        out = conn(xi)
        grads = torch.autograd.grad(out, [xi, *conn.parameters()], upstream.to(dev))
        results.append([out.cpu(), *[g.cpu() for g in grads]])
    for got in results[1:]:
        for a, e in zip(got, results[0], strict=True):
            assert_close(a, e, 2e-5)


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


# ---------------------------------------------------------------------------------------------
# The compiled (non-interpreted) path: every kernel compiles for an H100/H200 (sm_90)
# ---------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from torch_mhc.ops import triton_kernels as K

def build(fn, ptrs, consts):
    sig = {a: ("constexpr" if a in consts else ptrs.get(a, "i32")) for a in fn.arg_names}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
    triton.compile(src, target=GPUTarget("cuda", 90, 32))

F, B = "*fp32", "*bf16"
eps = {"norm_eps": "fp32", "sk_eps": "fp32", "pre_eps": "fp32", "eps": "fp32"}
maps = dict(N=3, NP=4, ITERS=20, BLOCK_T=32, BLOCK_K=64, PRECISION="tf32")
ptrs = {a: (B if a in ("x_ptr", "dx_ptr") else F) for a in K.mhc_maps_bwd_kernel.arg_names
        if a.endswith("_ptr")}
build(K.mhc_maps_fwd_kernel, {**ptrs, "h_pre_ptr": F, "h_post_ptr": F, "h_res_ptr": F, **eps},
      maps)
build(K.mhc_maps_bwd_kernel, {**ptrs, **eps}, maps)
build(K.mhc_dphi_kernel, {"x_ptr": B, "dz_ptr": F, "dphi_ptr": F},
      {k: maps[k] for k in ("N", "NP", "BLOCK_T", "BLOCK_K", "PRECISION")})
stream = dict(N=3, NP=4, BLOCK_T=2, BLOCK_C=256)
half = {a: B for a in ("x_ptr", "f_ptr", "g_ptr", "out_ptr", "da_ptr", "dx_ptr", "df_ptr")}
for fn in (K.pre_fwd_kernel, K.pre_bwd_kernel, K.merge_fwd_kernel, K.merge_bwd_kernel):
    build(fn, {a: half.get(a, F) for a in fn.arg_names if a.endswith("_ptr")}, stream)
for fn in (K.sinkhorn_fwd_kernel, K.sinkhorn_bwd_kernel):
    build(fn, {**{a: F for a in fn.arg_names if a.endswith("_ptr")}, **eps},
          dict(N=4, NP=4, ITERS=20, BLOCK_T=32))
print("compiled")
"""


@pytest.mark.skipif(INTERPRETER_CHILD, reason="runs in the parent process")
def test_kernels_compile_for_sm90():
    """Catches what the interpreter accepts and the compiler rejects; needs no GPU."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas) and shutil.which("ptxas") is None:
        pytest.skip("no ptxas to compile for a GPU target")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.skipif(RUN_HERE, reason="the kernel tests run in this process")
def test_kernels_in_a_fresh_interpreter_process():
    """Run this module's kernel tests where TRITON_INTERPRET=1 precedes any triton import."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "skipped" in tail, tail  # the sm_90 check skips itself there
