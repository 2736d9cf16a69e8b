"""Side-by-side timing for benchmarks: the one timing loop of the package.

Runs alternate between the entries (round r times every entry once), so a shared machine's
load changes all of them alike, and each entry's list of times lines up with the others'.
`clock="process"` measures this process's CPU time instead of wall time: steadier when other
processes compete for the cores (it counts every thread of the process, so compare entries
run with the same thread count). Used by `mhc bench` (tools.bench.suite), the ops benchmark
(torch_mhc.tools.bench.ops) and the scripts in benchmarks/. Torch alone; nothing at import.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["CLOCKS", "summarize", "time_interleaved"]

CLOCKS = ("wall", "process")


def _sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_interleaved(
    steps: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    clock: str = "wall",
    device: torch.device | str = "cpu",
) -> dict[str, list[float]]:
    """Milliseconds per run of each step, over `repeats` rounds that run every step once.

    `warmup` untimed rounds come first (allocator, caches, lazy initialisation). Returns
    {name: [ms of round 0, round 1, ...]}, so entry r of two lists was measured side by side.
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    now = time.process_time if clock == "process" else time.perf_counter
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            _sync(device)
            t0 = now()
            step()
            _sync(device)
            times[name].append((now() - t0) * 1e3)
    return times


def summarize(times: dict[str, list[float]], baseline: str) -> dict[str, dict]:
    """Per entry: median, min, max ms, the runs, and the ratio to the baseline.

    ratio = median / the baseline's median (exactly 1.0 for the baseline); ratio_min and
    ratio_max are the extremes of the per-round ratios (run r over the baseline's run r).
    """
    if baseline not in times:
        raise ValueError(f"baseline {baseline!r} is not among the timed entries {list(times)}")
    base = times[baseline]
    base_median = statistics.median(base)
    out = {}
    for name, ts in times.items():
        per_round = [t / b for t, b in zip(ts, base, strict=True)]
        out[name] = {
            "median_ms": statistics.median(ts),
            "min_ms": min(ts),
            "max_ms": max(ts),
            "ratio": statistics.median(ts) / base_median,
            "ratio_min": min(per_round),
            "ratio_max": max(per_round),
            "runs_ms": [round(t, 3) for t in ts],
        }
    return out
