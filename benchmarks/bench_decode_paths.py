"""mHC decoding through its prepared calls against the ops' no-autograd path, in one process.

The same mHC model twice (and the residual model as the baseline): one decodes as shipped
(each connection's two prepared native calls, ops/cpu/decode.py), the other with the prepared
path switched off, so that its connections take the ops' no-autograd path (mhc_maps_pre and
post_merge, the path from before the prepared calls). --unchecked adds a third copy whose
connections skip the per-call check of their input, parameters and implementation: unsafe (a
changed parameter would go unseen), timed only to size what that check costs. --against
SOURCE adds a copy whose prepared calls run a library built from SOURCE (another version of
ops/cpu/native.c with the same decode_call block, such as `git show REV:src/torch_mhc/ops/
cpu/native.c`): two builds of the kernels side by side in one process.

One-token steps of every model interleaved step by step after a prefill
(tools.bench.decode's step measurement), the models built --builds times in rotated order.
The steps run outside any frozen_connections block, so that every prepared call checks its
parameters as a caller's own decoding loop would; --frozen runs them inside one, as
LM.generate does (where the check happens once per connection).

    python benchmarks/bench_decode_paths.py --batch 1 --threads 1
    python benchmarks/bench_decode_paths.py --batch 8 --threads 1 --unchecked
    python benchmarks/bench_decode_paths.py --batch 8 --frozen --against /tmp/parent_native.c
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import tempfile
from pathlib import Path

import torch

from torch_mhc.connections import Connection
from torch_mhc.ops.cpu import build as native_build
from torch_mhc.ops.cpu import native
from torch_mhc.tools.bench.decode import time_decode_steps
from torch_mhc.tools.bench.timing import median_interval
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


def _library_from(source: str, tmp: str) -> native.NativeOps:
    """The native library built from source as ops/cpu/build.py builds native.c (its flags,
    this CPU's tuning), refused unless its decode_call block is this library's."""
    lib, command = native.load(), native_build._compiler()
    if lib is None or command is None:
        raise SystemExit("--against needs the native library and a C compiler")
    out = Path(tmp) / "against.so"
    native_build._compile(command, native_build.library_flags(), out, Path(source))
    handle = ctypes.CDLL(str(out))
    # a block with its entry points first (90c52e6 on); its size where the source says it
    sizes = []
    for one in (lib._lib, handle):
        size = getattr(one, "decode_call_size", None)
        if size is not None:
            size.restype = ctypes.c_int64
        sizes.append(size() if size is not None else sizes[0])
    if not hasattr(handle, "decode_entry_points") or sizes[0] != sizes[1]:
        raise SystemExit(f"{source}: its decode_call block is not this library's: the builds "
                         "cannot share prepared calls")
    return native.NativeOps(out)


def _built_from(model: torch.nn.Module, lib: native.NativeOps) -> None:
    """Point every prepared call the model's connections make at lib's entry points."""
    for module in model.modules():
        if isinstance(module, Connection):
            def decoder(x, module=module):
                dec = Connection._decoder(module, x)
                if dec is not None and dec._lib is not lib:
                    lib.entry_points(dec._call)
                    dec._lib = lib
                return dec

            module._decoder = decoder


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
    p.add_argument("--against", metavar="SOURCE",
                   help="also an mHC model whose prepared calls run a library built from "
                        "this native.c")
    args = p.parse_args()
    if args.clock == "process" and args.threads != 1:
        p.error("--clock process measures one thread only; use --clock wall with --threads "
                f"{args.threads}")
    torch.set_num_threads(args.threads)
    names = ["residual", "mhc", "mhc (ops path)"] + (["mhc (unchecked)"] if args.unchecked
                                                      else [])
    tmp = tempfile.TemporaryDirectory(prefix="torch_mhc_against_")
    if args.against:
        against = _library_from(args.against, tmp.name)
        names.append("mhc (against)")
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
            elif name == "mhc (against)":
                _built_from(model, against)
            models[name] = model.eval()
        idx = random_tokens(args.batch, args.prompt)
        steps = time_decode_steps(models, idx, args.new_tokens, 1, args.clock, "cpu",
                                  frozen=args.frozen)
        for key, ts in steps.items():
            times.setdefault(key.removesuffix("/step"), []).extend(ts)
    base = statistics.median(times["residual"])
    # each variant's steps over mHC's as shipped, step by step (the steps interleave)
    rows = {name: {"step_median_ms": statistics.median(ts), "steps": len(ts),
                   "tokens_per_s_ratio": base / statistics.median(ts),
                   "step_over_mhc": (None if name == "residual" else statistics.median(
                       a / b for a, b in zip(ts, times["mhc"], strict=True))),
                   "step_over_mhc_interval": (None if name == "residual" else median_interval(
                       [a / b for a, b in zip(ts, times["mhc"], strict=True)]))}
            for name, ts in times.items()}
    tmp.cleanup()
    print(json.dumps({"batch": args.batch, "threads": torch.get_num_threads(),
                      "clock": args.clock, "builds": args.builds, "frozen": args.frozen,
                      "against": args.against, "rows": rows}, indent=2))
    print("| variant | decode step ms | tokens/s x residual | step x mhc's (paired, interval) |"
          "\n|---|---:|---:|---:|")
    for name, r in rows.items():
        iv = r["step_over_mhc_interval"]
        paired = ("" if r["step_over_mhc"] is None else f"{r['step_over_mhc']:.4f}"
                  + (f" ({iv[0]:.4f}-{iv[1]:.4f})" if iv else ""))
        print(f"| {name} | {r['step_median_ms']:.2f} | {r['tokens_per_s_ratio']:.3f} | "
              f"{paired} |")


if __name__ == "__main__":
    main()
