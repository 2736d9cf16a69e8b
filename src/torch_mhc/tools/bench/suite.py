"""The benchmark suite behind `mhc bench`: what residual, HC and mHC cost in time and memory.

    mhc bench                                     # every benchmark at the default sizes
    mhc bench --only step,saved --sizes 256,512 --threads 1 --clock process --json out.json
    mhc bench --quick                             # tiny sizes, seconds: a smoke test
    mhc bench --gpu | --aot | --ops ...           # the GPU check, AOT check, op benchmark
    python -m torch_mhc.tools.bench.suite ...     # the same as mhc bench

Benchmarks (choose with --only, comma-separated; the default runs all five):

    step               one training step of the reference LM (torch_mhc.lm.model): forward,
                       cross-entropy and backward; the optimizer is excluded unless
                       --optimizer (AdamW). Residual vs HC vs mHC at each --sizes width,
                       as ratios to the residual.
    hyper_connections  the same block stack wrapped by lucidrains' `hyper-connections` mHC
                       (an optional dependency: pip install -e '.[bench]' in the torch-mhc
                       checkout), against our mHC and the residual, at each --sizes width.
                       When `step` runs too, both share one interleaved measurement per width.
    saved              bytes saved for backward per token per connection (all of the LM's
                       saved activations divided by its 2L connections), residual vs HC vs
                       mHC, without and with selective recomputation, as ratios to the
                       residual. Counted with saved_tensors_hooks: deterministic, no timing.
    sinkhorn           functional.sinkhorn forward + backward (saves the logits, recomputes
                       its iterates) against autograd through the unrolled loop, and the ops'
                       cpu Sinkhorn: time and bytes saved for backward.
    decode             tokens/s of KV-cached greedy generation (LM.generate), residual vs HC
                       vs mHC, per batch size.

Timing. The variants of one comparison live in one process and run round-robin (one run of
each, then the next round), so a change in the machine's load hits all of them alike. A
figure is the median over rounds, with the min and max as its spread; a ratio is a median
over the baseline's median, and the ratios within each round give its range. `--clock
process` counts this process's CPU time (all threads together) instead of wall time: on a
machine shared with other jobs it does not count time spent waiting for a core, and with
`--threads 1` it is the single-thread cost.

Output: JSON (on stdout, or written atomically to --json PATH) and a markdown table per
benchmark on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from torch_mhc import ops as _ops
from torch_mhc.tools.bench import workloads
from torch_mhc.tools.bench.decode import bench_decode
from torch_mhc.tools.bench.report import (
    check_json_path,
    load_average,
    markdown,
    run_meta,
    write_json_atomic,
)
from torch_mhc.tools.bench.saved import bench_saved
from torch_mhc.tools.bench.sinkhorn import bench_sinkhorn
from torch_mhc.tools.bench.step import bench_training_steps, select_variants
from torch_mhc.tools.bench.timing import CLOCKS
from torch_mhc.tools.bench.workloads import DTYPES, lm_config, log
from torch_mhc.tools.boundary import positive_int
from torch_mhc.tools.errors import UsageError

# `mhc bench`'s command line and the run of its benchmarks; each benchmark lives in its own
# module (step, saved, sinkhorn, decode), the shared models and steps in workloads.
__all__ = [
    "BENCHMARKS",
    "SUCCESSORS",
    "DESCRIPTION",
    "EPILOG",
    "add_arguments",
    "check_arguments",
    "run_benchmarks",
    "run_command",
]

BENCHMARKS = ("step", "hyper_connections", "saved", "sinkhorn", "decode")
SUCCESSORS = ("mhc-lite", "kromhc", "mhc-static-res")  # the step's --successors variants

# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 256,512, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _names(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in BENCHMARKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown benchmark(s) {unknown or text!r}; expected a comma-separated subset of "
            f"{','.join(BENCHMARKS)}"
        )
    return names


DESCRIPTION = "Time and memory of residual, HC and mHC: JSON and markdown tables."
EPILOG = ("Benchmarks: step, hyper_connections, saved, sinkhorn, decode (see "
          "torch_mhc.tools.bench.suite's docstring). Sizes not given take the defaults "
          "listed above, or tiny ones with --quick.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The suite's options; --gpu, --aot and --ops hand the rest of the command line to the GPU
    check, the AOT compile check or the op benchmark (the `mhc` command switches on them)."""
    p.add_argument("--only", type=_names, default=list(BENCHMARKS),
                   help=f"comma-separated benchmarks to run (default: {','.join(BENCHMARKS)})")
    p.add_argument("--sizes", type=_int_list, default=None,
                   help="widths d for step and hyper_connections (default 256,512,1024)")
    p.add_argument("--dim", type=positive_int, default=None,
                   help="width for saved and decode (default 512)")
    p.add_argument("--layers", type=positive_int, default=None, help="blocks (default 8)")
    p.add_argument("--streams", type=positive_int, default=4, help="n (default 4)")
    p.add_argument("--batch", type=positive_int, default=None, help="step batch (default 8)")
    p.add_argument("--seq", type=positive_int, default=None,
                   help="step tokens per row (default 256)")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="timed rounds for every timed benchmark (default: step 5, or 3 above "
                        "d = 512; sinkhorn 30; decode 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch.set_num_threads (default: torch's own choice)")
    p.add_argument("--clock", choices=CLOCKS, default="wall",
                   help="wall time, or this process's CPU time (steadier on a shared machine; "
                        "default wall)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="default float32")
    p.add_argument("--device", default="cpu", help="default cpu")
    p.add_argument("--impl", default="auto",
                   help="op implementation for HC and mHC: auto, reference, cpu, triton, inductor "
                        "(default auto)")
    p.add_argument("--optimizer", action="store_true",
                   help="step: include an AdamW step in the timed training step")
    p.add_argument("--sinkhorn-tokens", type=positive_int, default=None,
                   help="matrices per Sinkhorn call (default 2048 = 8 x 256)")
    p.add_argument("--sinkhorn-n", type=_int_list, default=[4, 8],
                   help="streams n of the Sinkhorn benchmark (default 4,8)")
    p.add_argument("--decode-batches", type=_int_list, default=None,
                   help="decode batch sizes (default 1,8)")
    p.add_argument("--prompt", type=positive_int, default=None,
                   help="decode prompt tokens (default 128)")
    p.add_argument("--new-tokens", type=positive_int, default=None,
                   help="decode new tokens (default 128)")
    p.add_argument("--decode-builds", type=positive_int, default=None,
                   help="decode: build the models this many times, in rotated order, and pool "
                        "the rounds (default 2; where weights land moves decoding speed)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write the JSON here (atomically) instead of to stdout")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes and 2 rounds: every benchmark in seconds (a smoke test)")
    p.add_argument("--successors", action="store_true",
                   help="also time mHC's successors (mhc-lite, kromhc, mhc-static-res) in the "
                        "step and decode benchmarks, beside mHC")
    p.add_argument("--inductor", action="store_true",
                   help="also time the inductor ops (reference under torch.compile): a "
                        "<kind>_inductor step variant for every kind timed (hc, mhc, and the "
                        "successors with --successors, whose maps there are the eager "
                        "reference around compiled aggregation and merge) and an "
                        "ops.inductor Sinkhorn entry")
    p.add_argument("--gpu", action="store_true",
                   help="run benchmarks/gpu_check.py instead (its own options follow; "
                        "mhc bench --gpu --help)")
    p.add_argument("--aot", action="store_true",
                   help="run the Triton ahead-of-time compile check instead (its own options "
                        "follow; mhc bench --aot --help)")
    p.add_argument("--ops", action="store_true",
                   help="run the per-op benchmark (connection ops per implementation against "
                        "x + f) instead (its own options follow; mhc bench --ops --help)")


# (full, --quick) defaults for the options left unset
_DEFAULTS = {
    "sizes": ([256, 512, 1024], [32]),
    "dim": (512, 32),
    "layers": (8, 2),
    "batch": (8, 2),
    "seq": (256, 16),
    "sinkhorn_tokens": (2048, 64),
    "decode_batches": ([1, 8], [1, 2]),
    "prompt": (128, 8),
    "new_tokens": (128, 8),
    "decode_builds": (2, 1),
}


def check_arguments(args: argparse.Namespace) -> None:
    """Fill the sizes left unset (full or --quick) and check every input before any benchmark
    runs; UsageError (or ValueError from the model config) on bad input."""
    for name, (full, quick) in _DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.quick and args.repeats is None:
        args.repeats = 2
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    _check_device(args.device)
    _ops.check_runs_on(args.impl, args.device, DTYPES[args.dtype])
    if args.json is not None:
        check_json_path(args.json)
    if args.streams < 2:
        raise UsageError(f"--streams must be >= 2 for HC and mHC, got {args.streams}")
    # Every model the run will build, checked now rather than after minutes of timing.
    for dim in {*args.sizes, args.dim}:
        lm_config("mhc", dim, args.layers, args.streams, max(args.seq, args.prompt +
                                                              args.new_tokens))


def _check_device(name: str) -> None:
    """A device this machine has, checked before any benchmark runs."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise UsageError(f"--device must be cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name} asked for, but CUDA is not available here")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"--device {name} asked for, but there are "
                          f"{torch.cuda.device_count()} GPUs")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu, cuda or cuda:N, got {name!r}")


def _meta(args: argparse.Namespace, argv: list[str]) -> dict:
    return {**run_meta(), "command": "mhc bench " + " ".join(argv), "clock": args.clock,
            "quick": args.quick}


def run_benchmarks(args: argparse.Namespace) -> dict:
    """The selected benchmarks' results, keyed by benchmark name."""
    only = set(args.only)
    out: dict[str, dict] = {}
    timing = {"warmup": args.warmup, "clock": args.clock, "device": args.device}
    want_step, want_hc = "step" in only, "hyper_connections" in only
    if want_hc and workloads.hyper_connections_version() is None:
        msg = ("lucidrains' hyper-connections package is not installed "
               "(pip install -e '.[bench]' in the torch-mhc checkout)")
        log(f"hyper_connections skipped: {msg}")
        out["hyper_connections"] = {"skipped": msg}
        want_hc = False
    if want_step or want_hc:
        # One interleaved measurement per width serves both: the residual and our mHC are
        # timed once, beside every variant either benchmark needs.
        variants = ["residual"] + (["hc"] if want_step else []) + ["mhc"]
        variants += ["lucidrains_mhc"] if want_hc else []
        variants += list(SUCCESSORS) if args.successors and want_step else []
        kinds = [v for v in variants if v not in ("residual", "lucidrains_mhc")]
        inductor = [f"{k}_inductor" for k in kinds] if args.inductor and want_step else []
        variants += inductor
        steps = bench_training_steps(
            args.sizes, variants, layers=args.layers, streams=args.streams, batch=args.batch,
            seq=args.seq, dtype=args.dtype, impl=args.impl, optimizer=args.optimizer,
            repeats=args.repeats, **timing,
        )
        if want_step:
            out["step"] = select_variants(steps, ["residual", "hc", "mhc", *SUCCESSORS,
                                                  *inductor])
        if want_hc:
            out["hyper_connections"] = select_variants(steps, ["residual", "mhc", "lucidrains_mhc"])
            out["hyper_connections"]["config"]["hyper_connections_version"] = (
                workloads.hyper_connections_version()
            )
            out["hyper_connections"]["config"]["wrapper"] = (
                f"hyper_connections.mHC(num_residual_streams={args.streams}, dim=d, "
                "branch=..., layer_index=...)"
            )
    if "saved" in only:
        out["saved"] = bench_saved(dim=args.dim, layers=args.layers, streams=args.streams,
                                   seqs=(8, 16) if args.quick else (32, 64), dtype=args.dtype,
                                   device=args.device, impl=args.impl)
    if "sinkhorn" in only:
        out["sinkhorn"] = bench_sinkhorn(tokens=args.sinkhorn_tokens, sizes=tuple(args.sinkhorn_n),
                                         repeats=args.repeats or 30, inductor=args.inductor,
                                         **timing)
    if "decode" in only:
        out["decode"] = bench_decode(
            dim=args.dim, layers=args.layers, streams=args.streams,
            batches=tuple(args.decode_batches), prompt=args.prompt, new_tokens=args.new_tokens,
            dtype=args.dtype, impl=args.impl, repeats=args.repeats or 3,
            builds=args.decode_builds,
            variants=("residual", "hc", "mhc", *(SUCCESSORS if args.successors else ())),
            **timing,
        )
    # Keep the order of BENCHMARKS in the report.
    return {name: out[name] for name in BENCHMARKS if name in out}


def run_command(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the benchmarks; print the JSON (or write --json) and the markdown. argv: the
    command line after `mhc bench`, recorded in the report."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    report = {"meta": _meta(args, argv), "benchmarks": {}}
    report["benchmarks"] = run_benchmarks(args)
    report["meta"]["load_average_end"] = load_average()
    if args.json:
        write_json_atomic(args.json, report)
        log(f"wrote {args.json}")
    else:
        print(json.dumps(report, indent=2))
    print(markdown(report))
    return 0


if __name__ == "__main__":  # the same as `mhc bench`
    from torch_mhc.tools.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
