"""The comparison every correctness case of the GPU check makes, and the inputs of each op.

A case runs one op of an implementation forward and backward with random upstream gradients,
twice (determinism), and the reference implementation (functional.maps) in float32 on the
same device from the same rounded inputs; each output and each input gradient is held to its
own tolerance, as tests/ops/test_triton.py holds them. The result is one row of the report:
a failure inside the case is recorded in the row and the next case runs.
"""

from __future__ import annotations

import time

import torch

from torch_mhc import ops as _ops

# Relative max error allowed (|a - e| <= tol * max|e|) for a tensor stored in this dtype, as
# tests/ops/test_triton.py: the kernels compute in fp32 and round once on store.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# The maps (always fp32) by the streams' dtype: half streams run the map matmuls in TF32.
MAPS_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-3}

# What each op returns, then the gradients of its inputs, in order.
NAMES = {
    "mhc_maps": ("h_pre", "h_post", "h_res", "d_x", "d_phi", "d_alpha", "d_b_pre", "d_b_post",
                 "d_b_res"),
    "pre_aggregate": ("out", "d_x", "d_h_pre"),
    "post_merge": ("out", "d_x", "d_f", "d_h_post", "d_h_res"),
    "sinkhorn": ("out", "d_logits"),
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def rel_err(a: torch.Tensor, e: torch.Tensor) -> float:
    """max|a - e| / max|e| (NaN when either holds a NaN)."""
    a, e = a.detach().double().cpu(), e.detach().double().cpu()
    return float((a - e).abs().max() / e.abs().max().clamp_min(1e-30))


def tolerances(op: str, inputs: list[torch.Tensor], impl: str = "triton") -> list[float]:
    """Per output, then per input gradient, as tests/ops/test_triton.py holds them: the maps
    at MAPS_TOL of the streams' dtype, x's gradient at its dtype's TOL, the parameters'
    gradients at max(MAPS_TOL, 1e-4) and at least their own dtype's TOL (a gradient is stored in
    its parameter's dtype); the other ops' outputs and gradients at the TOL of their dtype.
    Those dtypes are the triton kernels' (they compute in fp32 whatever they store); the
    other implementations compute aggregation and merge in the streams' dtype (as
    functional.maps does), so there every output and gradient is held at the streams' TOL."""
    x = inputs[0].dtype
    if op == "mhc_maps":
        maps = MAPS_TOL[x]
        return [maps] * 3 + [TOL[x]] + [max(maps, 1e-4, TOL[p.dtype]) for p in inputs[1:]]
    if impl != "triton":
        return [TOL[x]] * (1 + len(inputs))
    return [TOL[x]] + [TOL[t.dtype] for t in inputs]


def op_inputs(n: int, c: int, t: int, dtype: torch.dtype, device: str, gen: torch.Generator,
              param_dtype: torch.dtype = torch.float32) -> dict[str, list[torch.Tensor]]:
    """Inputs of each op: streams in `dtype`, mHC parameters in `param_dtype` with O(1) logits,
    maps in float32; Sinkhorn logits with every other matrix spanning more than
    LINEAR_RANGE (the log domain)."""
    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    m = n * n + 2 * n
    x, f = rnd(t, n, c), rnd(t, c)
    params = [rnd(n * c, m, scale=(n * c) ** -0.5, dt=param_dtype),
              torch.tensor([1.0, 1.0, 2.0], device=device, dtype=param_dtype),
              rnd(n, dt=param_dtype), rnd(n, dt=param_dtype), rnd(n, n, dt=param_dtype)]
    h_pre, h_post = rnd(t, n, dt=torch.float32).sigmoid(), rnd(t, n, dt=torch.float32)
    h_res = rnd(t, n, n, dt=torch.float32).softmax(-1)
    far = rnd(t, n, n, scale=3.0, dt=torch.float32)
    far[::2] *= 40.0
    return {"mhc_maps": [x, *params], "pre_aggregate": [x, h_pre],
            "post_merge": [x, f, h_post, h_res], "sinkhorn": [far]}


def call(op: str, **kw):
    """fn(ops, *inputs) running `op` of an implementation with keyword arguments kw."""
    if op == "mhc_maps":
        kw = {"sinkhorn_iters": 20, **kw}
        return lambda o, *a: o.mhc_maps(*a, **kw)
    if op == "sinkhorn":
        return lambda o, a: o.sinkhorn(a, kw.get("iters", 20), eps=kw.get("eps", 0.0))
    return lambda o, *a: getattr(o, op)(*a)


def fwd_bwd(fn, ops, inputs, ups=None, as_fp32=False):
    """Outputs, input gradients and the upstream gradients used (random unless given; given
    ones are cast to the outputs' dtypes). as_fp32: half inputs run in float32."""
    ins = [(t.float() if as_fp32 else t).detach().clone().requires_grad_() for t in inputs]
    outs = fn(ops, *ins)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    if ups is None:
        g = torch.Generator().manual_seed(7)
        ups = [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in outs]
    ups = [u.to(o.dtype) for u, o in zip(ups, outs, strict=True)]
    grads = torch.autograd.grad(outs, ins, ups, allow_unused=True, materialize_grads=True)
    return outs, list(grads), ups


def judge(row: dict, names, got, want, tols) -> dict:
    """row with each output's error and tolerance, the worst ratio, finiteness and pass."""
    errs = [rel_err(a, e) for a, e in zip(got, want, strict=True)]
    ratios = [e / t for e, t in zip(errs, tols, strict=True)]
    worst = max(range(len(ratios)), key=lambda i: ratios[i] if ratios[i] == ratios[i] else 1e300)
    row.update(errors=dict(zip(names, errs, strict=True)), tols=dict(zip(names, tols, strict=True)),
               max_rel_err=max(errs), worst=names[worst], worst_over_tol=ratios[worst],
               finite=all(bool(torch.isfinite(t).all()) for t in got))
    row["pass"] = row["finite"] and row["worst_over_tol"] <= 1
    return row


def check_op(row: dict, fn, inputs, impl: str = "triton", ref_fn=None, names=None,
             tols=None) -> dict:
    """Fill `row`: fn(ops, *inputs) of `impl` twice and ref_fn (default fn) of the reference
    in float32, the same upstream gradients, each output at its tolerance (default:
    tolerances(row["op"], inputs)); an error is recorded in the row."""
    op = row["op"].split()[0]
    names = names or NAMES[op]
    try:
        ops, ref = _ops.get_impl(impl), _ops.get_impl("reference")
        out, grads, ups = fwd_bwd(fn, ops, inputs)
        again, again_grads, _ = fwd_bwd(fn, ops, inputs, ups)
        want, want_grads, _ = fwd_bwd(ref_fn or fn, ref, inputs, ups, as_fp32=True)
        judge(row, names, out + grads, want + want_grads, tols or tolerances(op, inputs, impl))
        row["deterministic"] = all(torch.equal(a, b) for a, b in
                                   zip(out + grads, again + again_grads, strict=True))
        row["pass"] = row["pass"] and row["deterministic"]
    except Exception as err:  # recorded; the check goes on
        row["error"], row["pass"] = f"{type(err).__name__}: {err}"[:2000], False
    return row


def rows_until(deadline: float, cases) -> list[dict]:
    """Run cases (each a (row, thunk filling it)) in order; a row marked skipped is kept as it
    is, and once the deadline has passed the rest are recorded as skipped."""
    rows = []
    for row, thunk in cases:
        if "skipped" not in row and time.perf_counter() > deadline:
            row["skipped"] = "time budget spent"
        rows.append(row if "skipped" in row else thunk(row))
    return rows


def section(rows: list[dict]) -> dict:
    """A check section's result: its rows and whether every row that ran passed."""
    return {"rows": rows, "all_pass": all(r["pass"] for r in rows if "skipped" not in r)}
