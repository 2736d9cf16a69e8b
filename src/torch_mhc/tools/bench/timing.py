"""Timing for the benchmarks: every timing loop of the tools is here.

time_interleaved: runs alternate between the entries (round r times every entry once), so a
shared machine's load changes all of them alike, and each entry's list of times lines up with
the others'. `clock="process"` measures this process's CPU time instead of wall time: steadier
when other processes compete for the cores (it counts every thread of the process, so compare
entries run with the same thread count). summarize and medians turn its lists into figures;
median_interval bounds the median of the per-round ratios, so that a ratio printed from a
few noisy rounds says how far it can be trusted.

time_once: one run on either clock (the decode benchmark interleaves single steps with it).

time_ms: one function alone, timed with CUDA events on a GPU (the GPU check's kernels take
microseconds, below what a host clock around a synchronisation resolves).

Used by `mhc bench` (the suite, the ops benchmark, the GPU check) and the scripts in
benchmarks/. Torch alone; nothing at import.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["CLOCKS", "cuda_event_ms", "median_interval", "medians", "summarize", "synchronize",
           "time_interleaved", "time_ms", "time_once"]

CLOCKS = ("wall", "process")


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_interleaved(
    steps: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    clock: str = "wall",
    device: torch.device | str = "cpu",
    on_round: Callable[[int, dict[str, list[float]]], object] | None = None,
) -> dict[str, list[float]]:
    """Milliseconds per run of each step, over `repeats` rounds that run every step once.

    `warmup` untimed rounds come first (allocator, caches, lazy initialisation). Returns
    {name: [ms of round 0, round 1, ...]}, so entry r of two lists was measured side by side.
    on_round(rounds done, the times so far) after each timed round (progress of long runs).
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for done in range(1, repeats + 1):
        for name, step in steps.items():
            times[name].append(time_once(step, clock, device))
        if on_round is not None:
            on_round(done, times)
    return times


def time_once(step: Callable[[], object], clock: str = "wall",
              device: torch.device | str = "cpu") -> float:
    """Milliseconds of one run of step on `clock` (its device synchronised before and after)."""
    now = time.process_time if clock == "process" else time.perf_counter
    synchronize(device)
    t0 = now()
    step()
    synchronize(device)
    return (now() - t0) * 1e3


def summarize(times: dict[str, list[float]], baseline: str) -> dict[str, dict]:
    """Per entry: median, min, max ms, the runs, and the ratio to the baseline.

    ratio = median / the baseline's median (exactly 1.0 for the baseline); ratio_min and
    ratio_max are the extremes of the per-round ratios (run r over the baseline's run r).
    ratio_paired is the median of those per-round ratios, and ratio_interval
    [low, high, coverage] its distribution-free confidence interval (median_interval; None
    for fewer than two rounds).
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
            "ratio_paired": statistics.median(per_round),
            "ratio_interval": median_interval(per_round),
            "runs_ms": [round(t, 3) for t in ts],
        }
    return out


def median_interval(values: list[float], level: float = 0.95) -> list[float] | None:
    """[low, high, coverage]: a confidence interval for the median of the distribution that
    values were drawn from, assuming only that the draws are independent.

    The k-th smallest and k-th largest value bound the median with probability
    1 - 2 P(Binomial(n, 1/2) < k), whatever the distribution; k is the largest whose
    coverage is at least `level`. Below 6 values no pair reaches 95%: then the extremes
    (k = 1) with their coverage, lower than asked (93.75% for 5). None for fewer than two.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be between 0 and 1, got {level!r}")
    n = len(values)
    if n < 2:
        return None
    ordered = sorted(values)
    # tail = P(Binomial(n, 1/2) <= k - 1) * 2^n, in integers (exact for any n)
    k, tail, term, total = 1, 1, 1, 2 ** n
    while k + 1 <= (n + 1) // 2:
        term = term * (n - k + 1) // k  # comb(n, k)
        wider = tail + term  # the tail for k + 1
        if 1 - 2 * wider / total < level:
            break
        k, tail = k + 1, wider
    return [ordered[k - 1], ordered[n - k], 1 - 2 * tail / total]


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    """The median of each entry's runs."""
    return {name: statistics.median(ts) for name, ts in times.items()}


def time_ms(fn: Callable[[], object], repeats: int, device: torch.device | str) -> float:
    """Median milliseconds of fn() over `repeats` runs after one warm-up run; on CUDA each run
    is timed between two events recorded on the stream, elsewhere with the wall clock."""
    if torch.device(device).type == "cuda":
        return statistics.median(cuda_event_ms(fn, repeats))
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cuda_event_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    """Milliseconds of fn() between two CUDA events recorded on the stream, per repeat, after
    one warm-up run."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times
