"""mHC decoding through its prepared calls against the ops' no-autograd path, in one process.

The same mHC model twice (and the residual model as the baseline): one decodes as shipped
(each connection's two prepared native calls, ops/cpu/decode.py), the other with the prepared
path switched off, so that its connections take the ops' no-autograd path (mhc_maps_pre and
post_merge, the path from before the prepared calls). --unchecked adds a third copy whose
connections skip the per-call check of their input, parameters and implementation: unsafe (a
changed parameter would go unseen), timed only to size what that check costs.

One-token steps of every model interleaved step by step after a prefill
(tools.bench.decode's step measurement), the models built --builds times in rotated order.
The steps run outside any frozen_connections block, so that every prepared call checks its
parameters as a caller's own decoding loop would; --frozen runs them inside one, as
LM.generate does (where the check happens once per connection).

    python benchmarks/bench_decode_paths.py --batch 1 --threads 1
    python benchmarks/bench_decode_paths.py --batch 8 --threads 1 --unchecked
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from torch_mhc.connections import Connection
from torch_mhc.tools.bench.decode import time_decode_steps
from torch_mhc.tools.bench.workloads import build_model, random_tokens


def _ops_path(model: torch.nn.Module) -> None:
    """Switch every connection's prepared path off (the ops' path runs instead)."""
    for module in model.modules():
        if isinstance(module, Connection):
            module._prepared_decoder = module._decoder = lambda x: None


def _unchecked(model: torch.nn.Module) -> None:
    """Keep each connection's first prepared calls per shape without checking them again
    (nor the input: only a contiguous one of that shape)."""
    for module in model.modules():
        if isinstance(module, Connection):
            kept: dict = {}

            def decoder(x, module=module, kept=kept):
                if x.shape not in kept:
                    kept[x.shape] = Connection._decoder(module, x)
                return kept[x.shape]

            module._decoder = decoder
            module._prepared_decoder = \
                lambda x, kept=kept: kept.get(x.shape) if x.is_contiguous() else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--builds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("wall", "process"), default="process",
                   help="process: this process's CPU time (one thread only: idle OpenMP "
                        "threads spin and are counted)")
    p.add_argument("--unchecked", action="store_true")
    p.add_argument("--frozen", action="store_true",
                   help="run the steps inside one frozen_connections block")
    args = p.parse_args()
    if args.clock == "process" and args.threads != 1:
        p.error("--clock process measures one thread only; use --clock wall with --threads "
                f"{args.threads}")
    torch.set_num_threads(args.threads)
    names = ["residual", "mhc", "mhc (ops path)"] + (["mhc (unchecked)"] if args.unchecked
                                                      else [])
    times: dict[str, list[float]] = {}
    for build in range(args.builds):
        order = names[build % len(names):] + names[:build % len(names)]
        models = {}
        for name in order:
            kind = "residual" if name == "residual" else "mhc"
            model = build_model(kind, args.dim, args.layers, 4, args.prompt + args.new_tokens)
            if name == "mhc (ops path)":
                _ops_path(model)
            elif name == "mhc (unchecked)":
                _unchecked(model)
            models[name] = model.eval()
        idx = random_tokens(args.batch, args.prompt)
        steps = time_decode_steps(models, idx, args.new_tokens, 1, args.clock, "cpu",
                                  frozen=args.frozen)
        for key, ts in steps.items():
            times.setdefault(key.removesuffix("/step"), []).extend(ts)
    base = statistics.median(times["residual"])
    rows = {name: {"step_median_ms": statistics.median(ts), "steps": len(ts),
                   "tokens_per_s_ratio": base / statistics.median(ts)}
            for name, ts in times.items()}
    print(json.dumps({"batch": args.batch, "threads": torch.get_num_threads(),
                      "clock": args.clock, "builds": args.builds, "frozen": args.frozen,
                      "rows": rows}, indent=2))
    print("| variant | decode step ms | tokens/s x residual |\n|---|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['step_median_ms']:.2f} | {r['tokens_per_s_ratio']:.3f} |")


if __name__ == "__main__":
    main()
