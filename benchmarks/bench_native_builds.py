"""One native pass of an mHC connection (or a connection, or the model's training step), timed
in one process against builds of native.c from other commits or with other compiler flags.

    python benchmarks/bench_native_builds.py --against 5dfae25 --pass "maps backward"
    python benchmarks/bench_native_builds.py --against 5dfae25 --cflags=-mno-avx512f

Builds ops/cpu/native.c as this checkout has it and as each commit of --against had it (git
show), all with the library's flags plus --cflags (-mno-avx512f: the loops CPUs without
AVX-512 run), loads every build into this process and times the pass (op_profile's inputs:
T tokens of n = 4 streams of C floats, float32) in interleaved rounds, process CPU time
(--clock wall: wall time, for two threads on a machine shared with other jobs).
Ratios are to the first build (this checkout), per round and paired. Prints JSON, then a
markdown table. Each build takes about a minute.

`--pass step` times what a kernel change does to a model instead: the training step of `mhc
bench --only step`'s mHC model (pre-norm attention + MLP blocks, --layers, batch 8 x 256
tokens, width --dim), the same model object with each build's library in turn (the library
native.load() returns is swapped before each run), in interleaved rounds with --clock. Host
noise that moves whole rounds cancels in the paired ratio, which runs of `mhc bench` one after
the other cannot give.

    python benchmarks/bench_native_builds.py --against 49cfb2d --pass step --threads 2 \
        --clock wall --repeats 20

`--with-cflags FLAGS` (repeatable) adds a build of this checkout's native.c with FLAGS added
to the others', so that one source is timed against itself under other flags; a define it
names (-DTORCH_MHC_SKINNY_W=8) takes the place of the library's define of that name:

    python benchmarks/bench_native_builds.py --with-cflags=-DTORCH_MHC_SKINNY_W=8 \
        --pass "maps forward"

`--pass connection` times the connection ops of --kind (mhc or hc: HC's backward is a pass
of its own) forward and backward through autograd, T tokens of n = 4 streams around an
identity branch (`tools/bench/workloads.connection_step`, what `mhc bench --ops` times), with
each build's library in turn.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from torch_mhc.ops.cpu import build, native
from torch_mhc.tools.bench import op_profile
from torch_mhc.tools.bench.report import script_report
from torch_mhc.tools.bench.timing import CLOCKS, summarize, time_interleaved
from torch_mhc.tools.bench.workloads import (
    build_model,
    connection_step,
    random_tokens,
    train_step,
)

PASSES = ("maps forward", "merge forward", "merge backward", "maps backward")
STEP = "step"  # --pass step: the model's training step
CONNECTION = "connection"  # --pass connection: one connection's forward and backward


def _source_at(rev: str) -> str:
    repo = Path(__file__).resolve().parents[1]
    path = build.SOURCE.relative_to(repo).as_posix()
    proc = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=repo, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"--against {rev!r}: git show found no {path} there "
                         f"({proc.stderr.strip()})")
    return proc.stdout


def _build(source: str, cflags: list[str], out_dir: Path, name: str) -> native.NativeOps:
    command = build._compiler()
    if command is None:
        raise SystemExit("no C compiler (cc, gcc or clang on PATH, or set CC)")
    src = out_dir / f"{name}.c"
    src.write_text(source)
    lib = out_dir / f"{name}.so"
    print(f"building {name} ...", file=sys.stderr, flush=True)
    build._compile(command, build.library_flags(cflags=cflags), lib, src)
    return native.NativeOps(lib)


def _with_library(lib: native.NativeOps, run):
    """run() with lib as the library native.load() returns (the ops call it at every pass)."""
    def step():
        native._loaded, native._tried = lib, True
        run()
    return step


def _model_steps(libs: dict, dim: int, layers: int) -> dict:
    """name -> one training step of the mHC benchmark model with that build's library."""
    model = build_model("mhc", dim, layers)
    run = train_step(model, random_tokens(8, 256 + 1), impl="auto")  # as mhc bench runs it
    return {name: _with_library(lib, run) for name, lib in libs.items()}


def _connection_steps(libs: dict, kind: str, tokens: int, dim: int) -> dict:
    """name -> forward and backward of kind's connection ops (what `mhc bench --ops` times)
    with that build's library."""
    run = connection_step("cpu", tokens, 4, dim, torch.float32, "cpu", kind)
    return {name: _with_library(lib, run) for name, lib in libs.items()}


def _time_restoring(make_steps, repeats: int, clock: str) -> dict:
    """time_interleaved of make_steps(), then the library native.load() returned before."""
    shipped = native._loaded, native._tried
    try:
        return time_interleaved(make_steps(), repeats, warmup=2, clock=clock)
    finally:
        native._loaded, native._tried = shipped


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", nargs="+", default=[], metavar="REV",
                   help="git revisions whose native.c to build beside this checkout's")
    p.add_argument("--with-cflags", action="append", default=[], metavar="FLAGS",
                   help="also build this checkout's native.c with FLAGS added (repeatable)")
    p.add_argument("--pass", dest="name", default="maps backward",
                   choices=(*PASSES, STEP, CONNECTION))
    p.add_argument("--kind", choices=("mhc", "hc"), default="mhc",
                   help="--pass connection: the connection timed")
    p.add_argument("--cflags", default="", help="flags added to every build (shell-split)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--layers", type=int, default=8, help="--pass step: the model's blocks")
    p.add_argument("--clock", choices=CLOCKS, default="process",
                   help="process CPU time (one thread) or wall time (two threads share it)")
    p.add_argument("--json", help="also write the JSON here")
    args = p.parse_args(argv)
    if not args.against and not args.with_cflags:
        p.error("nothing to time this checkout against: give --against REV or --with-cflags "
                "FLAGS")
    if min(args.tokens, args.dim, args.threads, args.layers) < 1 or args.repeats < 2:
        p.error("--tokens, --dim, --threads and --layers must be >= 1 and --repeats >= 2, "
                f"got {args.tokens}, {args.dim}, {args.threads}, {args.layers}, "
                f"{args.repeats}")
    torch.set_num_threads(args.threads)
    cflags = shlex.split(args.cflags)
    # every source first, so that a wrong revision is refused before a minute of building
    here = build.SOURCE.read_text()
    sources = {"this checkout": (here, cflags),
               **{rev: (_source_at(rev), cflags) for rev in args.against},
               **{f"this checkout, {extra}": (here, [*cflags, *shlex.split(extra)])
                  for extra in args.with_cflags}}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {name: _build(text, flags, Path(tmp), f"build{i}")
                for i, (name, (text, flags)) in enumerate(sources.items())}
        if args.name == STEP:
            times = _time_restoring(lambda: _model_steps(libs, args.dim, args.layers),
                                    args.repeats, args.clock)
        elif args.name == CONNECTION:
            times = _time_restoring(
                lambda: _connection_steps(libs, args.kind, args.tokens, args.dim),
                args.repeats, args.clock)
        else:
            inputs = op_profile._inputs(args.tokens, 4, args.dim, torch.float32, 20)
            steps = {name: op_profile._passes(lib, inputs)[args.name]
                     for name, lib in libs.items()}
            times = time_interleaved(steps, args.repeats, warmup=2, clock=args.clock)
    results = summarize(times, "this checkout")
    shape = ({"layers": args.layers, "batch": 8, "seq": 256} if args.name == STEP
             else {"tokens": args.tokens})
    if args.name == CONNECTION:
        shape["kind"] = args.kind
    config = {"pass": args.name, "against": args.against, "cflags": args.cflags,
              "with_cflags": args.with_cflags, **shape,
              "streams": 4, "dim": args.dim, "threads": args.threads,
              "repeats": args.repeats, "clock": args.clock}
    print(script_report(config, results, args.json))
    print("\n" + _table(results, f"{args.name}, cflags {args.cflags or 'none'}"))


def _table(results: dict, label: str) -> str:
    """The builds' times and paired ratios as a markdown table, each interval with its
    coverage (below 95% under 6 rounds)."""
    rows = [f"| build ({label}) | median ms | min-max ms | paired ratio to this checkout "
            "(interval, coverage) |", "|---|---:|---:|---|"]
    for name, r in results.items():
        low, high, coverage = r["ratio_interval"]
        rows.append(f"| {name} | {r['median_ms']:.3f} | {r['min_ms']:.3f}-{r['max_ms']:.3f} | "
                    f"{r['ratio_paired']:.3f} ({low:.3f}-{high:.3f}, {coverage:.0%}) |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
