"""One connection's call on one token without autograd (what a decoding step makes per
connection), per op implementation: its time per call, and where that time goes.

The connection (an mHC connection, or `kind`) wraps an identity branch and runs on
[1, 1, n, C] streams under torch.no_grad() inside one `frozen_connections` block, as
`LM.generate`'s KV-cached decoding steps call it; an impl written "NAME/ops" (e.g.
"triton/ops") calls the connection's op path instead (mix_in, the branch, mix_out: what its
forward runs where the implementation prepares no decoding path), so that the prepared
path (ops/cpu/decode.py, ops/triton/decode.py) and the ops it spares are timed in one
process. Per impl:
microseconds per call (wall clock, the device synchronised at the end of each round; median of
the rounds, min and max), the device time of its kernels per call (on a GPU), and
torch.profiler's rows: each op's host time per call (self, and with its children) and each
kernel's device time per call. On a GPU the gap between the call and its kernels is host
time: launches, custom-op dispatch, checks, allocations. benchmarks/profile_decode_call.py
is the command line; gpu_check's decode section runs it too.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time

import torch

from torch_mhc.connections import frozen_connections
from torch_mhc.connections.base import prepared_decoder
from torch_mhc.connections.factory import make_connection
from torch_mhc.runtime import param_updates
from torch_mhc.tools.bench.timing import synchronize

__all__ = ["kept_rows", "markdown", "no_launches", "ops_path_call", "prepared_matches_ops",
           "profile_call"]


def profile_call(kind: str, impl: str, dim: int, streams: int, device: str, dtype: torch.dtype,
                 calls: int = 200, rounds: int = 5, profiled: int = 20, top: int = 20) -> dict:
    """{device (its type), prepared (the calls took a prepared decoding path), us_per_call:
    {median, min, max}, device_us_per_call, ops: [[name,
    self host us, host us, device us, calls] per call, ...]} for one impl: the `top` rows of
    most host time, then the `top` of most device time (kernels) not among them. The
    residual kind runs on one stream."""
    dev = torch.device(device)
    streams = 1 if kind == "residual" else streams
    name, _, path = impl.partition("/")
    if path not in ("", "ops"):
        raise ValueError(f"expected an impl name or NAME/ops, got {impl!r}")
    conn = make_connection(kind, dim, streams, 0, torch.nn.Identity(), impl=name)
    conn = conn.to(device=dev, dtype=dtype)
    call = conn if not path else functools.partial(ops_path_call, conn)
    x = torch.randn(1, 1, streams, dim, device=dev, dtype=dtype)
    per_round = []
    # as LM.generate calls its connections: without autograd, inside one frozen block
    with torch.no_grad(), frozen_connections():
        for _ in range(max(3, calls // 10)):  # warm-up: compiles, caches, decoders
            call(x)
        for _ in range(rounds):
            synchronize(dev)
            start = time.perf_counter()
            for _ in range(calls):
                call(x)
            synchronize(dev)
            per_round.append((time.perf_counter() - start) / calls * 1e6)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if dev.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(profiled):
                call(x)
            synchronize(dev)
    events = prof.key_averages()
    # the kernels themselves (device-side events): an op's row repeats its kernels' time
    kernels_us = sum(e.self_device_time_total for e in events
                     if e.device_type != torch.autograd.DeviceType.CPU)
    ops = [[e.key, e.self_cpu_time_total / profiled, e.cpu_time_total / profiled,
            e.self_device_time_total / profiled, e.count / profiled] for e in events]
    return {"device": dev.type,
            "prepared": not path and prepared_decoder(conn, x) is not None,
            "us_per_call": {"median": statistics.median(per_round), "min": min(per_round),
                            "max": max(per_round)},
            "device_us_per_call": kernels_us / profiled,
            "ops": kept_rows(ops, top)}


def prepared_matches_ops(kinds, impl: str, dim: int, streams: int, device: str,
                         dtype: torch.dtype, batches=(1, 8)) -> list[dict]:
    """Per kind and batch, one row {kind, batch, prepared, equal, max_abs_diff}: the
    connection's call without autograd on one token a sequence, twice, against its ops' path
    (ops_path_call), which run the same kernels or loops: prepared says the calls took a
    prepared decoding path (else both sides are the ops' path), equal that they gave the
    same bits both times."""
    dev = torch.device(device)
    rows = []
    for kind in kinds:
        torch.manual_seed(0)
        conn = make_connection(kind, dim, streams, 0, torch.nn.Linear(dim, dim), impl=impl)
        with torch.no_grad():
            for p in conn.parameters():  # away from the identity-like initial maps
                p.add_(torch.randn_like(p) * 0.1)
        conn = conn.to(device=dev, dtype=dtype)
        for batch in batches:
            x = torch.randn(batch, 1, streams, dim, device=dev, dtype=dtype)
            with torch.no_grad():
                first, second, ops = conn(x), conn(x), ops_path_call(conn, x)
            diff = max((first.float() - ops.float()).abs().max().item(),
                       (second.float() - ops.float()).abs().max().item())
            rows.append({"kind": kind, "batch": batch,
                         "prepared": prepared_decoder(conn, x) is not None,
                         "equal": torch.equal(first, ops) and torch.equal(second, ops),
                         "max_abs_diff": diff})
    return rows


def ops_path_call(conn, x: torch.Tensor) -> torch.Tensor:
    """The connection's call through its ops (mix_in, branch, mix_out), never a prepared
    decoding path."""
    h_in, state = conn.mix_in(x)
    return conn.mix_out(x, conn.branch(h_in), state)


@contextlib.contextmanager
def no_launches():
    """Every Triton kernel of the package replaced by one whose launches do nothing: what a
    call costs the host around its launches, timed on a machine without a GPU (the kernels'
    checks need TRITON_INTERPRET=1, set before triton's first import). Restored on exit,
    when the decoding paths prepared inside (whose launches are the stand-ins) are made
    again at their next call (param_updates.parameters_changed; a frozen_connections block
    open around this one keeps them until it ends)."""
    from torch_mhc.ops.triton import kernels, ops

    if not ops.interpreted():
        raise RuntimeError("no_launches needs TRITON_INTERPRET=1 set before triton is imported")
    kept = {name: k for name, k in vars(kernels).items() if name.endswith("_kernel")}
    try:
        for name in kept:
            setattr(kernels, name, _NoLaunch(name))
        yield
    finally:
        for name, kernel in kept.items():
            setattr(kernels, name, kernel)
        param_updates.parameters_changed()


class _NoLaunch:
    """A kernel whose launch (kernel[grid](...)) does nothing."""

    def __init__(self, name: str):
        self.__name__ = name

    def __getitem__(self, grid):
        return _nothing


def _nothing(*args, **kwargs) -> None:
    return None


def kept_rows(ops: list[list], top: int) -> list[list]:
    """The `top` rows of most host time (with children), then the `top` of most device time
    not among them: a kernel's row has no host time, so sorted by host time alone the
    kernels would all fall below the host's rows and out of the table."""
    by_host = sorted(ops, key=lambda row: row[2], reverse=True)[:top]
    by_device = [row for row in sorted(ops, key=lambda row: row[3], reverse=True)[:top]
                 if row[3] > 0 and row not in by_host]
    return by_host + by_device


def markdown(results: dict) -> str:
    """A heading per impl (its time per call) and its profiler rows as a table; an impl
    whose result is {"error": ...} gets its heading and the error."""
    lines = []
    for impl, r in results.items():
        if "error" in r:
            lines += ["", f"### {impl}: {r['error']}"]
            continue
        u = r["us_per_call"]
        kernels = (f", its kernels {r['device_us_per_call']:.1f} us on the device"
                   if r["device"] != "cpu" else "")
        path = ", its prepared decoding path" if r.get("prepared") else ""
        lines += ["", f"### {impl}: {u['median']:.1f} us a call ({u['min']:.1f}-{u['max']:.1f})"
                  f"{kernels}{path}", "",
                  "| op or kernel | host us (self) | host us (with children) | device us "
                  "| calls |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {name} | {own:.1f} | {total:.1f} | {device:.1f} | {count:g} |"
                  for name, own, total, device, count in r["ops"]]
    return "\n".join(lines)
