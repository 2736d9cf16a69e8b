"""Ahead-of-time compile check of the Triton kernels: no GPU needed.

Every custom op of ops/triton/ops.py builds its launches with a `plan_*` function (grid,
arguments, constexprs, num_warps, num_stages); the op runs them, and this module calls the
same functions with meta tensors (shapes and dtypes, no memory) and compiles each launch for
a GPU target with the ptxas that ships in the triton wheel. Triton's own argument binder
derives the signature and the specialisations (16-byte alignment, divisibility) from those
arguments, as at a real launch. From ptxas's log: registers and spill bytes; from the
compiled kernel: shared memory; from the three: the theoretical occupancy.

    mhc bench --aot                                     # full matrix, table on stdout
    mhc bench --aot --n 2,4,8 --cc 90 --dtypes bf16 --json out.json
    mhc bench --aot                                     # the same, from the bench CLI

Results are cached by kernel hash in TORCH_MHC_AOT_CACHE (default: a folder in the system's
temporary directory), with triton's own cache beside them, so a rerun compiles only what
changed. Needs triton and a process where TRITON_INTERPRET is not set.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
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

from torch_mhc.runtime.files import atomic_write

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FULL = dict(cc=(80, 90), dtypes=("fp32", "bf16", "fp16"), n=(2, 3, 4, 5, 8, 12, 16))
# Register file, shared memory per SM (bytes, what one SM can give its blocks), warps per SM.
_SM = {80: (65536, 164 * 1024, 64), 90: (65536, 228 * 1024, 64)}


def cache_dir() -> str:
    path = os.environ.get("TORCH_MHC_AOT_CACHE") or os.path.join(
        tempfile.gettempdir(), "torch_mhc_triton_aot")
    os.makedirs(path, exist_ok=True)
    return path


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def op_args(n: int, dtype: torch.dtype, tokens: int = 8192, channels: int = 4096,
            iters: int = 20, make=_meta) -> dict[str, tuple]:
    """Arguments of every custom op at this size; tensors from make(*shape, dtype=...).

    Streams and parameters in `dtype` (a model cast to bf16 has bf16 phi); maps, gates and
    their gradients in float32, as the ops pass them.
    """
    t, c, m = tokens, channels, n * n + 2 * n
    x, f = make(t, n, c, dtype=dtype), make(t, c, dtype=dtype)
    params = (make(n * c, m, dtype=dtype), make(3, dtype=dtype), make(n, dtype=dtype),
              make(n, dtype=dtype), make(n, n, dtype=dtype))
    h_pre, h_post, h_res = make(t, n), make(t, n), make(t, n, n)
    return {
        "mhc_maps_fwd": (x, *params, iters, 1e-6, 0.0, 0.0),
        "mhc_maps_bwd": (x, *params, make(t, m), make(t), h_pre, h_post, h_res, iters, 0.0),
        "pre_aggregate_fwd": (x, h_pre),
        "pre_aggregate_bwd": (x, h_pre, f),
        "post_merge_fwd": (x, f, h_post, h_res),
        "post_merge_bwd": (x, f, h_post, h_res, x),
        "sinkhorn_fwd": (make(t, n, n, dtype=dtype), iters, 0.0),
        "sinkhorn_bwd": (make(t, n, n, dtype=dtype), make(t, n, n, dtype=dtype), iters, 0.0),
    }


def op_launches(n: int, dtype: torch.dtype, tokens: int = 8192, channels: int = 4096,
                iters: int = 20, make=_meta) -> list[tuple[str, object]]:
    """(op, Launch) for every launch of every custom op at this size, from the ops' own plans
    (meta tensors by default: nothing is allocated, nothing runs)."""
    from torch_mhc.ops.triton import ops as tri

    out = []
    for op, args in op_args(n, dtype, tokens, channels, iters, make).items():
        launches, _ = tri.PLANS[op](*args)
        out.extend((op, launch) for launch in launches)
    return out


def occupancy(regs: int, shared: int, num_warps: int, cc: int) -> float:
    """Resident warps per SM over the maximum, from registers, shared memory and block size."""
    reg_file, smem, max_warps = _SM[cc]
    regs_per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256  # allocated per warp in 256s
    by_regs = (reg_file // regs_per_warp) // num_warps
    by_smem = smem // (shared + 1024) if shared else 32  # 1 KiB reserved per block
    blocks = min(by_regs, by_smem, max_warps // num_warps, 32)
    return blocks * num_warps / max_warps


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
    kwargs = dict(launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages)
    if launch.maxnreg is not None:
        kwargs["maxnreg"] = launch.maxnreg
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    src = ASTSource(fn, signature, constexprs, attrs)
    key = hashlib.sha256(f"{src.hash()}-{options.hash()}-{cc}".encode()).hexdigest()
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
    row = dict(regs=regs, spill_stores=spill_stores, spill_loads=spill_loads,
               shared=kernel.metadata.shared, num_warps=launch.num_warps,
               occupancy=occupancy(regs, kernel.metadata.shared, launch.num_warps, cc),
               compile_s=round(time.perf_counter() - started, 2))
    atomic_write(path, json.dumps(row).encode())
    return row


def _job(cc: int, dtype: str, n: int, tokens: int, channels: int, iters: int) -> list[dict]:
    rows = []
    for op, launch in op_launches(n, DTYPES[dtype], tokens, channels, iters):
        base = dict(kernel=launch.name, op=op, cc=cc, dtype=dtype, n=n,
                    constexprs={k: v for k, v in launch.constexprs.items() if k != "N"})
        try:
            rows.append({**base, **compile_launch(launch, cc), "error": None})
        except Exception as err:  # a failure is a result: recorded, then asserted on
            rows.append({**base, "error": f"{type(err).__name__}: {str(err)[:2000]}"})
    return rows


def run_matrix(cc=FULL["cc"], dtypes=FULL["dtypes"], n=FULL["n"], tokens: int = 8192,
               channels: int = 4096, iters: int = 20, jobs: int | None = None) -> list[dict]:
    """Compile every kernel for every (cc, dtype, n); one row per kernel launch."""
    work = [(c, d, k, tokens, channels, iters) for c in cc for d in dtypes for k in n]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work)))
    if jobs == 1:
        results = [_job(*w) for w in work]
    else:
        with ProcessPoolExecutor(jobs) as pool:
            results = list(pool.map(_job, *zip(*work, strict=True)))
    return [row for rows in results for row in rows]


def failures(rows: list[dict], max_regs: int = 255) -> list[str]:
    """What breaks the targets: a compile error, a spill, more than max_regs registers."""
    bad = []
    for r in rows:
        where = f"{r['kernel']} sm_{r['cc']} {r['dtype']} n={r['n']}"
        if r["error"]:
            bad.append(f"{where}: {r['error'][:300]}")
        elif r["spill_stores"] or r["spill_loads"]:
            bad.append(f"{where}: spills {r['spill_stores']} / {r['spill_loads']} bytes")
        elif r["regs"] > max_regs:
            bad.append(f"{where}: {r['regs']} registers")
    return bad


def markdown(rows: list[dict]) -> str:
    lines = ["| kernel | cc | dtype | n | registers | spill bytes | shared memory | warps "
             "| occupancy |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['kernel']} | sm_{r['cc']} | {r['dtype']} | {r['n']} "
                         f"| error | | | | |")
            continue
        lines.append(
            f"| {r['kernel']} | sm_{r['cc']} | {r['dtype']} | {r['n']} | {r['regs']} "
            f"| {r['spill_stores']} | {r['shared']} | {r['num_warps']} "
            f"| {r['occupancy']:.2f} |")
    return "\n".join(lines)


def _csv(cast):
    return lambda text: tuple(cast(v) for v in text.split(",") if v)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The check's options (the parser is built by the `mhc` command: `mhc bench --aot`)."""
    p.add_argument("--cc", type=_csv(int), default=FULL["cc"], help="default 80,90")
    p.add_argument("--dtypes", type=_csv(str), default=FULL["dtypes"], help="fp32,bf16,fp16")
    p.add_argument("--n", type=_csv(int), default=FULL["n"], help="default 2,3,4,5,8,12,16")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--channels", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--jobs", type=int, default=None, help="compile processes (default: cores)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the rows here")


def check_arguments(args: argparse.Namespace) -> None:
    """ValueError naming a dtype the check does not know."""
    for d in args.dtypes:
        if d not in DTYPES:
            raise ValueError(f"--dtypes: expected some of {sorted(DTYPES)}, got {d!r}")


def run_command(args: argparse.Namespace) -> int:
    """Compile the matrix, print the table; 1 (and a FAIL line per problem) if any kernel fails
    to compile, spills or needs more than 255 registers, else 0."""
    rows = run_matrix(args.cc, args.dtypes, args.n, args.tokens, args.channels, args.iters,
                      args.jobs)
    if args.json:
        atomic_write(args.json, json.dumps(rows, indent=1).encode())
    print(markdown(rows))
    bad = failures(rows)
    for line in bad:
        print("FAIL", line, file=sys.stderr)
    return 1 if bad else 0

