"""One command for the first GPU: are the kernels right, how fast, what does mHC cost?

    mhc bench --gpu --out gpu_check        # or: python benchmarks/gpu_check.py --out ...
    TRITON_INTERPRET=1 mhc bench --gpu --dry-run --out /tmp/gc   # CPU, tiny shapes

Sections, each in its own try/except (an error is recorded and the next section runs), under
one global time budget (--budget-s, default 270 s; a section that would start after it is
recorded as skipped), results written after every section (JSON and markdown, each written
to a temporary file and renamed):

    correctness  every op of the `triton` implementation, forward and
                 gradients with random upstream gradients, against functional.maps run in
                 float32 on the same device from the same rounded inputs: fp32 and bf16,
                 n = 2, 4, 8, an awkward C, far-apart Sinkhorn logits included
    kernels      each Triton kernel launch alone (the ops' own plans) at T = 8192 tokens,
                 C = 4096 and 7168, bf16, n = 4: time, bytes it must move, bandwidth as a
                 fraction of a device-to-device copy of the same bytes timed in this run
    sinkhorn     Sinkhorn forward and backward time: triton kernels, inductor, reference
    step         training step of the reference LM (d = 2048, 16 blocks, bf16, batch 8 x
                 1024): residual, HC, mHC, mHC + recompute, as ratios to the residual, with
                 peak memory
    decode       KV-cached greedy generation tokens/s, residual vs HC vs mHC
    inductor     the correctness check for the `inductor` ops (n = 4; last, as Inductor
                 compiles a graph per op and dtype; skipped in the dry run, where
                 tests/ops/test_inductor.py covers them)

--plan: print, without a GPU, the JSON list of the cases the check covers (PLAN), most
important first, each with its tolerance, whether the check runs it yet ("implemented") and
why the dry run skips it ("dry_run_skip").

--dry-run: tiny shapes on CPU (TRITON_INTERPRET=1 must be set before triton is imported),
so that the script is exercised by the test suite (tests/tools/test_gpu_check.py) and cannot rot.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

import torch

from torch_mhc import ops as _ops
from torch_mhc.runtime.files import atomic_write
from torch_mhc.tools.bench import decode
from torch_mhc.tools.bench.timing import time_ms
from torch_mhc.tools.bench.workloads import build_model, random_tokens, train_step
from torch_mhc.tools.errors import UsageError

SECTIONS = ("correctness", "kernels", "sinkhorn", "step", "decode", "inductor")
# Relative max error allowed (|a - e| <= tol * max|e|), as tests/ops/test_triton.py.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# Per-output tolerances of tests/ops/test_triton.py: maps of half streams 2e-3 (TF32), of fp32
# streams 2e-5; x's gradient at the streams' resolution (TOL); parameters' gradients
# max(maps tolerance, 1e-4).
MAPS_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-3}

_NO_GPU = "needs a CUDA device (CUDA graphs, the caching allocator, streams or timings)"
_TOO_BIG = "past 2^31 elements: too large for the CPU dry run"
# The cases of the full check, most important first; implemented: run by this check now.
PLAN = [
    dict(case="correctness: every op, forward and gradients, against functional.maps in fp32",
         n=[2, 3, 4, 5, 8, 12, 16], streams=["fp32", "bf16", "fp16"], params=["fp32"],
         tolerance="outputs/maps: MAPS_TOL; x grad: TOL; parameter grads: max(MAPS_TOL, 1e-4)",
         implemented=True, dry_run_skip=None),
    dict(case="determinism: each op twice, outputs and gradients bitwise equal",
         implemented=True, dry_run_skip=None),
    dict(case="correctness with bf16 parameters (a model cast whole)", params=["bf16"],
         implemented=False, dry_run_skip="bf16 is not supported by Triton's interpreter"),
    dict(case="eps > 0 (sinkhorn_eps, pre_eps) in the fused maps", implemented=False,
         dry_run_skip=None),
    dict(case="far logits inside the fused maps (alpha_res large: log domain)",
         implemented=False, dry_run_skip=None),
    dict(case="T = 75000, n = 4, C = 7168, bf16 (> 2^31 elements): last token blocks against "
              "the reference on that slice", implemented=False, dry_run_skip=_TOO_BIG),
    dict(case="outputs after filling the caching allocator with NaN", implemented=False,
         dry_run_skip=_NO_GPU),
    dict(case="torch.compile(fullgraph=True) and CUDA-graph capture of a connection's forward "
              "and backward against eager", implemented=False, dry_run_skip=_NO_GPU),
    dict(case="autocast (bf16 streams, fp32 parameters), non-contiguous inputs, a non-default "
              "stream", implemented=False, dry_run_skip=_NO_GPU),
    dict(case="kernel timings with L2 flushed and launches amortised (section kernels)",
         implemented="timings without L2 flush", dry_run_skip=None),
    dict(case="sinkhorn, training step, decode, inductor sections", implemented=True,
         dry_run_skip="inductor: compiles C++ per graph on a CPU (tests/ops/test_inductor.py)"),
]

FULL = dict(device="cuda", dtypes=(torch.float32, torch.bfloat16, torch.float16),
            ns=(2, 3, 4, 5, 8, 12, 16), tokens=257,
            channels=1000, big_tokens=8192, big_channels=(4096, 7168), kernel_n=4, repeats=20,
            sk_tokens=65536, step=dict(dim=2048, layers=16, batch=8, seq=1024, repeats=5),
            decode=dict(dim=2048, layers=16, batches=(1, 8), prompt=128, new_tokens=64),
            impls=("triton",), sk_impls=("triton", "inductor", "reference"),
            inductor=dict(impls=("inductor",), ns=(4,)))
DRY = dict(device="cpu", dtypes=(torch.float32, torch.float16), ns=(2, 4), tokens=5,
           channels=9, big_tokens=16, big_channels=(24,), kernel_n=4, repeats=2, sk_tokens=16,
           step=dict(dim=64, layers=1, batch=1, seq=8, repeats=1),
           decode=dict(dim=64, layers=1, batches=(1,), prompt=4, new_tokens=3),
           # Inductor compiles C++ on a CPU (seconds a graph): tests/ops/test_inductor.py
           # checks it there.
           impls=("triton",), sk_impls=("triton", "reference"), inductor=dict(impls=()))


# ---------------------------------------------------------------------------------------------
# Output: written after every section, atomically
# ---------------------------------------------------------------------------------------------


def write_report(report: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    atomic_write(os.path.join(out_dir, "gpu_check.json"),
                 (json.dumps(report, indent=1) + "\n").encode())
    atomic_write(os.path.join(out_dir, "gpu_check.md"), markdown(report).encode())


# ---------------------------------------------------------------------------------------------
# (a) correctness
# ---------------------------------------------------------------------------------------------


def _rel_err(a: torch.Tensor, e: torch.Tensor) -> float:
    a, e = a.detach().double().cpu(), e.detach().double().cpu()
    return float((a - e).abs().max() / e.abs().max().clamp_min(1e-30))


def _op_cases(n: int, c: int, t: int, dtype: torch.dtype, device: str, gen: torch.Generator):
    """(op name, function of the ops, inputs) per op; inputs in the streams' dtype."""
    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    m = n * n + 2 * n
    x, f = rnd(t, n, c), rnd(t, c)
    maps = [x, rnd(n * c, m, scale=(n * c) ** -0.5, dt=torch.float32),
            torch.tensor([1.0, 1.0, 2.0], device=device), rnd(n, dt=torch.float32),
            rnd(n, dt=torch.float32), rnd(n, n, dt=torch.float32)]
    h_pre, h_post = rnd(t, n, dt=torch.float32).sigmoid(), rnd(t, n, dt=torch.float32)
    h_res = rnd(t, n, n, dt=torch.float32).softmax(-1)
    far = rnd(t, n, n, scale=3.0, dt=torch.float32)
    far[::2] *= 40.0  # every other matrix spans more than LINEAR_RANGE: the log domain
    return [
        ("mhc_maps", lambda o, *a: o.mhc_maps(*a, sinkhorn_iters=20), maps),
        ("pre_aggregate", lambda o, *a: o.pre_aggregate(*a), [x, h_pre]),
        ("post_merge", lambda o, *a: o.post_merge(*a), [x, f, h_post, h_res]),
        ("sinkhorn", lambda o, a: o.sinkhorn(a, 20), [far]),
    ]


def _fwd_bwd(fn, ops, inputs, ups=None, as_fp32=False):
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


def check_correctness(cfg: dict) -> dict:
    """Every op of cfg["impls"] for cfg["dtypes"] x cfg["ns"] against the reference."""
    device, rows, impls = cfg["device"], [], cfg["impls"]
    ref = _ops.get_impl("reference")
    for impl in impls:
        ops = _ops.get_impl(impl)
        for dtype in cfg["dtypes"]:
            for n in cfg["ns"]:
                gen = torch.Generator().manual_seed(n)
                for name, fn, inputs in _op_cases(n, cfg["channels"], cfg["tokens"], dtype,
                                                  device, gen):
                    rows.append(_check_one(impl, ops, ref, name, fn, inputs, dtype, n))
    return {"rows": rows, "all_pass": all(r["pass"] for r in rows)}


def _tolerances(name: str, dtype: torch.dtype, count: int) -> list[float]:
    """Per output then per input gradient, as tests/ops/test_triton.py holds them."""
    if name != "mhc_maps":
        return [TOL[dtype]] * count
    maps = MAPS_TOL[dtype]
    return [maps] * 3 + [TOL[dtype]] + [max(maps, 1e-4)] * (count - 4)


def _check_one(impl, ops, ref, name, fn, inputs, dtype, n) -> dict:
    row = {"impl": impl, "op": name, "dtype": str(dtype).replace("torch.", ""), "n": n,
           "shape": list(inputs[0].shape)}
    try:
        out, grads, ups = _fwd_bwd(fn, ops, inputs)
        again, again_grads, _ = _fwd_bwd(fn, ops, inputs, ups)
        want_out, want_grads, _ = _fwd_bwd(fn, ref, inputs, ups, as_fp32=True)
        errs = [_rel_err(a, e) for a, e in zip(out + grads, want_out + want_grads, strict=True)]
        tols = _tolerances(name, dtype, len(errs))
        row.update(max_rel_err=max(errs), errors=errs, tols=tols, tol=min(tols),
                   worst_over_tol=max(e / t for e, t in zip(errs, tols, strict=True)),
                   finite=all(bool(torch.isfinite(t).all()) for t in out + grads),
                   deterministic=all(torch.equal(a, b) for a, b in
                                     zip(out + grads, again + again_grads, strict=True)))
        row["pass"] = row["finite"] and row["deterministic"] and row["worst_over_tol"] <= 1
    except Exception as err:  # recorded; the check goes on
        row.update(error=f"{type(err).__name__}: {err}"[:2000])
        row["pass"] = False
    return row


# ---------------------------------------------------------------------------------------------
# (b) each kernel alone: time and bandwidth against a copy of the same bytes
# ---------------------------------------------------------------------------------------------


def _real_maker(device: str, n: int):
    """Random tensors for op_args; phi [n*C, M] scaled so that logits are O(1) (linear domain)."""
    m = n * n + 2 * n
    gen = torch.Generator(device=device).manual_seed(0)

    def make(*shape, dtype=torch.float32):
        t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
        if len(shape) == 2 and shape[1] == m and shape[0] >= n:
            t /= shape[0] ** 0.5
        return t.to(dtype)

    return make


def _launch_bytes(launch) -> int:
    """Bytes a launch must move at least: each tensor argument once, phi once per token block
    that reads it (ops/triton/traffic.py, the model docs/performance.md states)."""
    from torch_mhc.ops.triton.traffic import launch_bytes

    return launch_bytes(launch)


def _copy_ms(nbytes: int, device: str, repeats: int) -> float:
    """A device-to-device copy moving nbytes (half read, half written)."""
    src = torch.empty(max(1, nbytes // 2), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src), repeats, device)


def bench_kernels(cfg: dict) -> dict:
    from torch_mhc.ops.triton import aot as triton_aot

    device, rows = cfg["device"], []
    n, t = cfg["kernel_n"], cfg["big_tokens"]
    for c in cfg["big_channels"]:
        make = _real_maker(device, n)
        for op, launch in triton_aot.op_launches(n, torch.bfloat16, t, c, 20, make):
            row = {"op": op, "kernel": launch.name, "tokens": t, "channels": c, "n": n,
                   "dtype": "bfloat16"}
            try:
                nbytes = _launch_bytes(launch)
                ms = time_ms(launch.run, cfg["repeats"], device)
                copy = _copy_ms(nbytes, device, cfg["repeats"])
                row.update(ms=ms, bytes=nbytes, gb_per_s=nbytes / ms / 1e6, copy_ms=copy,
                           fraction_of_copy=copy / ms)
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"[:2000]
            rows.append(row)
        del make
    return {"rows": rows}


# ---------------------------------------------------------------------------------------------
# (c) Sinkhorn forward and backward
# ---------------------------------------------------------------------------------------------


def bench_sinkhorn(cfg: dict) -> dict:
    device, rows, impls = cfg["device"], [], cfg["sk_impls"]
    for n in cfg["ns"]:
        gen = torch.Generator().manual_seed(n)
        logits = torch.randn(cfg["sk_tokens"], n, n, generator=gen).to(device)
        up = torch.randn(cfg["sk_tokens"], n, n, generator=gen).to(device)
        for impl in impls:
            row = {"impl": impl, "n": n, "tokens": cfg["sk_tokens"], "iters": 20}
            try:
                fn = _ops.get_impl(impl).sinkhorn
                x = logits.clone().requires_grad_()
                row["fwd_ms"] = time_ms(lambda fn=fn, x=x: fn(x.detach(), 20), cfg["repeats"],
                                        device)
                out = fn(x, 20)

                def bwd(out=out, x=x, up=up):
                    torch.autograd.grad(out, x, up, retain_graph=True)

                row["bwd_ms"] = time_ms(bwd, cfg["repeats"], device)
                row["bwd_over_fwd"] = row["bwd_ms"] / row["fwd_ms"]
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"[:2000]
            rows.append(row)
    return {"rows": rows}


# ---------------------------------------------------------------------------------------------
# (d) training step, (e) decode
# ---------------------------------------------------------------------------------------------

STEP_VARIANTS = {"residual": ("residual", {}), "hc": ("hc", {}), "mhc": ("mhc", {}),
                 "mhc+recompute": ("mhc", {"recompute": True})}


def bench_step(cfg: dict, dtype: torch.dtype) -> dict:
    device, sc = cfg["device"], cfg["step"]
    idx = random_tokens(sc["batch"], sc["seq"] + 1, device=device)
    entries = {}
    for name, (kind, fields) in STEP_VARIANTS.items():
        entry = entries[name] = {}
        try:
            model = build_model(kind, sc["dim"], sc["layers"], 4, sc["seq"], dtype=dtype,
                                device=device, **fields)
            step = train_step(model, idx)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            entry["median_ms"] = time_ms(step, sc["repeats"], device)
            if device == "cuda":
                entry["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            del model, step
        except Exception as err:
            entry["error"] = f"{type(err).__name__}: {err}"[:2000]
    base = entries["residual"].get("median_ms")
    for entry in entries.values():
        if base and "median_ms" in entry:
            entry["ratio"] = entry["median_ms"] / base
    return {"config": {**sc, "dtype": str(dtype), "streams": 4,
                       "impl": _ops.resolve_impl_name("auto", device, dtype)},
            "entries": entries}


def bench_decode(cfg: dict, dtype: torch.dtype) -> dict:
    dc = cfg["decode"]
    return decode.bench_decode(dim=dc["dim"], layers=dc["layers"], batches=dc["batches"],
                              prompt=dc["prompt"], new_tokens=dc["new_tokens"],
                              dtype=str(dtype).replace("torch.", ""), device=cfg["device"],
                              repeats=2, warmup=1)


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


def _fmt(v, spec=".3g"):
    return "" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def _table(rows: list[dict], cols: list[str]) -> list[str]:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    return lines


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# gpu_check {meta['date']}", "", f"Device: {meta['device_name']}; torch "
             f"{meta['torch']}, triton {meta['triton']}; budget {meta['budget_s']} s; "
             f"{'dry run (tiny shapes)' if meta['dry_run'] else 'full run'}.", ""]
    cols = {
        "correctness": ["impl", "op", "dtype", "n", "shape", "max_rel_err", "tol", "pass",
                        "error"],
        "inductor": ["impl", "op", "dtype", "n", "shape", "max_rel_err", "tol", "pass", "error"],
        "kernels": ["op", "kernel", "tokens", "channels", "ms", "bytes", "gb_per_s", "copy_ms",
                    "fraction_of_copy", "error"],
        "sinkhorn": ["impl", "n", "tokens", "fwd_ms", "bwd_ms", "bwd_over_fwd", "error"],
    }
    for name in SECTIONS:
        sec = report["sections"].get(name)
        lines.append(f"## {name}")
        if sec is None:
            lines += ["not run", ""]
            continue
        if "error" in sec or "skipped" in sec:
            lines += [f"{sec.get('skipped') or sec.get('error')}", ""]
            continue
        res = sec["result"]
        lines.append(f"({sec['seconds']:.1f} s)")
        if name in cols:
            lines += _table(res["rows"], cols[name])
        elif name == "step":
            rows = [{"variant": k, **v} for k, v in res["entries"].items()]
            lines += _table(rows, ["variant", "median_ms", "ratio", "peak_memory_gib", "error"])
        elif name == "decode":
            rows = [{"batch": r["batch"], "variant": k, **v} for r in res["results"]
                    for k, v in r["entries"].items()]
            lines += _table(rows, ["batch", "variant", "tokens_per_s", "tokens_per_s_ratio",
                                   "decode_tokens_per_s_ratio"])
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The run: sections under one budget, written after each
# ---------------------------------------------------------------------------------------------


def _meta(cfg: dict, budget_s: float, dry_run: bool) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = cfg["device"] == "cuda"
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "torch": torch.__version__, "triton": triton_version,
            "device_name": torch.cuda.get_device_name() if cuda else "cpu",
            "capability": list(torch.cuda.get_device_capability()) if cuda else None,
            "triton_interpret": os.environ.get("TRITON_INTERPRET"), "budget_s": budget_s,
            "dry_run": dry_run}


def run(out_dir: str, budget_s: float = 270.0, dry_run: bool = False,
        only: tuple[str, ...] = SECTIONS) -> dict:
    """Run the sections in order under the budget; the report is rewritten after each."""
    cfg = DRY if dry_run else FULL
    if not dry_run and not torch.cuda.is_available():
        raise RuntimeError("gpu_check needs a CUDA device; use --dry-run on a CPU")
    start = time.perf_counter()
    report = {"meta": _meta(cfg, budget_s, dry_run), "sections": {}}
    bf16 = torch.float32 if dry_run else torch.bfloat16
    jobs = {"correctness": lambda: check_correctness(cfg), "kernels": lambda: bench_kernels(cfg),
            "sinkhorn": lambda: bench_sinkhorn(cfg), "step": lambda: bench_step(cfg, bf16),
            "decode": lambda: bench_decode(cfg, bf16),
            # Last: Inductor compiles a graph per op, dtype and n (minutes on a first run).
            "inductor": lambda: check_correctness({**cfg, **cfg["inductor"]})}
    for name in only:
        elapsed = time.perf_counter() - start
        if elapsed > budget_s:
            report["sections"][name] = {"skipped": f"time budget spent ({elapsed:.0f} s)"}
            continue
        t0 = time.perf_counter()
        try:
            report["sections"][name] = {"result": jobs[name]()}
        except Exception as err:  # one section's failure never stops the others
            report["sections"][name] = {"error": f"{type(err).__name__}: {err}"[:4000],
                                        "traceback": traceback.format_exc()[-4000:]}
        report["sections"][name]["seconds"] = time.perf_counter() - t0
        if cfg["device"] == "cuda":
            report["sections"][name]["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.empty_cache()
        write_report(report, out_dir)
        print(f"[gpu_check] {name}: {report['sections'][name]['seconds']:.1f} s", file=sys.stderr,
              flush=True)
    report["meta"]["seconds"] = time.perf_counter() - start
    write_report(report, out_dir)
    return report


NO_CUDA = ("the GPU check needs a CUDA device and none is available here; --dry-run runs it "
           "on the CPU (tiny shapes)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="gpu_check", help="folder for gpu_check.json and .md")
    p.add_argument("--budget-s", type=float, default=270.0, help="global time budget (270 s)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (interpreter)")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"some of {','.join(SECTIONS)}")
    p.add_argument("--plan", action="store_true",
                   help="print the JSON list of cases the check covers, run nothing (no GPU)")


def check_arguments(args: argparse.Namespace) -> None:
    """args.only as a tuple of sections; UsageError naming any unknown one."""
    args.only = tuple(s for s in args.only.split(",") if s)
    unknown = [s for s in args.only if s not in SECTIONS]
    if unknown:
        raise UsageError(f"--only: unknown sections {unknown}; expected some of {SECTIONS}")


def run_command(args: argparse.Namespace) -> int:
    """Run the check; 0 all passed, 1 a section failed; UsageError without a CUDA device
    (unless --dry-run or --plan)."""
    if getattr(args, "plan", False):
        print(json.dumps(PLAN, indent=1))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        raise UsageError(NO_CUDA)
    report = run(args.out, args.budget_s, args.dry_run, args.only)
    print(markdown(report))
    failed = [n for n, sec in report["sections"].items() if "error" in sec]
    bad = any(report["sections"].get(n, {}).get("result", {}).get("all_pass") is False
              for n in ("correctness", "inductor"))
    return 1 if failed or bad else 0


if __name__ == "__main__":
    # `python -m torch_mhc.tools.bench.gpu_check`: `mhc bench --gpu` with errors as gpu_check's;
    # 0 all passed, 1 a section failed, 2 bad input (one line on stderr).
    from torch_mhc.tools.cli import run_bench_tool

    raise SystemExit(run_bench_tool("--gpu", sys.argv[1:], prog="gpu_check"))
