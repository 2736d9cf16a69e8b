"""Training step of every connection kind, and the cost of measuring connection health.

Times, side by side in one process (tools.bench.timing.time_interleaved), one training step
(forward, cross-entropy, backward) of the reference LM with each connection kind, as a ratio
to the residual model's step; then, on the mHC model, one Amax-gain measurement
(collect_gains) against one connection-health measurement (collect_health) on the same
batch, as a ratio to the gains. Prints JSON, then a markdown table.

    python benchmarks/bench_variants.py                      # nanoGPT-CPU size (shakespeare)
    python benchmarks/bench_variants.py --dim 256 --layers 6 --seq 128 --batch 8 --repeats 20

--successors instead times mHC's successors beside mHC at the step benchmark's defaults (8
blocks, batch 8 x 256, n = 4; tools.bench.step) at each --sizes width, as ratios to mHC:

    python benchmarks/bench_variants.py --successors --sizes 256,512 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from torch_mhc.connections import CONNECTION_KINDS
from torch_mhc.connections.successors import VARIANT_KINDS
from torch_mhc.lm.model import LM, ModelConfig
from torch_mhc.runtime.diagnostics import collect_gains, collect_health
from torch_mhc.tools.bench.step import bench_training_steps
from torch_mhc.tools.bench.timing import CLOCKS, summarize, time_interleaved
from torch_mhc.tools.bench.workloads import random_tokens, train_step


def _model(kind: str, args) -> LM:
    torch.manual_seed(0)
    return LM(ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                          max_seq_len=args.seq, connection=kind, streams=args.streams))


def bench_steps(args) -> dict:
    idx = random_tokens(args.batch, args.seq + 1)
    steps = {kind: train_step(_model(kind, args), idx) for kind in args.kinds}
    times = time_interleaved(steps, args.repeats, args.warmup, args.clock)
    return summarize(times, "residual")


def bench_health(args) -> dict:
    model = _model("mhc", args).eval()
    idx = random_tokens(args.gain_batch, args.seq)

    @torch.no_grad()
    def measure(collect):
        with collect() as collector:
            model(idx)
        collector.report()

    steps = {"gains": lambda: measure(collect_gains), "health": lambda: measure(collect_health),
             "forward": lambda: torch.no_grad()(model)(idx)}
    times = time_interleaved(steps, args.repeats, args.warmup, args.clock)
    return summarize(times, "gains")


def markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [f"Training step, {cfg['layers']} blocks of width {cfg['dim']}, batch "
             f"{cfg['batch']} x {cfg['seq']}, n = {cfg['streams']}, fp32, {cfg['threads']} "
             f"thread(s), {cfg['clock']} clock, median of {cfg['repeats']} rounds:", "",
             "| kind | median ms | x residual | per-round ratio range |", "|---|---:|---:|---:|"]
    for kind, e in result["steps"].items():
        lines.append(f"| {kind} | {e['median_ms']:.1f} | {e['ratio']:.2f} | "
                     f"{e['ratio_min']:.2f}-{e['ratio_max']:.2f} |")
    lines += ["", f"Measurement on the mHC model, batch {cfg['gain_batch']} x {cfg['seq']}:", "",
              "| measurement | median ms | x gains |", "|---|---:|---:|"]
    for name, e in result["health"].items():
        lines.append(f"| {name} | {e['median_ms']:.1f} | {e['ratio']:.2f} |")
    return "\n".join(lines)


def bench_successors(args) -> dict:
    """Training step of residual, mHC and each successor per width; ratios to mHC's step."""
    steps = bench_training_steps(args.sizes, ["mhc", *VARIANT_KINDS], streams=args.streams,
                                 repeats=args.repeats, warmup=args.warmup, clock=args.clock)
    for res in steps["results"]:
        times = {v: e["runs_ms"] for v, e in res["entries"].items()}
        res["entries"] = summarize(times, "mhc")
    return steps


def markdown_successors(result: dict) -> str:
    cfg = result["config"]
    lines = [f"Training step, {cfg['layers']} blocks, batch {cfg['batch']} x {cfg['seq']}, "
             f"n = {cfg['streams']}, {cfg['dtype']}, {result['threads']} thread(s), "
             f"{cfg['clock']} clock, impl {cfg['impl']}:", "",
             "| d | kind | median ms | x mHC | per-round ratio range |",
             "|---:|---|---:|---:|---:|"]
    for res in result["results"]:
        for kind, e in res["entries"].items():
            lines.append(f"| {res['dim']} | {kind} | {e['median_ms']:.1f} | {e['ratio']:.3f} | "
                         f"{e['ratio_min']:.3f}-{e['ratio_max']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--gain-batch", type=int, default=4)
    p.add_argument("--kinds", default=",".join(CONNECTION_KINDS))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=CLOCKS, default="wall")
    p.add_argument("--successors", action="store_true",
                   help="time mHC's successors beside mHC at the step benchmark's defaults")
    p.add_argument("--sizes", default="256,512", help="--successors: widths d")
    args = p.parse_args(argv)
    if args.successors:
        torch.set_num_threads(args.threads)
        args.sizes = [int(s) for s in args.sizes.split(",")]
        result = bench_successors(args) | {"threads": args.threads,
                                           "torch": torch.__version__}
        print(json.dumps(result, indent=1))
        print(markdown_successors(result))
        return 0
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if "residual" not in args.kinds:
        args.kinds.insert(0, "residual")
    torch.set_num_threads(args.threads)
    result = {
        "config": {k: v for k, v in vars(args).items()} | {
            "torch": torch.__version__, "platform": platform.platform()},
        "steps": bench_steps(args),
        "health": bench_health(args),
    }
    print(json.dumps(result, indent=1))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
