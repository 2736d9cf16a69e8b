"""One command for the first GPU: are the kernels right, how fast, what does mHC cost?

    mhc bench --gpu --out gpu_check        # or: python benchmarks/gpu_check.py --out ...
    TRITON_INTERPRET=1 mhc bench --gpu --dry-run --out /tmp/gc   # CPU, tiny shapes

Sections, most important first, each in its own try/except and each case of a section in its
own (an error is recorded in its row and the next case runs), under one global time budget
(--budget-s, default 270 s; a section or case that would start after it is recorded as
skipped with the reason), results written after every section (JSON and markdown, each
written to a temporary file and renamed). Every check holds each output and gradient to the
tolerance tests/ops/test_triton.py holds it to (checks.py), against functional.maps run in
float32 on the same device from the same rounded inputs, with random upstream gradients, and
runs the op twice (bitwise determinism):

    correctness  every op of the `triton` implementation: fp32 and bf16 streams, n = 2, 3,
                 4, 8, an awkward C, far-apart Sinkhorn logits included (the other streams
                 counts and fp16 in correctness_rest, after the other cases)
    large        T = 75000, n = 4, C = 7168, bf16 (past 2^31 elements): every op forward and
                 backward on the whole tensors, the first and last token slices against the
                 reference run on those slices only, every output checked finite; in a
                 process of its own (an illegal address there cannot stop what follows)
    nan_fill     every op after the caching allocator was filled with NaN blocks and freed
                 (memory an op allocates and leaves unwritten reads as NaN)
    params       the maps of a model cast whole to bf16: streams and parameters in bf16
    compile      an mHC connection on the triton ops, torch.compile(fullgraph=True) and a
                 CUDA graph of its forward and backward, against it run eagerly
    contexts     every op under autocast (bf16 streams, fp32 parameters), on non-contiguous
                 inputs (strided, transposed, expanded views) and on a non-default stream
    eps          sinkhorn_eps, pre_eps and norm_eps > 0 in the fused maps and the Sinkhorn op
    far_logits   alpha_res large: the fused maps' Sinkhorn in the log domain, for every token
                 and for about half the tokens of a block
    correctness_rest  as correctness for the other pairs: fp16 streams at every n, fp32
                 and bf16 at n = 5, 12, 16
    kernels      each Triton kernel launch alone (the ops' own plans) at T = 8192 tokens,
                 C = 4096 and 7168, bf16, n = 4: time with L2 flushed and launches amortised
                 (perf.py names the method of each figure), bytes it must move, bandwidth as a
                 fraction of a device-to-device copy of the same bytes timed the same way
    step         training step of the reference LM (d = 2048, 16 blocks, bf16, batch 8 x
                 1024): residual, HC, mHC, mHC + recompute, as ratios to the residual, with
                 peak memory
    decode       KV-cached greedy generation tokens/s, residual vs HC vs mHC; the prepared
                 decoding path against the ops' path (ran, same bits), per kind and batch;
                 one mHC connection's call on one token without autograd (triton, its ops
                 path triton/ops, reference): its time, the host time per op and the
                 kernels' device time
    sinkhorn     Sinkhorn forward and backward time: triton kernels, inductor, reference
    inductor     the correctness check for the `inductor` ops (n = 4; last, as Inductor
                 compiles a graph per op and dtype; skipped in the dry run, where
                 tests/ops/test_inductor.py covers them)

--plan: print, without a GPU, the JSON list of the cases the check covers (PLAN), most
important first, each with its tolerance, its section, whether the check runs it yet
("implemented") and what the dry run leaves out ("dry_run_skip").

--dry-run: tiny shapes on CPU (TRITON_INTERPRET=1 must be set before triton is imported),
so that the script is exercised by the test suite (tests/tools/test_gpu_check.py) and cannot
rot. It runs every case a CPU can: the large case at a tiny shape, fp16 where the full run
has bf16 (the interpreter has no bf16), torch.compile with aot_eager; the CUDA graph and the
non-default stream are recorded as skipped.

Compile options: the Triton launches pass enable_fp_fusion explicitly (ops/triton/ops.py,
Launch), and so do Inductor's kernels (the inductor ops, torch.compile), so
TRITON_DEFAULT_FP_FUSION, whose default changes in Triton 3.10, changes nothing this check
measures and is not set here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch

from torch_mhc.tools.bench.gpu_check.cases import (
    check_correctness,
    check_eps,
    check_far_logits,
    check_large,
    check_nan_fill,
    check_params,
)
from torch_mhc.tools.bench.gpu_check.checks import MAPS_TOL, TOL
from torch_mhc.tools.bench.gpu_check.config import DRY, FULL, PLAN, SECTIONS
from torch_mhc.tools.bench.gpu_check.contexts import check_compile, check_contexts
from torch_mhc.tools.bench.gpu_check.perf import (
    bench_decode,
    bench_kernels,
    bench_sinkhorn,
    bench_step,
)
from torch_mhc.tools.bench.gpu_check.report import markdown, write_report
from torch_mhc.tools.errors import UsageError

__all__ = ["DRY", "FULL", "MAPS_TOL", "NO_CUDA", "PLAN", "SECTIONS", "TOL", "add_arguments",
           "bench_decode", "bench_kernels", "bench_sinkhorn", "bench_step", "check_arguments",
           "check_compile", "check_contexts", "check_correctness", "check_eps",
           "check_far_logits", "check_large", "check_nan_fill", "check_params", "markdown",
           "run", "run_command", "write_report"]


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


def _jobs(cfg: dict, bf16: torch.dtype) -> dict:
    """Each section's function (looked up when it runs, so that a test can replace one)."""
    return {
        "correctness": lambda: check_correctness(cfg, cfg["combos"]["first"]),
        "large": lambda: check_large(cfg),
        "nan_fill": lambda: check_nan_fill(cfg), "params": lambda: check_params(cfg),
        "compile": lambda: check_compile(cfg), "contexts": lambda: check_contexts(cfg),
        "eps": lambda: check_eps(cfg), "far_logits": lambda: check_far_logits(cfg),
        "correctness_rest": lambda: check_correctness(cfg, cfg["combos"]["rest"]),
        "kernels": lambda: bench_kernels(cfg), "sinkhorn": lambda: bench_sinkhorn(cfg),
        "step": lambda: bench_step(cfg, bf16), "decode": lambda: bench_decode(cfg, bf16),
        # Last: Inductor compiles a graph per op, dtype and n (minutes on a first run).
        "inductor": lambda: check_correctness({**cfg, **cfg["inductor"]}),
    }


# Set in the process that runs an isolated section (so that it runs the section itself).
CHILD_ENV = "TORCH_MHC_GPU_CHECK_CHILD"


def _in_child(name: str, budget_s: float, dry_run: bool) -> dict:
    """Section `name` run by this check in a new process, its section of the report read
    back: an illegal memory access leaves the CUDA context unusable, and the sections after
    it must still run."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch_mhc.tools.bench.gpu_check", "--only", name,
               "--out", tmp, "--budget-s", f"{max(budget_s, 1.0):.0f}"]
        proc = subprocess.run(cmd + (["--dry-run"] if dry_run else []), capture_output=True,
                              text=True, env={**os.environ, CHILD_ENV: "1"},
                              timeout=max(budget_s, 60.0) + 300)
        path, sec = os.path.join(tmp, "gpu_check.json"), None
        if os.path.exists(path):
            with open(path) as f:
                sec = json.load(f)["sections"].get(name)
    if sec is None or ("result" not in sec and "error" not in sec):
        return {"error": f"the process running {name} exited with {proc.returncode} "
                         f"without its result: {(proc.stdout + proc.stderr)[-3000:]}"}
    return {**sec, "process": "own (isolated)"}


def run(out_dir: str, budget_s: float = 270.0, dry_run: bool = False,
        only: tuple[str, ...] = SECTIONS) -> dict:
    """Run the sections in order under the budget; the report is rewritten after each."""
    if not dry_run and not torch.cuda.is_available():
        raise RuntimeError("gpu_check needs a CUDA device; use --dry-run on a CPU")
    start = time.perf_counter()
    cfg = {**(DRY if dry_run else FULL), "deadline": start + budget_s}
    report = {"meta": _meta(cfg, budget_s, dry_run), "sections": {}}
    jobs = _jobs(cfg, torch.float32 if dry_run else torch.bfloat16)
    for name in only:
        elapsed = time.perf_counter() - start
        if elapsed > budget_s:
            report["sections"][name] = {"skipped": f"time budget spent ({elapsed:.0f} s)"}
            continue
        t0 = time.perf_counter()
        try:
            if name in cfg["isolated"] and not os.environ.get(CHILD_ENV):
                report["sections"][name] = _in_child(name, budget_s - elapsed, dry_run)
            else:
                report["sections"][name] = {"result": jobs[name]()}
        except Exception as err:  # one section's failure never stops the others
            report["sections"][name] = {"error": f"{type(err).__name__}: {err}"[:4000],
                                        "traceback": traceback.format_exc()[-4000:]}
        report["sections"][name]["seconds"] = time.perf_counter() - t0
        if cfg["device"] == "cuda":
            report["sections"][name].setdefault("peak_memory_gib",
                                                torch.cuda.max_memory_allocated() / 2**30)
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


def failed_sections(report: dict) -> list[str]:
    """Sections that raised, or whose checks did not all pass."""
    return [name for name, sec in report["sections"].items()
            if "error" in sec or sec.get("result", {}).get("all_pass") is False]


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
    return 1 if failed_sections(report) else 0
