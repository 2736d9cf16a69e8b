"""The op-level correctness sections of the GPU check: each builds its cases and holds every
output to the tests' tolerance with checks.check_op (or, for the large case, on slices)."""

from __future__ import annotations

import torch

from torch_mhc import ops as _ops
from torch_mhc.functional.sinkhorn import LINEAR_RANGE
from torch_mhc.tools.bench.gpu_check.checks import (
    MAPS_TOL,
    NAMES,
    TOL,
    call,
    check_op,
    dtype_name,
    judge,
    op_inputs,
    rows_until,
    section,
    tolerances,
)

OPS = ("mhc_maps", "pre_aggregate", "post_merge", "sinkhorn")


def _row(case: str, impl: str, op: str, dtype, n: int, inputs, params=None) -> dict:
    return {"case": case, "impl": impl, "op": op, "dtype": dtype_name(dtype), "n": n,
            "params": dtype_name(params) if params is not None else None,
            "shape": list(inputs[0].shape)}


def check_correctness(cfg: dict, combos=None) -> dict:
    """Every op of cfg["impls"] for each (dtype, n) of combos (default cfg["dtypes"] x
    cfg["ns"]) against the reference."""
    cases = []
    combos = combos or [(dt, n) for dt in cfg["dtypes"] for n in cfg["ns"]]
    for impl in cfg["impls"]:
        for dtype, n in combos:
            gen = torch.Generator().manual_seed(n)
            inputs = op_inputs(n, cfg["channels"], cfg["tokens"], dtype, cfg["device"], gen)
            for op in OPS:
                row = _row("correctness", impl, op, dtype, n, inputs[op])
                cases.append((row, lambda r, op=op, i=inputs[op], impl=impl:
                              check_op(r, call(op), i, impl)))
    return section(rows_until(cfg["deadline"], cases))


def check_params(cfg: dict) -> dict:
    """The maps of a model cast whole: streams and parameters in one half dtype."""
    cases = []
    for dtype in cfg["param_dtypes"]:
        for n in cfg["case_ns"]:
            gen = torch.Generator().manual_seed(10 + n)
            inputs = op_inputs(n, cfg["channels"], cfg["tokens"], dtype, cfg["device"], gen,
                               param_dtype=dtype)["mhc_maps"]
            row = _row("parameters cast with the model", "triton", "mhc_maps", dtype, n, inputs,
                       params=dtype)
            cases.append((row, lambda r, i=inputs: check_op(r, call("mhc_maps"), i)))
    return section(rows_until(cfg["deadline"], cases))


EPS = dict(norm_eps=1e-4, sinkhorn_eps=1e-2, pre_eps=1e-2)  # DeepSeek-V4's kind of values


H_POST_NAMES = ("h_post",) + NAMES["mhc_maps"][3:]


def _h_post_only(o, *a):
    return call("mhc_maps", **EPS)(o, *a)[1]


def check_eps(cfg: dict) -> dict:
    """eps > 0 in the fused maps (and the Sinkhorn op), and only H_post used downstream (the
    other maps' gradients absent)."""
    cases = []
    for dtype in cfg["case_dtypes"]:
        for n in cfg["case_ns"]:
            gen = torch.Generator().manual_seed(20 + n)
            inputs = op_inputs(n, cfg["channels"], cfg["tokens"], dtype, cfg["device"], gen)
            maps, logits = inputs["mhc_maps"], [inputs["sinkhorn"][0].clamp(-20, 20)]
            cases += [
                (_row("eps > 0", "triton", "mhc_maps", dtype, n, maps),
                 lambda r, i=maps: check_op(r, call("mhc_maps", **EPS), i)),
                (_row("eps > 0", "triton", "sinkhorn", dtype, n, logits),
                 lambda r, i=logits: check_op(r, call("sinkhorn", eps=1e-2), i)),
            ]
        maps = op_inputs(4, cfg["channels"], cfg["tokens"], dtype, cfg["device"],
                         torch.Generator().manual_seed(29))["mhc_maps"]
        cases.append((_row("eps > 0, only H_post used", "triton", "mhc_maps", dtype, 4, maps),
                      lambda r, i=maps: check_op(r, _h_post_only, i, names=H_POST_NAMES,
                                                 tols=tolerances("mhc_maps", i)[2:])))
    return section(rows_until(cfg["deadline"], cases))


def _residual_spans(x, phi, alpha, b_res, norm_eps=1e-6) -> torch.Tensor:
    """Per token, max - min of the residual logits H~_res (the maths of DESIGN.md), in fp32."""
    n = x.shape[-2]
    v = x.flatten(-2).float()
    r = torch.sqrt(v.square().mean(-1, keepdim=True) + norm_eps)
    res = alpha[2].float() * (v @ phi.float())[..., 2 * n:] / r + b_res.float().flatten()
    return res.amax(-1) - res.amin(-1)


def check_far_logits(cfg: dict) -> dict:
    """alpha_res large: the fused maps' Sinkhorn runs in the log domain, for every token
    ("far") or about half of them ("mixed": near and far tokens in one block)."""
    cases = []
    for dtype in cfg["case_dtypes"]:
        for n in cfg["case_ns"]:
            gen = torch.Generator().manual_seed(30 + n)
            maps = op_inputs(n, cfg["channels"], cfg["tokens"], dtype, cfg["device"],
                             gen)["mhc_maps"]
            x, phi, alpha, _, _, b_res = maps
            unit = _residual_spans(x, phi, torch.ones(3, device=x.device), b_res * 0)
            for kind, a_res in (("far", 60.0), ("mixed", LINEAR_RANGE / float(unit.median()))):
                ins = [t.clone() for t in maps]
                ins[2][2] = a_res
                spans = _residual_spans(*ins[:3], ins[5])
                row = _row(f"far logits ({kind})", "triton", "mhc_maps", dtype, n, ins)
                row.update(alpha_res=a_res,
                           log_domain_fraction=float((spans > LINEAR_RANGE).float().mean()))
                tols = ([1e-4] * 9 if dtype == torch.float32
                        else tolerances("mhc_maps", ins))  # as the far-logits maps test
                cases.append((row, lambda r, i=ins, t=tols: check_op(
                    r, call("mhc_maps"), i, tols=t)))
    return section(rows_until(cfg["deadline"], cases))


# ---------------------------------------------------------------------------------------------
# Past 2^31 elements: the ops on the whole tensor, the reference on slices
# ---------------------------------------------------------------------------------------------


def _large_inputs(lc: dict, device: str) -> dict[str, list[torch.Tensor]]:
    """Inputs of each op at the large size, drawn on the device (the CPU would take minutes)."""
    t, n, c, dtype = lc["tokens"], lc["n"], lc["channels"], lc["dtype"]
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, dt=dtype, scale=1.0):
        t = torch.randn(*shape, generator=gen, device=device, dtype=dt)
        return t if scale == 1.0 else t * scale

    m = n * n + 2 * n
    x = rnd(t, n, c)
    params = [rnd(n * c, m, dt=torch.float32, scale=(n * c) ** -0.5),
              torch.tensor([1.0, 1.0, 2.0], device=device), rnd(n, dt=torch.float32),
              rnd(n, dt=torch.float32), rnd(n, n, dt=torch.float32)]
    maps = [rnd(t, n, dt=torch.float32).sigmoid(), rnd(t, n, dt=torch.float32),
            rnd(t, n, n, dt=torch.float32).softmax(-1)]
    return {"mhc_maps": [x, *params], "pre_aggregate": [x, maps[0]],
            "post_merge": [x, rnd(t, c), maps[1], maps[2]]}


def _large_op(op: str, inputs, slices, lc, device) -> list[dict]:
    """One op forward and backward on the whole tensors; rows comparing the per-token outputs
    and gradients on each slice with the reference run on that slice only."""
    fn = call(op)
    ins = [t.detach().requires_grad_() for t in inputs]
    outs = fn(_ops.get_impl("triton"), *ins)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    gen = torch.Generator(device=device).manual_seed(1)
    ups = [torch.randn(o.shape, generator=gen, device=device, dtype=o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, ins, ups)
    finite = all(bool(torch.isfinite(t).all()) for t in (*outs, *grads))
    # Per-token tensors are sliced; parameters (mhc_maps' phi, alpha, biases) are whole, and
    # their gradients, sums over every token, cannot be checked on a slice.
    per_token = [i for i, t in enumerate(inputs) if t.shape[0] == lc["tokens"]]
    rows = []
    for where, s in slices.items():
        part = [t[s] if i in per_token else t for i, t in enumerate(inputs)]
        ref_ins = [t.detach().float().requires_grad_() for t in part]
        want = fn(_ops.get_impl("reference"), *ref_ins)
        want = list(want) if isinstance(want, tuple) else [want]
        want_grads = torch.autograd.grad(want, ref_ins, [u[s].to(w.dtype) for u, w in
                                                         zip(ups, want, strict=True)])
        names = (NAMES[op][: len(outs)] + tuple(NAMES[op][len(outs) + i] for i in per_token))
        tols = tolerances(op, inputs)
        tols = tols[: len(outs)] + [tols[len(outs) + i] for i in per_token]
        row = {"case": f"> 2^31 elements ({where} tokens)", "impl": "triton", "op": op,
               "dtype": dtype_name(lc["dtype"]), "n": lc["n"], "shape": list(inputs[0].shape),
               "elements": inputs[0].numel(), "past_2_31": inputs[0].numel() > 2**31,
               "tokens": [s.start, s.stop]}
        got = [o[s] for o in outs] + [grads[i][s] for i in per_token]
        judge(row, names, got, [w.detach() for w in want] +
              [want_grads[i] for i in per_token], tols)
        row["finite_everywhere"] = finite
        row["pass"] = row["pass"] and finite
        rows.append(row)
    return rows


def check_large(cfg: dict) -> dict:
    """T x n x C past 2^31 elements (full run): every op on the whole tensors, the first and
    last token slices against the reference on those slices; every output checked finite."""
    lc, device = cfg["large"], cfg["device"]
    k = lc["slice"]
    slices = {"first": slice(0, k), "last": slice(lc["tokens"] - k, lc["tokens"])}
    inputs = _large_inputs(lc, device)
    rows = []
    for op in inputs:
        base = {"case": "> 2^31 elements", "impl": "triton", "op": op,
                "dtype": dtype_name(lc["dtype"]), "n": lc["n"], "shape": list(inputs[op][0].shape)}
        try:
            rows += _large_op(op, inputs[op], slices, lc, device)
        except Exception as err:  # recorded; the next op runs
            rows.append({**base, "error": f"{type(err).__name__}: {err}"[:2000], "pass": False})
        if device == "cuda":
            torch.cuda.empty_cache()
    return section(rows)


# ---------------------------------------------------------------------------------------------
# After the caching allocator was filled with NaN
# ---------------------------------------------------------------------------------------------


def fill_allocator_with_nan(device: str, mib: int) -> None:
    """Allocate blocks of many sizes (small and large pools), fill them with 0xFF bytes (NaN
    in fp32, fp16 and bf16) and free them: the allocator hands them out again, so memory an
    op allocates and leaves unwritten reads as NaN."""
    if device == "cuda":  # every cached block released: the ones made below are all NaN
        torch.cuda.empty_cache()
    blocks, total, size = [], 0, 4096
    while total < mib * 2**20:
        for _ in range(4):
            blocks.append(torch.empty(size, dtype=torch.uint8, device=device).fill_(255))
            total += size
        size = min(size * 2, 2**28)
    if device == "cuda":
        torch.cuda.synchronize()
    del blocks


def check_nan_fill(cfg: dict) -> dict:
    """Every op after the allocator was filled with NaN (before each case)."""
    cases = []
    for dtype in cfg["case_dtypes"]:
        for n in cfg["case_ns"]:
            gen = torch.Generator().manual_seed(40 + n)
            inputs = op_inputs(n, cfg["channels"], cfg["tokens"], dtype, cfg["device"], gen)
            for op in OPS:
                def thunk(r, op=op, i=inputs[op]):
                    fill_allocator_with_nan(cfg["device"], cfg["nan_fill_mib"])
                    return check_op(r, call(op), i)

                cases.append((_row("after a NaN fill", "triton", op, dtype, n, inputs[op]),
                              thunk))
    return section(rows_until(cfg["deadline"], cases))


__all__ = ["MAPS_TOL", "TOL", "check_correctness", "check_eps", "check_far_logits",
           "check_large", "check_nan_fill", "check_params", "fill_allocator_with_nan"]
