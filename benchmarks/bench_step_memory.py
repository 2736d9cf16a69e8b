"""Resident memory across training steps: residual, mHC and mHC with recomputation.

Each variant runs in a process of its own (the reference LM, float32, one thread, the ops
of --impl) for --steps steps; after every step's forward, backward and the dropping of its
gradients the script reads the process's resident set (Linux /proc/self/statm), and at the
end its peak (ru_maxrss). Large allocations are served by mmap (MALLOC_MMAP_THRESHOLD_ set
for the children), so a tensor freed is memory returned: what a step leaves behind shows as
growth from step to step.

    python benchmarks/bench_step_memory.py --steps 4
    python benchmarks/bench_step_memory.py --impl cpu --dim 512 --layers 8

This is how recomputation's leak was found and its fix checked (benchmarks/README.md):
its replays kept every replayed tensor alive, about two thirds of a GiB a step at these
settings.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

import torch

VARIANTS = {"residual": ("residual", {}), "mhc": ("mhc", {}),
            "mhc+recompute": ("mhc", {"recompute": True})}


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(variant: str, impl: str, dim: int, layers: int, seq: int, batch: int,
          steps: int) -> dict:
    """One variant's steps in this process: resident MiB after each, and the peak."""
    from torch_mhc import ops
    from torch_mhc.tools.bench.workloads import build_model, random_tokens

    torch.set_num_threads(1)
    ops.set_default_impl(impl)
    kind, fields = VARIANTS[variant]
    torch.manual_seed(0)
    idx = random_tokens(batch, seq + 1, device="cpu")
    model = build_model(kind, dim, layers, 4, seq, dtype=torch.float32, device="cpu", **fields)
    before = rss_mib()
    after = []
    for _ in range(steps):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        del loss
        for p in model.parameters():
            p.grad = None
        after.append(rss_mib())
    # The kernel updates its high-water mark lazily: it can trail a reading just taken.
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, *after)
    return {"before_mib": before, "after_step_mib": after, "peak_mib": peak}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", default="reference", choices=["reference", "cpu"])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="steps per variant (at least 2)")
    ap.add_argument("--json", help="also write the JSON here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = (args.dim, args.layers, args.seq, args.batch)
    if args.steps < 2 or min(sizes) < 1 or args.dim % 4:
        ap.error(f"expected --steps >= 2, positive sizes and --dim a multiple of 4 (heads of "
                 f"the reference LM), got --steps {args.steps}, --dim {args.dim}, --layers "
                 f"{args.layers}, --seq {args.seq}, --batch {args.batch}")
    if args.child:
        print(json.dumps(child(args.child, args.impl, *sizes, args.steps)))
        return 0

    from torch_mhc.tools.bench.report import script_report

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    results = {}
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--child", variant, "--impl", args.impl, "--dim",
               str(args.dim), "--layers", str(args.layers), "--seq", str(args.seq),
               "--batch", str(args.batch), "--steps", str(args.steps)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"the {variant} run failed:\n{done.stderr[-2000:]}")
        r = json.loads(done.stdout.strip().splitlines()[-1])
        steps = r["after_step_mib"]
        r["growth_per_step_mib"] = (steps[-1] - steps[0]) / (len(steps) - 1)
        results[variant] = r
    config = {"impl": args.impl, "dim": args.dim, "layers": args.layers, "seq": args.seq,
              "batch": args.batch, "streams": 4, "dtype": "float32", "threads_per_run": 1,
              "steps": args.steps}
    print(script_report(config, results, args.json))
    print("\n| variant | MiB before | MiB after each step | growth a step (MiB) | peak MiB |")
    print("|---|---:|---|---:|---:|")
    for name, r in results.items():
        after = ", ".join(f"{v:.0f}" for v in r["after_step_mib"])
        print(f"| {name} | {r['before_mib']:.0f} | {after} | {r['growth_per_step_mib']:.0f} | "
              f"{r['peak_mib']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
