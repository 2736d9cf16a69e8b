"""One connection's call on one token without autograd (what a decoding step makes per
connection), per op implementation: its time per call, and where that time goes.

    python benchmarks/profile_decode_call.py --impls cpu,cpu/ops,reference --threads 1
    python benchmarks/profile_decode_call.py --device cuda --dtype bfloat16 --dim 2048 \
        --impls triton,triton/ops,reference
    python benchmarks/profile_decode_call.py --no-launches --dim 2048 --impls triton,triton/ops

The connection is an mHC connection (or --kind) around an identity branch, on [1, 1, n, C]
streams, called under torch.no_grad() inside one `frozen_connections` block, as
`LM.generate`'s KV-cached decoding steps call it ("NAME/ops": through the connection's
ops, sparing no work: what the prepared decoding paths spare shows beside NAME). Per impl:
microseconds per call (wall clock, the device synchronised at the end of each round; median
of the rounds, min-max as the spread), then torch.profiler over --profiled calls: each
profiled op's host time per call (self and with its children: what the host spends around the
kernels) and, on a GPU, each kernel's device time per call (tools/bench/decode_call.py). On a
GPU the gap between the call and the kernels' device time is host time: launches, custom-op
dispatch, checks, allocations. --no-launches times the `triton` impl's host work around
its launches without a GPU: on CPU tensors in Triton's interpreter, every launch replaced by
one that does nothing (tools/bench/decode_call.no_launches), so the figures are the host's
work but for the launches themselves (and without a GPU driver's costs). Prints JSON, then a
markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

from torch_mhc.tools.bench.decode_call import markdown, no_launches, profile_call
from torch_mhc.tools.bench.report import script_report
from torch_mhc.tools.bench.workloads import DTYPES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="mhc")
    parser.add_argument("--impls", default=None,
                        help="comma-separated (default: cpu,reference on the CPU, "
                             "triton,reference on a GPU)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--calls", type=int, default=200, help="calls a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profiled", type=int, default=20, help="calls under the profiler")
    parser.add_argument("--top", type=int, default=20, help="profiler rows kept per impl")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--json", default=None, help="also write the JSON here")
    parser.add_argument("--no-launches", action="store_true",
                        help="the triton impls' host work only, on the CPU (see above)")
    args = parser.parse_args(argv)
    if args.no_launches:
        if args.device != "cpu":
            parser.error("--no-launches runs on CPU tensors (--device cpu)")
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--no-launches needs TRITON_INTERPRET=1 before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"  # before the triton impl's first import
    for name in ("calls", "rounds", "profiled", "top", "dim", "streams"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.impls is None:
        args.impls = ("triton,triton/ops" if args.no_launches
                      else "cpu,cpu/ops,reference" if args.device == "cpu"
                      else "triton,triton/ops,reference")
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    with no_launches() if args.no_launches else contextlib.nullcontext():
        results = {impl: profile_call(args.kind, impl, args.dim, args.streams, args.device,
                                      DTYPES[args.dtype], args.calls, args.rounds,
                                      args.profiled, args.top)
                   for impl in impls}
    config = {"kind": args.kind, "dim": args.dim, "streams": args.streams,
              "device": args.device, "dtype": args.dtype, "calls": args.calls,
              "rounds": args.rounds, "profiled": args.profiled,
              "threads": torch.get_num_threads(), "no_launches": args.no_launches}
    print(script_report(config, results, args.json))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
