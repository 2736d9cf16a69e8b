"""Where a training step's time goes, op by op, for the residual and the connection kinds.

torch.profiler over a few training steps of the benchmark LM (`mhc bench`'s model: pre-norm
attention + MLP blocks, batch x seq tokens) per kind, after warm-up steps; each op's self
CPU time per step, the kinds side by side. The kinds' steps are profiled in interleaved
rounds, the order rotated each round. The native connection ops appear as
`torch_mhc::cpu_*`; an op's count per step says how often it runs (one per connection for
the maps and the merge). Self time is wall time on the op's thread: at two threads an op
that runs on both counts once.

    python benchmarks/profile_step_ops.py --dim 512 --threads 1
    python benchmarks/profile_step_ops.py --kinds residual,mhc,kromhc --threads 2 --json out.json

On a GPU (--device cuda) the table holds self time on the device instead (CUDA activity;
the device synchronised before each profile closes): rows for the kernels, and rows for the
ops that launched them with the same time, so that its total counts both:

    python benchmarks/profile_step_ops.py --device cuda --dtype bfloat16 --dim 2048 \
        --layers 16 --batch 8 --seq 1024 --top 30
"""

from __future__ import annotations

import argparse

import torch

from torch_mhc.tools.bench.report import script_report
from torch_mhc.tools.bench.workloads import DTYPES, build_model, random_tokens, train_step


def profile(kinds: list[str], dim: int, layers: int, batch: int, seq: int, steps: int,
            warmup: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """{kind: {op: [self ms per step, calls per step]}} over `steps` profiled steps a kind:
    self CPU time on the CPU, each kernel's self device time on a GPU.

    Every model is built and warmed up first, then each round profiles one step of every
    kind, the kinds in a rotated order. Profiled one kind after the other, the kind that came
    second showed its elementwise ops (gelu, gelu_backward, mul, div) up to 2-3x slower at two
    threads whichever kind it was (2026-12-03), which is no cost of that kind.
    """
    idx = random_tokens(batch, seq + 1, device=device)
    step = {kind: train_step(build_model(kind, dim, layers, seq=seq, dtype=dtype, device=device),
                             idx) for kind in kinds}
    for _ in range(warmup):
        for kind in kinds:
            step[kind]()
    gpu = torch.device(device).type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    totals = {kind: {} for kind in kinds}  # op -> [self us, calls] over the profiled steps
    for r in range(steps):
        for kind in kinds[r % len(kinds):] + kinds[: r % len(kinds)]:
            with torch.profiler.profile(activities=activities) as prof:
                step[kind]()
                if gpu:
                    torch.cuda.synchronize()
            for e in prof.key_averages():
                us = e.self_device_time_total if gpu else e.self_cpu_time_total
                if gpu and not us:  # host-side ops: their kernels are counted by name
                    continue
                total = totals[kind].setdefault(e.key, [0.0, 0])
                total[0] += us
                total[1] += e.count
    return {kind: {op: [us / steps / 1e3, calls / steps] for op, (us, calls) in ops.items()}
            for kind, ops in totals.items()}


def markdown(result: dict, top: int) -> str:
    """The `top` ops by their largest self time in any kind, and every torch_mhc op."""
    kinds = list(result)
    names = set().union(*(r.keys() for r in result.values()))

    def largest(name):
        return max(r.get(name, [0.0, 0])[0] for r in result.values())

    ranked = sorted(names, key=largest, reverse=True)
    shown = ranked[:top] + [n for n in ranked[top:] if n.startswith("torch_mhc::")]
    lines = ["| op | " + " | ".join(f"{k} ms (calls)" for k in kinds) + " |",
             "|---|" + "---:|" * len(kinds)]
    for name in shown:
        cells = []
        for k in kinds:
            ms, calls = result[k].get(name, [0.0, 0])
            cells.append(f"{ms:.1f} ({calls:g})" if calls else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    totals = [sum(ms for ms, _ in result[k].values()) for k in kinds]
    lines.append("| all ops | " + " | ".join(f"{t:.1f}" for t in totals) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="residual,mhc", help="comma-separated model kinds")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="profiled steps per kind")
    p.add_argument("--warmup", type=int, default=2, help="unprofiled steps first")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda (kernels' device time)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--top", type=int, default=20, help="ops in the table (and every torch_mhc op)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    for name in ("dim", "layers", "batch", "seq", "steps", "threads", "top"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.device not in ("cpu", "cuda") or (args.device == "cuda"
                                                and not torch.cuda.is_available()):
        p.error(f"--device must be cpu, or cuda where a GPU is there; got {args.device!r}")
    kinds = list(dict.fromkeys(k for k in args.kinds.split(",") if k))  # each kind once
    torch.set_num_threads(args.threads)
    result = profile(kinds, args.dim, args.layers, args.batch, args.seq, args.steps, args.warmup,
                     args.device, DTYPES[args.dtype])
    config = {**{k: v for k, v in vars(args).items() if k != "json"}, "kinds": kinds}
    print(script_report(config, result, args.json, key="self_ms_and_calls_per_step"))
    print(markdown(result, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
