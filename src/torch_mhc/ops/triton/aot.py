"""Ahead-of-time compile check of the Triton kernels: no GPU needed.

Every custom op of ops/triton/ops.py builds its launches with a `plan_*` function (grid,
arguments, constexprs, num_warps, num_stages); the op runs them, and this module calls the
same functions with meta tensors (shapes and dtypes, no memory) and compiles each launch for
a GPU target with the ptxas that ships in the triton wheel. Triton's own argument binder
derives the signature and the specialisations (16-byte alignment, divisibility) from those
arguments, as at a real launch. From ptxas's log: registers and spill bytes; from the
compiled kernel: shared memory (against the target's limit per block, which the plans were
given: ops.SMEM_PER_BLOCK) and the PTX's tf32 mma and cvt.rna counts; from the three: the
theoretical occupancy.

The matrix: targets sm_80 (A100), sm_86 (consumer Ampere; sm_89 has the same limits) and
sm_90; streams fp32, bf16, fp16 with parameters of the same dtype or fp32 (autocast, mixed
precision: twice phi's shared memory); Sinkhorn eps 0 (log-domain path) and > 0 (its other
kernel variant); every n the kernels accept (2 .. 16). Variants other than the base (same
dtypes, eps 0) compile only the kernels they change. mHC's successors' maps
(variant_maps_fwd / variant_maps_bwd: the matmul kernels with their res columns and their
per-token kernels) compile for every kind defined at each n (mHC-lite n <= 5, KromHC powers
of two, a static H_res any n); their ops are named with the kind, "variant_maps_fwd:kromhc",
and Sinkhorn's eps leaves them unchanged (2,679 launches in all, 1,125 of them theirs).

    mhc bench --aot                                     # full matrix, table on stdout
    mhc bench --aot --n 2,4,8 --cc 90 --dtypes bf16 --params fp32 --eps 0 --json out.json

Results are cached by kernel hash in TORCH_MHC_AOT_CACHE (default: a folder in the system's
temporary directory), with triton's own cache beside them, so a rerun compiles only what
changed. Needs triton and a process where TRITON_INTERPRET is not set.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import io
import json
import math
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from torch_mhc.functional import successors
from torch_mhc.runtime.files import atomic_write

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# params: "same" (the streams' dtype, a model cast whole) or a dtype name.
FULL = dict(cc=(80, 86, 90), dtypes=("fp32", "bf16", "fp16"), params=("same", "fp32"),
            eps=(0.0, 1e-2), n=(2, 3, 4, 5, 8, 12, 16))
# Register file, shared memory per SM (bytes, what one SM can give its blocks), warps per SM,
# blocks per SM.
_SM = {80: (65536, 164 * 1024, 64, 32), 86: (65536, 100 * 1024, 48, 16),
       89: (65536, 100 * 1024, 48, 24), 90: (65536, 228 * 1024, 64, 32)}
# Ops whose launches a variant changes: phi's dtype the map kernels, eps also Sinkhorn's.
_VARIANT_OPS = ("variant_maps_fwd", "variant_maps_bwd")
_MAPS_OPS = ("mhc_maps_fwd", "mhc_maps_bwd", "mhc_maps_pre_bwd")
_PHI_OPS = (*_MAPS_OPS, *_VARIANT_OPS)
_EPS_OPS = (*_MAPS_OPS, "sinkhorn_fwd", "sinkhorn_bwd")
# Kernels computing an operand (dz) that tf32 dots of other kernels read from memory: in a
# half-stream launch they must round it (cvt.rna) before storing it.
_ROUNDS_FOR_TF32 = ("mhc_maps_bwd_kernel", "variant_maps_bwd_kernel")
_CACHE_VERSION = "3"  # rows gained fields: older cached rows are not reused


def cache_dir() -> str:
    path = os.environ.get("TORCH_MHC_AOT_CACHE") or os.path.join(
        tempfile.gettempdir(), "torch_mhc_triton_aot")
    os.makedirs(path, exist_ok=True)
    return path


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def op_args(n: int, dtype: torch.dtype, tokens: int = 8192, channels: int = 4096,
            iters: int = 20, make=_meta, param_dtype: torch.dtype | None = None,
            eps: float = 0.0) -> dict[str, tuple]:
    """Arguments of every custom op at this size; tensors from make(*shape, dtype=...).

    Streams in `dtype`, parameters in `param_dtype` (default dtype: a model cast to bf16 has
    bf16 phi; fp32 under autocast); maps, gates and their gradients in float32, as the ops
    pass them; eps the Sinkhorn epsilon (0: the variant with the log-domain path). The
    successors' ops appear once per kind defined at n, keyed "op:kind".
    """
    t, c, m = tokens, channels, n * n + 2 * n
    pd = param_dtype or dtype
    x, f = make(t, n, c, dtype=dtype), make(t, c, dtype=dtype)
    params = (make(n * c, m, dtype=pd), make(3, dtype=pd), make(n, dtype=pd),
              make(n, dtype=pd), make(n, n, dtype=pd))
    h_pre, h_post, h_res = make(t, n), make(t, n), make(t, n, n)
    variants = {}
    for kind in _kinds(n):
        res = successors.res_count(kind, n)
        v_params = (make(n * c, 2 * n + res, dtype=pd), make(3 if res else 2, dtype=pd),
                    make(n, dtype=pd), make(n, dtype=pd), make(res, dtype=pd) if res else None)
        variants[f"variant_maps_fwd:{kind}"] = (kind, x, *v_params, 1e-6)
        variants[f"variant_maps_bwd:{kind}"] = (kind, x, *v_params, make(t, 2 * n + res),
                                                make(t), h_pre, h_post, h_res)
    return {
        "mhc_maps_fwd": (x, *params, iters, 1e-6, eps, 0.0),
        "mhc_maps_bwd": (x, *params, make(t, m), make(t), h_pre, h_post, h_res, iters, eps),
        "mhc_maps_pre_bwd": (x, *params, make(t, m), make(t), h_pre, h_res, h_pre, h_post, h_res,
                             f, x, iters, eps),
        "pre_aggregate_fwd": (x, h_pre),
        "pre_aggregate_bwd": (x, h_pre, f),
        "post_merge_fwd": (x, f, h_post, h_res),
        "post_merge_bwd": (x, f, h_post, h_res, x),
        "post_merge_bwd_no_dx": (x, f, h_post, h_res, x),
        "sinkhorn_fwd": (make(t, n, n, dtype=dtype), iters, eps),
        "sinkhorn_bwd": (make(t, n, n, dtype=dtype), make(t, n, n, dtype=dtype), iters, eps),
        **variants,
    }


def _kinds(n: int) -> list[str]:
    """mHC's successors defined at n streams (functional.successors.check_variant)."""
    out = []
    for kind in successors.VARIANT_KINDS:
        try:
            successors.check_variant(kind, n)
        except ValueError:
            continue
        out.append(kind)
    return out


def _base(op: str) -> str:
    """The custom op of an op_args key ("variant_maps_fwd:kromhc" -> "variant_maps_fwd")."""
    return op.split(":", 1)[0]


def op_launches(n: int, dtype: torch.dtype, tokens: int = 8192, channels: int = 4096,
                iters: int = 20, make=_meta, param_dtype: torch.dtype | None = None,
                eps: float = 0.0, smem: int | None = None,
                ops: tuple[str, ...] | None = None) -> list[tuple[str, object]]:
    """(op, Launch) for every launch of every custom op at this size (or of the custom ops in
    `ops`), from the ops' own plans (meta tensors by default: nothing is allocated, nothing
    runs); smem: the target's shared memory per block (default: that of the tensors'
    device). op: the op_args key (the successors' with their kind)."""
    from torch_mhc.ops.triton import ops as tri

    out = []
    for op, args in op_args(n, dtype, tokens, channels, iters, make, param_dtype, eps).items():
        if ops is not None and _base(op) not in ops:
            continue
        kw = {"smem": smem} if _base(op) in _PHI_OPS else {}
        launches, _ = tri.PLANS[_base(op)](*args, **kw)
        out.extend((op, launch) for launch in launches)
    return out


def occupancy(regs: int, shared: int, num_warps: int, cc: int) -> float:
    """Resident warps per SM over the maximum, from registers, shared memory and block size.
    ValueError when not one block fits (too much shared memory or too many registers): a
    launch that cannot run is reported, never an occupancy of 0."""
    reg_file, smem, max_warps, max_blocks = _SM[cc]
    regs_per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256  # allocated per warp in 256s
    by_regs = (reg_file // regs_per_warp) // num_warps
    by_smem = smem // (shared + 1024) if shared else max_blocks  # 1 KiB reserved per block
    blocks = min(by_regs, by_smem, max_warps // num_warps, max_blocks)
    if blocks < 1:
        raise ValueError(f"no block of {num_warps} warps fits on an SM of sm_{cc}: {regs} "
                         f"registers a thread, {shared} bytes of shared memory a block")
    return blocks * num_warps / max_warps


def tf32_counts(ptx: str) -> dict:
    """tf32 tensor-core instructions and round-to-TF32 conversions in a kernel's PTX."""
    mma = sum(1 for line in ptx.splitlines() if "mma" in line and ".tf32" in line)
    return dict(mma_tf32=mma, cvt_rna_tf32=ptx.count("cvt.rna.tf32.f32"))


def loop_barriers(ptx: str) -> int:
    """bar.sync instructions inside the PTX's loops (between a label and a branch back to it):
    each is a block-wide wait every iteration, which a streaming kernel's loop should not
    need (tests/ops/test_triton_aot.py)."""
    lines = ptx.splitlines()
    labels = {}
    for k, line in enumerate(lines):
        m = re.match(r"^(\$L__\w+):", line.strip())
        if m:
            labels[m.group(1)] = k
    inside = set()
    for k, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line)
        if m and labels.get(m.group(1), k) < k:  # a branch backwards closes a loop
            inside.update(range(labels[m.group(1)], k + 1))
    return sum(1 for k in inside if "bar.sync" in lines[k])


def _ptxas_figures(log: str) -> tuple[int, int, int]:
    regs = re.search(r"Used (\d+) registers", log)
    stores = re.search(r"(\d+) bytes spill stores", log)
    loads = re.search(r"(\d+) bytes spill loads", log)
    if regs is None:
        raise RuntimeError(f"no register count in the ptxas log:\n{log[-2000:]}")
    return (int(regs.group(1)), int(stores.group(1)) if stores else 0,
            int(loads.group(1)) if loads else 0)


def compile_launch(launch, cc: int) -> dict:
    """Compile one launch for sm_<cc>; registers, spills, shared memory (cached by hash)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError("the ahead-of-time check needs compiled kernels: unset TRITON_INTERPRET")
    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    kwargs = dict(launch.constexprs, **launch.options)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    src = ASTSource(fn, signature, constexprs, attrs)
    key = hashlib.sha256(
        f"{_CACHE_VERSION}-{src.hash()}-{options.hash()}-{cc}".encode()).hexdigest()
    path = os.path.join(cache_dir(), f"{key}.json")
    if os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)
    started = time.perf_counter()
    buf = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(buf):
        knobs.nvidia.dump_ptxas_log = True  # ptxas -v's log is printed: captured here
        knobs.compilation.always_compile = True  # a cache hit would skip ptxas and its log
        kernel = triton.compile(src, target=target, options=options.__dict__)
    regs, spill_stores, spill_loads = _ptxas_figures(buf.getvalue())
    shared = kernel.metadata.shared
    row = dict(regs=regs, spill_stores=spill_stores, spill_loads=spill_loads, shared=shared,
               shared_limit=_smem(cc), num_warps=launch.num_warps, occupancy=None,
               **tf32_counts(kernel.asm["ptx"]), barriers=kernel.asm["ptx"].count("bar.sync"),
               loop_barriers=loop_barriers(kernel.asm["ptx"]),
               compile_s=round(time.perf_counter() - started, 2))
    try:
        row["occupancy"] = occupancy(regs, shared, launch.num_warps, cc)
    except ValueError as err:  # reported by failures()
        row["occupancy_error"] = str(err)
    atomic_write(path, json.dumps(row).encode())
    return row


def _smem(cc: int) -> int:
    from torch_mhc.ops.triton.ops import SMEM_PER_BLOCK

    return SMEM_PER_BLOCK[cc]


def _variant_ops(dtype: str, params: str, eps: float) -> tuple[str, ...] | None:
    """The ops a variant changes (None: all, the base variant). The successors' maps have no
    Sinkhorn: eps > 0 leaves them as at eps = 0."""
    if params not in ("same", dtype):
        return _MAPS_OPS if eps else _PHI_OPS
    return _EPS_OPS if eps else None


def cases(cc=FULL["cc"], dtypes=FULL["dtypes"], params=FULL["params"], eps=FULL["eps"],
          n=FULL["n"]) -> list[tuple]:
    """(cc, dtype, params, eps, n) for every distinct variant (params equal to the streams'
    dtype count once, as "same")."""
    out = []
    for c in cc:
        for d in dtypes:
            for p in dict.fromkeys("same" if p == d else p for p in params):
                out += [(c, d, p, e, k) for e in eps for k in n]
    return out


def _job(cc: int, dtype: str, params: str, eps: float, n: int, tokens: int, channels: int,
         iters: int) -> list[dict]:
    rows = []
    pd = DTYPES[dtype if params == "same" else params]
    for op, launch in op_launches(n, DTYPES[dtype], tokens, channels, iters,
                                  param_dtype=pd, eps=eps, smem=_smem(cc),
                                  ops=_variant_ops(dtype, params, eps)):
        base = dict(kernel=launch.name, op=op, cc=cc, dtype=dtype, params=params, eps=eps, n=n,
                    constexprs={k: v for k, v in launch.constexprs.items() if k != "N"},
                    num_stages=launch.num_stages)
        try:
            rows.append({**base, **compile_launch(launch, cc), "error": None})
        except Exception as err:  # a failure is a result: recorded, then asserted on
            rows.append({**base, "error": f"{type(err).__name__}: {str(err)[:2000]}"})
    return rows


def run_matrix(cc=FULL["cc"], dtypes=FULL["dtypes"], n=FULL["n"], tokens: int = 8192,
               channels: int = 4096, iters: int = 20, jobs: int | None = None,
               params=FULL["params"], eps=FULL["eps"], work: list[tuple] | None = None
               ) -> list[dict]:
    """Compile every kernel for every (cc, dtype, params, eps, n), or for the cases in
    `work`; one row per kernel launch."""
    work = [(*w, tokens, channels, iters) for w in (work or cases(cc, dtypes, params, eps, n))]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work)))
    if jobs == 1:
        results = [_job(*w) for w in work]
    else:
        with ProcessPoolExecutor(jobs) as pool:
            results = list(pool.map(_job, *zip(*work, strict=True)))
    return [row for rows in results for row in rows]


def _problem(r: dict, max_regs: int) -> str | None:
    if r["error"]:
        return r["error"][:300]
    if r["spill_stores"] or r["spill_loads"]:
        return f"spills {r['spill_stores']} / {r['spill_loads']} bytes"
    if r["regs"] > max_regs:
        return f"{r['regs']} registers"
    if r["shared"] > r["shared_limit"]:
        return f"{r['shared']} bytes of shared memory, over the {r['shared_limit']} a block gets"
    if r["occupancy"] is None:
        return r.get("occupancy_error") or "no occupancy"
    if r["dtype"] == "fp32" and r["mma_tf32"]:
        return f"{r['mma_tf32']} tf32 mma in an fp32 launch (its reference is fp32)"
    if r["kernel"] in _ROUNDS_FOR_TF32 and r["dtype"] != "fp32" and not r["cvt_rna_tf32"]:
        return "an operand of tf32 mma stored unrounded (no cvt.rna.tf32)"
    return None


def failures(rows: list[dict], max_regs: int = 255) -> list[str]:
    """What breaks the targets: a compile error, a spill, more than max_regs registers, more
    shared memory than the target gives a block, no block fitting on an SM, a tf32 mma in an
    fp32 launch or a tf32 operand stored unrounded."""
    bad = []
    for r in rows:
        problem = _problem(r, max_regs)
        if problem:
            where = (f"{_kernel_cell(r)} sm_{r['cc']} {r['dtype']} "
                     f"params={r.get('params', 'same')} eps={r.get('eps', 0.0)} n={r['n']}")
            bad.append(f"{where}: {problem}")
    return bad


def _kernel_cell(r: dict) -> str:
    """The kernel's name, with the successor's kind where the launch is one of theirs."""
    _, _, kind = r.get("op", "").partition(":")
    return f"{r['kernel']} [{kind}]" if kind else r["kernel"]


def markdown(rows: list[dict]) -> str:
    lines = ["| kernel | cc | dtype | params | eps | n | registers | spill bytes | shared memory "
             "| warps | occupancy |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        head = (f"| {_kernel_cell(r)} | sm_{r['cc']} | {r['dtype']} | {r.get('params', 'same')} "
                f"| {r.get('eps', 0.0):g} | {r['n']} ")
        if r["error"]:
            lines.append(head + "| error | | | | |")
            continue
        occ = "none" if r.get("occupancy") is None else f"{r['occupancy']:.2f}"
        lines.append(head + f"| {r['regs']} | {r['spill_stores']} | {r['shared']} "
                     f"| {r['num_warps']} | {occ} |")
    return "\n".join(lines)


def _csv(cast):
    return lambda text: tuple(cast(v) for v in text.split(",") if v)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The check's options (the parser is built by the `mhc` command: `mhc bench --aot`)."""
    p.add_argument("--cc", type=_csv(int), default=FULL["cc"], help="default 80,86,90")
    p.add_argument("--dtypes", type=_csv(str), default=FULL["dtypes"], help="fp32,bf16,fp16")
    p.add_argument("--params", type=_csv(str), default=FULL["params"],
                   help="parameters' dtypes: same (the streams') and/or a dtype; default same,fp32")
    p.add_argument("--eps", type=_csv(float), default=FULL["eps"],
                   help="Sinkhorn epsilons; default 0,0.01 (the kernels' two variants)")
    p.add_argument("--n", type=_csv(int), default=FULL["n"], help="default 2,3,4,5,8,12,16")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--channels", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--jobs", type=int, default=None, help="compile processes (default: cores)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the rows here")


def check_arguments(args: argparse.Namespace) -> None:
    """ValueError naming a dtype or target the check does not know, or the missing triton."""
    require_triton("the ahead-of-time compile check")
    for d in args.dtypes:
        if d not in DTYPES:
            raise ValueError(f"--dtypes: expected some of {sorted(DTYPES)}, got {d!r}")
    for p in args.params:
        if p != "same" and p not in DTYPES:
            raise ValueError(f"--params: expected same or some of {sorted(DTYPES)}, got {p!r}")
    for cc in args.cc:
        if cc not in _SM:
            raise ValueError(f"--cc: expected some of {sorted(_SM)}, got {cc!r}")


def require_triton(what: str) -> None:
    """ValueError saying what needs triton, unless it can be imported (the kernels' launch
    plans, which this check and the bytes model compile or replay, are Triton's)."""
    if importlib.util.find_spec("triton") is None:
        raise ValueError(f"{what} needs triton (pip install -e '.[triton]' in the torch-mhc "
                         "checkout; its compiler runs without a GPU)")


def run_command(args: argparse.Namespace) -> int:
    """Compile the matrix, print the table; 1 (and a FAIL line per problem, see failures) if
    any launch fails, else 0."""
    rows = run_matrix(args.cc, args.dtypes, args.n, args.tokens, args.channels, args.iters,
                      args.jobs, args.params, args.eps)
    if args.json:
        atomic_write(args.json, json.dumps(rows, indent=1).encode())
    print(markdown(rows))
    bad = failures(rows)
    for line in bad:
        print("FAIL", line, file=sys.stderr)
    return 1 if bad else 0

