"""One native pass of an mHC connection, timed in one process against builds of native.c from
other commits or with other compiler flags.

    python benchmarks/bench_native_builds.py --against 5dfae25 --pass "maps backward"
    python benchmarks/bench_native_builds.py --against 5dfae25 --cflags=-mno-avx512f

Builds ops/cpu/native.c as this checkout has it and as each commit of --against had it (git
show), all with the library's flags plus --cflags (-mno-avx512f: the loops CPUs without
AVX-512 run), loads every build into this process and times the pass (op_profile's inputs:
T tokens of n = 4 streams of C floats, float32) in interleaved rounds, process CPU time.
Ratios are to the first build (this checkout), per round and paired. Prints JSON, then a
markdown table. Each build takes about a minute.
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
from torch_mhc.tools.bench.timing import summarize, time_interleaved

PASSES = ("maps forward", "merge forward", "merge backward", "maps backward")


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
    build._compile(command, [*build.FLAGS, *build.OPENMP, *build.tuning_flags(), *cflags],
                   lib, src)
    return native.NativeOps(lib)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", nargs="+", required=True, metavar="REV",
                   help="git revisions whose native.c to build beside this checkout's")
    p.add_argument("--pass", dest="name", default="maps backward", choices=PASSES)
    p.add_argument("--cflags", default="", help="flags added to every build (shell-split)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.dim < 1 or args.threads < 1 or args.repeats < 2:
        p.error("--tokens, --dim and --threads must be >= 1 and --repeats >= 2, got "
                f"{args.tokens}, {args.dim}, {args.threads}, {args.repeats}")
    torch.set_num_threads(args.threads)
    cflags = shlex.split(args.cflags)
    # every source first, so that a wrong revision is refused before a minute of building
    sources = {"this checkout": build.SOURCE.read_text(),
               **{rev: _source_at(rev) for rev in args.against}}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {name: _build(text, cflags, Path(tmp), f"build{i}")
                for i, (name, text) in enumerate(sources.items())}
        inputs = op_profile._inputs(args.tokens, 4, args.dim, torch.float32, 20)
        steps = {name: op_profile._passes(lib, inputs)[args.name] for name, lib in libs.items()}
        times = time_interleaved(steps, args.repeats, warmup=2, clock="process")
    results = summarize(times, "this checkout")
    config = {"pass": args.name, "against": args.against, "cflags": args.cflags,
              "tokens": args.tokens, "streams": 4, "dim": args.dim, "threads": args.threads,
              "repeats": args.repeats, "clock": "process"}
    print(script_report(config, results, args.json))
    print(f"\n| build ({args.name}, cflags {args.cflags or 'none'}) | median ms | min-max ms "
          "| paired ratio to this checkout (95% interval) |\n|---|---:|---:|---|")
    for name, r in results.items():
        iv = r["ratio_interval"]
        print(f"| {name} | {r['median_ms']:.3f} | {r['min_ms']:.3f}-{r['max_ms']:.3f} | "
              f"{r['ratio_paired']:.3f} ({iv[0]:.3f}-{iv[1]:.3f}) |")


if __name__ == "__main__":
    main()
