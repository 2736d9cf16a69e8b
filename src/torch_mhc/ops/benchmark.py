"""Time the connection ops per implementation, and a training step with each, in one process.

    python -m torch_mhc.ops.benchmark --tokens 2048 --streams 4 --dim 512 --impls reference cpu
    python -m torch_mhc.ops.benchmark --model --dim 512 --layers 8 --impls reference cpu

Ops: for each implementation, maps + pre-aggregation + post-merge, forward and backward
with a random upstream gradient, around an identity branch (so only the connection is
timed), against the plain residual's x + f on the same tokens.
--model: one training step (forward, cross-entropy, backward) of the reference LM
(torch_mhc.model) with residual connections and with mHC under each implementation,
batch 8 x 256 tokens, as ratios to the residual.

Runs alternate between the entries and the median is reported, which keeps a shared
machine's load from favouring one of them; --clock process times this process's CPU time
instead of wall time (steadier when other processes compete for the cores). Prints JSON,
then a markdown table. The timing loop and the LM training step are torch_mhc.bench's
(`mhc bench` runs the whole benchmark suite).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ..bench import build_model, random_tokens, time_interleaved, train_step
from . import get_impl

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _connection_step(impl: str, tokens: int, n: int, c: int, dtype: torch.dtype, device: str):
    """A closure running one forward + backward of the connection's ops."""
    g = torch.Generator().manual_seed(0)
    m = n * n + 2 * n
    x = torch.randn(tokens, n, c, generator=g).to(device=device, dtype=dtype).requires_grad_()
    params = [
        (torch.randn(n * c, m, generator=g) / (n * c) ** 0.5),
        torch.full((3,), 0.5),
        torch.zeros(n),
        torch.zeros(n),
        torch.randn(n, n, generator=g),
    ]
    params = [p.to(device).requires_grad_() for p in params]
    upstream = torch.randn(tokens, n, c, generator=g).to(device=device, dtype=dtype)
    ops = get_impl(impl, device, dtype)

    def step():  # what ManifoldHyperConnection runs, around an identity branch
        if ops.links:
            _, h_post, h_res, f, x_link = ops.mhc_maps_pre(x, *params, link=True)
            out = ops.post_merge(x_link, f, h_post, h_res, linked=True)
        else:
            _, h_post, h_res, f = ops.mhc_maps_pre(x, *params)
            out = ops.post_merge(x, f, h_post, h_res)
        out.backward(upstream)

    return step


def _residual_step(tokens: int, c: int, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, c, generator=g).to(device=device, dtype=dtype).requires_grad_()
    upstream = torch.randn(tokens, c, generator=g).to(device=device, dtype=dtype)

    def step():
        (x + x * 1.0).backward(upstream)  # x + F(x) with a (nearly free) branch

    return step


def _model_step(impl: str | None, dim: int, layers: int, streams: int, batch: int, seq: int,
                dtype: torch.dtype, device: str):
    """A closure running one training step of the reference LM (impl None: residual)."""
    kind = "residual" if impl is None else "mhc"
    model = build_model(kind, dim, layers, streams, seq, dtype=dtype, device=device)
    return train_step(model, random_tokens(batch, seq + 1, device=device), impl)


def measure(
    impls: list[str],
    tokens: int = 2048,
    streams: int = 4,
    dim: int = 512,
    dtype: str = "float32",
    device: str = "cpu",
    repeats: int = 15,
    warmup: int = 2,
    clock: str = "wall",
) -> dict:
    """Median milliseconds of each implementation's connection step and of the residual."""
    dt = _DTYPES[dtype]
    steps = {name: _connection_step(name, tokens, streams, dim, dt, device) for name in impls}
    steps["residual"] = _residual_step(tokens, dim, dt, device)
    times = time_interleaved(steps, repeats, warmup, clock, device)
    return {
        "config": {"tokens": tokens, "streams": streams, "dim": dim, "dtype": dtype,
                   "device": device, "threads": torch.get_num_threads(), "repeats": repeats,
                   "clock": clock},
        "median_ms": {name: statistics.median(ts) for name, ts in times.items()},
        "min_ms": {name: min(ts) for name, ts in times.items()},
    }


def measure_model(
    impls: list[str],
    dim: int = 512,
    layers: int = 8,
    streams: int = 4,
    batch: int = 8,
    seq: int = 256,
    dtype: str = "float32",
    device: str = "cpu",
    repeats: int = 5,
    warmup: int = 1,
    clock: str = "wall",
) -> dict:
    """Median ms of a training step, residual and mHC per implementation, and the ratios."""
    dt = _DTYPES[dtype]
    steps = {"residual": _model_step(None, dim, layers, streams, batch, seq, dt, device)}
    for name in impls:
        steps[f"mhc/{name}"] = _model_step(name, dim, layers, streams, batch, seq, dt, device)
    times = time_interleaved(steps, repeats, warmup, clock, device)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "config": {"dim": dim, "layers": layers, "streams": streams, "batch": batch, "seq": seq,
                   "dtype": dtype, "device": device, "threads": torch.get_num_threads(),
                   "repeats": repeats, "clock": clock},
        "median_ms": med,
        "ratio_to_residual": {name: ms / med["residual"] for name, ms in med.items()},
    }


def markdown(result: dict) -> str:
    """One row per implementation (and the residual): median and min ms, speed-up."""
    med, mins = result["median_ms"], result["min_ms"]
    base = med.get("reference")
    lines = ["| connection ops | median ms | min ms | speed-up vs reference |",
             "|---|---:|---:|---:|"]
    for name, ms in med.items():
        ratio = f"{base / ms:.2f}x" if base and name not in ("reference", "residual") else ""
        label = "residual x + f" if name == "residual" else name
        lines.append(f"| {label} | {ms:.2f} | {mins[name]:.2f} | {ratio} |")
    return "\n".join(lines)


def markdown_model(result: dict) -> str:
    lines = ["| training step | median ms | x residual |", "|---|---:|---:|"]
    for name, ms in result["median_ms"].items():
        lines.append(f"| {name} | {ms:.0f} | {result['ratio_to_residual'][name]:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="store_true", help="time LM training steps instead")
    parser.add_argument("--tokens", type=int, default=2048, help="ops: tokens (B*T)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8, help="--model: transformer blocks")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--impls", nargs="+", default=["reference", "cpu"])
    parser.add_argument("--repeats", type=int, default=None, help="default 15 (ops), 5 (model)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--clock", choices=["wall", "process"], default="wall")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.model:
        result = measure_model(args.impls, args.dim, args.layers, args.streams,
                               dtype=args.dtype, device=args.device,
                               repeats=args.repeats or 5, clock=args.clock)
        print(json.dumps(result, indent=2))
        print(markdown_model(result))
        return
    result = measure(args.impls, args.tokens, args.streams, args.dim, args.dtype, args.device,
                     args.repeats or 15, clock=args.clock)
    print(json.dumps(result, indent=2))
    print(markdown(result))


if __name__ == "__main__":
    main()
