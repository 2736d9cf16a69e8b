"""The GPU check's sections on how the ops are called: a connection compiled with
torch.compile(fullgraph=True) or captured in a CUDA graph against the same connection run
eagerly, and the ops under autocast, on non-contiguous inputs and on a non-default stream
against the reference."""

from __future__ import annotations

import torch

from torch_mhc import ManifoldHyperConnection
from torch_mhc.tools.bench.gpu_check.cases import OPS
from torch_mhc.tools.bench.gpu_check.checks import (
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

NEEDS_CUDA = "needs a CUDA device"


class Branch(torch.nn.Module):
    """A block F: tanh(Linear(h))."""

    def __init__(self, c: int):
        super().__init__()
        self.lin = torch.nn.Linear(c, c)

    def forward(self, h):
        return torch.tanh(self.lin(h))


def _connection(cc: dict, dtype: torch.dtype, device: str) -> ManifoldHyperConnection:
    """An mHC connection on the triton ops with perturbed parameters (phi = 0 at init)."""
    torch.manual_seed(0)
    conn = ManifoldHyperConnection(cc["channels"], cc["n"], 1, Branch(cc["channels"]),
                                   impl="triton")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in conn.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return conn.to(device=device, dtype=dtype)


def _run_connection(fn, conn, x, up) -> list[torch.Tensor]:
    """Output, then the gradients of x and of every parameter."""
    xi = x.detach().clone().requires_grad_()
    out = fn(xi)
    return [out.detach(), *torch.autograd.grad(out, [xi, *conn.parameters()], up)]


def _graphed(conn, x, up):
    """fn(x) replaying a CUDA graph of the connection's forward and backward captured on
    static tensors (warmed up on a side stream first, as torch.cuda.graphs asks)."""
    static_x = x.detach().clone().requires_grad_()
    params = list(conn.parameters())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            out = conn(static_x)
            torch.autograd.grad(out, [static_x, *params], up)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = conn(static_x)
        static_grads = torch.autograd.grad(static_out, [static_x, *params], up)

    def replay(new_x):
        with torch.no_grad():
            static_x.copy_(new_x)
        graph.replay()
        return [static_out.detach().clone(), *(g.clone() for g in static_grads)]

    return replay


def _compile_row(cfg: dict, dtype: torch.dtype, kind: str) -> dict:
    cc, device = cfg["compile"], cfg["device"]
    shape = [cc["batch"], cc["tokens"], cc["n"], cc["channels"]]
    return {"case": kind, "impl": "triton", "op": "ManifoldHyperConnection",
            "dtype": dtype_name(dtype), "n": cc["n"], "shape": shape,
            "backend": cc["backend"] if kind.startswith("torch.compile") else None,
            "device": device}


def _check_compiled(row: dict, cfg: dict, dtype: torch.dtype) -> dict:
    """The connection compiled (or graphed) against it run eagerly, on inputs other than the
    ones it was compiled or captured with; each output at the connection test's tolerance."""
    cc, device = cfg["compile"], cfg["device"]
    try:
        conn = _connection(cc, dtype, device)
        gen = torch.Generator().manual_seed(1)
        x0, x1, up = (torch.randn(row["shape"], generator=gen).to(device, dtype)
                      for _ in range(3))
        if row["case"].startswith("torch.compile"):
            compiled = torch.compile(conn, fullgraph=True, backend=cc["backend"])
            _run_connection(compiled, conn, x0, up)
            got = _run_connection(compiled, conn, x1, up)
        else:
            got = _graphed(conn, x0, up)(x1)
        want = _run_connection(conn, conn, x1, up)
        names = ["out", "d_x", *(f"d_{k}" for k, _ in conn.named_parameters())]
        # tests/ops/test_triton.py holds the compiled fp32 connection to 2e-5.
        judge(row, names, got, want, [TOL[dtype]] * len(got))
        row["bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    except Exception as err:  # recorded; the next case runs
        row["error"], row["pass"] = f"{type(err).__name__}: {err}"[:2000], False
    return row


def check_compile(cfg: dict) -> dict:
    cases = []
    for dtype in cfg["compile"]["dtypes"]:
        for kind in ("torch.compile(fullgraph=True)", "CUDA graph"):
            row = _compile_row(cfg, dtype, kind)
            if kind == "CUDA graph" and cfg["device"] != "cuda":
                row["skipped"] = NEEDS_CUDA
                cases.append((row, None))
                continue
            cases.append((row, lambda r, dt=dtype: _check_compiled(r, cfg, dt)))
    return section(rows_until(cfg["deadline"], cases))


# ---------------------------------------------------------------------------------------------
# autocast, non-contiguous inputs, a non-default stream
# ---------------------------------------------------------------------------------------------


def strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view whose last dimension has stride 2 (differentiable)."""
    big = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
    big[..., ::2] = t
    return big[..., ::2]


def transposed(t: torch.Tensor) -> torch.Tensor:
    """t's values stored with its last two dimensions swapped (a transposed view)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() >= 2 else strided(t)


def expanded(t: torch.Tensor) -> torch.Tensor:
    """Streams [T, n, C] as expand_streams makes them: stream 0 broadcast (stride 0)."""
    return t[..., :1, :].expand(t.shape) if t.dim() == 3 and t.shape[-1] > t.shape[-2] else t


LAYOUTS = {"strided": strided, "transposed": transposed, "expanded": expanded}


def _in_layout(op: str, layout):
    fn = call(op)
    return lambda o, *a: fn(o, *(layout(t) for t in a))


def _autocast(op: str, device: str, dtype: torch.dtype):
    """The triton op under autocast."""
    fn = call(op)

    def run(o, *a):
        with torch.autocast(device, dtype=dtype):
            return fn(o, *a)

    return run


def _autocast_reference(op: str, dtype: torch.dtype):
    """The reference on the inputs as autocast hands them to the op (without autocast, in
    fp32): the maps' x and phi rounded to the autocast dtype (ops/triton/ops.py's rule), the
    other ops' inputs as they are."""
    fn = call(op)
    if op != "mhc_maps":
        return fn
    return lambda o, x, phi, *rest: fn(o, x.to(dtype).float(), phi.to(dtype).float(), *rest)


def _autocast_inputs(op: str, by_dtype: dict, half: torch.dtype, streams: torch.dtype):
    """The op's inputs with streams of `streams` and parameters in fp32; the merge's block
    output f in the autocast dtype, as a block run under autocast returns it."""
    inputs = list(by_dtype[streams][op])
    if op == "post_merge":
        inputs[1] = inputs[1].to(half)
    return inputs


def _autocast_cases(op: str, by_dtype: dict, half: torch.dtype, device: str, n: int):
    """Rows of the op under autocast: half streams with fp32 parameters, and fp32 streams
    and parameters (tests/ops/test_triton.py's autocast tests), each against the reference on
    the rounded inputs, at the tolerances of the inputs' dtypes as autocast casts them."""
    cases = []
    for streams in dict.fromkeys((half, torch.float32)):
        inputs = _autocast_inputs(op, by_dtype, half, streams)
        # The maps op gets x and phi in the autocast dtype, so their gradients are stored in
        # it before the cast back (tolerances: a gradient at its parameter's dtype).
        as_cast = ([inputs[0].to(half), inputs[1].to(half), *inputs[2:]] if op == "mhc_maps"
                   else inputs)
        row = {"case": f"autocast {dtype_name(half)}", "impl": "triton", "op": op,
               "dtype": dtype_name(streams), "params": "float32", "n": n,
               "shape": list(inputs[0].shape)}
        tols = tolerances(op, as_cast)
        cases.append((row, lambda r, op=op, i=inputs, t=tols: check_op(
            r, _autocast(op, device, half), i, ref_fn=_autocast_reference(op, half), tols=t)))
    return cases


def _on_side_stream(op: str):
    """The op forward on a new stream (its backward then runs there too, as autograd runs a
    backward on its forward's stream); the caller's stream waits for it."""
    fn = call(op)

    def run(o, *a):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = fn(o, *a)
        torch.cuda.current_stream().wait_stream(side)
        return out

    return run


def check_contexts(cfg: dict) -> dict:
    """Each op under autocast (half streams and fp32 parameters; fp32 streams and
    parameters), on non-contiguous inputs and on a non-default stream, against the
    reference in fp32."""
    cases, device, half = [], cfg["device"], cfg["half"]
    ref = {op: call(op) for op in OPS}
    for n in cfg["case_ns"]:
        gen = torch.Generator().manual_seed(50 + n)
        by_dtype = {dt: op_inputs(n, cfg["channels"], cfg["tokens"], dt, device, gen)
                    for dt in dict.fromkeys((torch.float32, half))}
        for op in OPS:
            cases += _autocast_cases(op, by_dtype, half, device, n)
            for name, layout in LAYOUTS.items():
                if name == "expanded" and op == "sinkhorn":
                    continue
                inputs = by_dtype[torch.float32][op]
                row = {"case": f"non-contiguous ({name})", "impl": "triton", "op": op,
                       "dtype": "float32", "n": n, "shape": list(inputs[0].shape)}
                fn = _in_layout(op, layout)
                cases.append((row, lambda r, fn=fn, i=inputs: check_op(r, fn, i)))
            row = {"case": "non-default stream", "impl": "triton", "op": op,
                   "dtype": dtype_name(half), "n": n, "shape": list(inputs[0].shape)}
            if device != "cuda":
                row["skipped"] = NEEDS_CUDA
            inputs = by_dtype[half][op]
            row["shape"] = list(inputs[0].shape)
            cases.append((row, lambda r, op=op, i=inputs: check_op(
                r, _on_side_stream(op), i, ref_fn=ref[op])))
    return section(rows_until(cfg["deadline"], cases))


__all__ = ["check_compile", "check_contexts", "expanded", "strided", "transposed"]
