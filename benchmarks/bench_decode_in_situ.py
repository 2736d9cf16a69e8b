"""Where a connection's time goes inside a decoding step, per call, by connection kind.

A connection's decoding call costs several times as much inside a KV-cached decode step as in
a loop that calls it alone (an mHC call at batch 1, d = 512: about 86 us against 17 on the
2-core EPYC this was written on): between two calls of one connection the blocks' weights
stream through every cache. This script times the calls where they run. Each model (the
residual and the kinds asked for) decodes one-token steps after a prefill; every connection's
call and its branch's call are wrapped in clocks, and so are the prepared decoder's two
methods (ops/cpu/decode.py) and the two native calls they make. Per connection call:

    connection - branch   what the connection adds around its block
    lookup                finding the prepared decoder for x (Connection._prepared_decoder)
    mix_in                maps and aggregation: the branch input's allocation, the native call
    native maps           the native call alone (x @ phi, the RMS, gates, H_res, aggregation)
    mix_out               the merge: the output's allocation, the native call
    native merge          the native call alone (H_res x + H_post^T f)

Each clock adds its own cost to the call it wraps (0.3-0.6 us warm on the 2-core EPYC this was
written on; more inside a step, where it too is out of cache), and each part includes the
clocks of the parts inside it. The step times are of the wrapped models: `mhc bench --only
decode` times the models as shipped. The steps run outside any frozen_connections block, so
every call checks its parameters (as a caller's own decoding loop does); `--frozen` runs them
inside one, as `LM.generate` (and `mhc bench --only decode`) does. `--calls ctypes`
makes the two native calls through ctypes, as where ops/cpu/decode_calls.c does not build.

    python benchmarks/bench_decode_in_situ.py --batch 8 --threads 1
    python benchmarks/bench_decode_in_situ.py --batch 1 --kinds mhc,hc,mhc-lite --json out.json
    python benchmarks/bench_decode_in_situ.py --batch 1 --kinds mhc --calls ctypes
    python benchmarks/bench_decode_in_situ.py --batch 1 --kinds mhc --frozen
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from torch_mhc.connections import Connection, frozen_connections
from torch_mhc.ops.cpu import decode as _decode
from torch_mhc.ops.cpu import native as _native
from torch_mhc.tools.bench.report import script_report
from torch_mhc.tools.bench.workloads import build_model, random_tokens

PARTS = ("connection", "branch", "lookup", "mix_in", "native maps", "mix_out", "native merge")


def timed(fn, add):
    """fn, with the seconds of each call passed to add(seconds)."""
    now = time.perf_counter

    def call(*args, **kwargs):
        t0 = now()
        try:
            return fn(*args, **kwargs)
        finally:
            add(now() - t0)

    return call


class Clocks:
    """Seconds and calls summed per part."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.total, self.calls = dict.fromkeys(PARTS, 0.0), dict.fromkeys(PARTS, 0)

    def add(self, part: str, seconds: float) -> None:
        self.total[part] += seconds
        self.calls[part] += 1

    def wrap(self, part: str, fn):
        """fn, its calls adding to part."""
        return timed(fn, lambda seconds: self.add(part, seconds))


def instrument(model: torch.nn.Module, clocks: Clocks) -> int:
    """Wrap every connection's and branch's forward in clocks; the number of connections."""
    count = 0
    for module in model.modules():
        if isinstance(module, Connection):
            module.forward = clocks.wrap("connection", module.forward)
            module.branch.forward = clocks.wrap("branch", module.branch.forward)
            count += 1
    return count


def run(kinds: list[str], batch: int, dim: int, layers: int, prompt: int, steps: int,
        rounds: int, calls: str = "library", frozen: bool = False) -> dict:
    """Per kind: the median over rounds of each part's time per connection call (us) and of
    the step (ms). Rounds alternate between the models."""
    lib = _native.load()
    if lib is None:
        raise SystemExit("the native CPU library is unavailable: nothing to break down")
    clocks = {kind: Clocks() for kind in kinds}
    # the prepared decoder's methods and the library's two calls, each adding to the clocks
    # of the model that runs at the time
    current = {"clocks": None}
    methods = {"mix_in": _decode.Decoder.mix_in, "mix_out": _decode.Decoder.mix_out}
    lookup = Connection.__dict__["_prepared_decoder"]
    shipped = lib.decoding_calls()
    chosen = (lib._lib.decode_maps, lib._lib.decode_merge) if calls == "ctypes" else shipped
    natives = dict(zip(("native maps", "native merge"), chosen, strict=True))

    def route(part, fn):  # fn, its calls adding to part of the model running at the time
        return timed(fn, lambda seconds: current["clocks"].add(part, seconds))

    try:
        Connection._prepared_decoder = route("lookup", lookup)
        _decode.Decoder.mix_in = route("mix_in", methods["mix_in"])
        _decode.Decoder.mix_out = route("mix_out", methods["mix_out"])
        lib._decoding = (route("native maps", natives["native maps"]),
                         route("native merge", natives["native merge"]))
        models, caches, counts, prepared = {}, {}, {}, {}
        idx = random_tokens(batch, prompt)
        for kind in kinds:
            models[kind] = build_model(kind, dim, layers, 4, prompt + steps).eval()
            counts[kind] = instrument(models[kind], clocks[kind])
        per_round: dict[str, dict[str, list[float]]] = {
            k: {p: [] for p in (*PARTS, "step")} for k in kinds}
        token = idx[:, -1:]
        block = frozen_connections() if frozen else contextlib.nullcontext()
        with torch.no_grad(), block:
            for r in range(rounds + 1):  # round 0 warms up
                for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                    model, c = models[kind], clocks[kind]
                    current["clocks"] = c
                    caches[kind] = model.new_kv_cache(batch, prompt + steps)
                    model(idx, kv_cache=caches[kind])
                    c.reset()
                    t0 = time.perf_counter()
                    for s in range(steps):
                        model(token, kv_cache=caches[kind], start_pos=prompt + s)
                    step = (time.perf_counter() - t0) / steps
                    if r == 0:
                        continue
                    n_calls = steps * counts[kind]
                    for p in PARTS:
                        per_round[kind][p].append(c.total[p] / n_calls * 1e6)
                    per_round[kind]["step"].append(step * 1e3)
                    prepared[kind] = c.calls["native maps"] / steps
    finally:
        Connection._prepared_decoder = lookup
        _decode.Decoder.mix_in, _decode.Decoder.mix_out = methods["mix_in"], methods["mix_out"]
        lib._decoding = shipped
    results = {}
    for kind in kinds:
        med = {p: statistics.median(v) for p, v in per_round[kind].items()}
        results[kind] = {
            "step_ms": med["step"],
            "connections": counts[kind],
            # connection calls per step that took the prepared native calls (the rest, none
            # for the residual, took the ops' path)
            "prepared_calls_per_step": prepared[kind],
            "us_per_call": {p: med[p] for p in PARTS},
            "connection_minus_branch_us": statistics.median(
                a - b for a, b in zip(per_round[kind]["connection"], per_round[kind]["branch"],
                                      strict=True)),
        }
    return results


def markdown(results: dict) -> str:
    lines = ["| kind | step ms | connection - branch us | lookup us | mix_in us | "
             "native maps us | mix_out us | native merge us |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for kind, e in results.items():
        u = e["us_per_call"]
        lines.append(f"| {kind} | {e['step_ms']:.2f} | {e['connection_minus_branch_us']:.1f} | "
                     f"{u['lookup']:.1f} | {u['mix_in']:.1f} | {u['native maps']:.1f} | "
                     f"{u['mix_out']:.1f} | {u['native merge']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="residual,mhc,hc",
                   help="comma-separated model kinds (the residual is always included)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=64, help="one-token steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calls", choices=("library", "ctypes"), default="library",
                   help="the native calls as the library makes them (through "
                        "ops/cpu/decode_calls.c where it builds) or through ctypes")
    p.add_argument("--frozen", action="store_true",
                   help="decode inside one frozen_connections block, as LM.generate does")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    for name in ("batch", "dim", "layers", "prompt", "steps", "rounds", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    kinds = [k for k in args.kinds.split(",") if k]
    kinds = kinds if "residual" in kinds else ["residual", *kinds]
    torch.set_num_threads(args.threads)
    results = run(kinds, args.batch, args.dim, args.layers, args.prompt, args.steps,
                  args.rounds, args.calls, args.frozen)
    config = {**{k: v for k, v in vars(args).items() if k != "json"}, "kinds": kinds}
    print(script_report(config, results, args.json))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
