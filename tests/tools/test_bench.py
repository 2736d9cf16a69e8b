"""The benchmark suite: its plumbing, and the values it reports that do not depend on timing.

No timing thresholds: timed figures are only checked to be positive and consistent (the
baseline's ratio is exactly 1, shared measurements agree).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os

import pytest
import torch

from torch_mhc.tools.bench import suite as bench
from torch_mhc.tools.bench import workloads
from torch_mhc.tools.bench.timing import (
    median_interval,
    medians,
    summarize,
    time_interleaved,
    time_ms,
)
from torch_mhc.tools.bench.workloads import saved_bytes
from torch_mhc.tools.cli import main


def bench_main(argv: list[str]) -> int:
    """`mhc bench ARGV`."""
    return main(["bench", *argv])


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "out.json"
    assert bench_main(["--quick", "--threads", "1", "--clock", "process", "--json",
                       str(path)]) == 0
    files = sorted(p.name for p in path.parent.iterdir())
    assert files == ["out.json"], files  # the atomic write leaves no temporary file behind
    return json.loads(path.read_text())


def _bench_script(name: str):
    """benchmarks/<name>.py, loaded as a module (the scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# Timing and counting helpers


def test_time_interleaved_runs_round_robin_after_warmup():
    calls = []
    steps = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    times = time_interleaved(steps, repeats=3, warmup=2, clock="process")
    assert calls == ["a", "b"] * 5
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for ts in times.values() for t in ts)
    with pytest.raises(ValueError, match="clock must be one of"):
        time_interleaved(steps, 1, clock="cpu")
    with pytest.raises(ValueError, match="repeats must be an integer >= 1, got 0"):
        time_interleaved(steps, 0)
    seen = []  # on_round: after each timed round, with the times so far
    time_interleaved(steps, 2, warmup=1, clock="process",
                     on_round=lambda done, t: seen.append((done, len(t["a"]), len(t["b"]))))
    assert seen == [(1, 1, 1), (2, 2, 2)]


def test_time_ms_warms_up_once_then_takes_the_median():
    calls = []
    ms = time_ms(lambda: calls.append(1), repeats=4, device="cpu")
    assert len(calls) == 5 and ms >= 0
    assert medians({"a": [3.0, 1.0, 2.0], "b": [5.0]}) == {"a": 2.0, "b": 5.0}


def test_summarize_medians_and_per_round_ratios():
    s = summarize({"base": [1.0, 2.0, 4.0], "x": [2.0, 6.0, 4.0]}, "base")
    assert s["base"]["ratio"] == 1.0
    assert (s["base"]["ratio_min"], s["base"]["ratio_max"]) == (1.0, 1.0)
    assert s["x"]["median_ms"] == 4.0 and s["x"]["ratio"] == 2.0  # 4 / 2
    assert (s["x"]["ratio_min"], s["x"]["ratio_max"]) == (1.0, 3.0)  # 2/1, 6/2, 4/4
    assert (s["x"]["min_ms"], s["x"]["max_ms"]) == (2.0, 6.0)
    with pytest.raises(ValueError, match="baseline 'y' is not among"):
        summarize({"x": [1.0]}, "y")
    # the paired figures: the median of 2/1, 6/2, 4/4 and its interval (3 rounds: the
    # extremes, which hold the median with probability 1 - 2 / 8)
    assert s["x"]["ratio_paired"] == 2.0
    assert s["x"]["ratio_interval"] == [1.0, 3.0, 0.75]
    assert s["base"]["ratio_paired"] == 1.0
    assert summarize({"a": [1.0]}, "a")["a"]["ratio_interval"] is None


def median_interval_naive(values, level):
    """The order-statistic interval written out: coverage(k) = P(X_(k) <= median <= X_(n+1-k))
    = sum over j = k .. n - k of C(n, j) / 2^n (j: how many draws fall below the median)."""
    n = len(values)
    ordered = sorted(values)
    best = 1
    for k in range(1, (n + 1) // 2 + 1):
        if sum(math.comb(n, j) for j in range(k, n - k + 1)) / 2 ** n >= level:
            best = k
    cover = sum(math.comb(n, j) for j in range(best, n - best + 1)) / 2 ** n
    return [ordered[best - 1], ordered[n - best], cover]


@pytest.mark.parametrize("level", [0.5, 0.9, 0.95, 0.99])
def test_median_interval_matches_the_plain_reference(level):
    gen = torch.Generator().manual_seed(3)
    for n in range(2, 80):
        values = torch.rand(n, generator=gen).tolist()
        got, want = median_interval(values, level), median_interval_naive(values, level)
        assert got[:2] == want[:2], n
        assert got[2] == pytest.approx(want[2], rel=1e-12), n
        if n >= 6 and level <= 0.95:
            assert got[2] >= level, n  # 6 draws or more reach 95%
    assert median_interval(list(range(5)), 0.95) == [0, 4, 1 - 2 / 32]  # below 95%: said
    assert median_interval([7.0]) is None and median_interval([]) is None
    with pytest.raises(ValueError, match="level must be between 0 and 1"):
        median_interval([1.0, 2.0], 1.0)
    big = median_interval(list(range(2001)))  # exact integers: no overflow
    assert big[0] < 1000 < big[1] and 0.95 <= big[2] < 0.96


def test_median_interval_covers_the_median_as_often_as_it_says():
    # A skewed distribution (exponential, median log 2), 15 draws per interval: the stated
    # coverage (96.5%) is the frequency with which the interval holds the true median.
    gen = torch.Generator().manual_seed(0)
    trials, held = 4000, 0
    for _ in range(trials):
        draws = torch.empty(15).exponential_(generator=gen).tolist()
        low, high, coverage = median_interval(draws)
        held += low <= math.log(2) <= high
    sd = math.sqrt(coverage * (1 - coverage) / trials)
    assert abs(held / trials - coverage) < 4 * sd, (held / trials, coverage)


def test_saved_bytes_counts_distinct_storages_and_excludes():
    x = torch.randn(5, 7, requires_grad=True)
    w = torch.randn(7, requires_grad=True)
    nbytes, out = saved_bytes(lambda: x * w)  # mul saves both operands
    assert nbytes == (5 * 7 + 7) * 4 and out.shape == (5, 7)
    assert saved_bytes(lambda: x * w, exclude=[w])[0] == 5 * 7 * 4
    assert saved_bytes(lambda: x * x)[0] == 5 * 7 * 4  # one storage saved twice counts once
    assert saved_bytes(lambda: x + w)[0] == 0  # add saves nothing


def test_lucidrains_model_reuses_the_residual_lm_blocks():
    pytest.importorskip("hyper_connections")
    ours = workloads.build_model("residual", 32, 2, 4, 16)
    theirs = workloads.build_model("lucidrains_mhc", 32, 2, 4, 16)
    # Same seed, same construction order: the wrapped branches hold the residual LM's weights.
    for i, block in enumerate(ours.blocks):
        for mine, wrapped in ((block.attn.branch, theirs.attn[i].branch),
                              (block.mlp.branch, theirs.mlp[i].branch)):
            for (name, p), (name2, q) in zip(mine.named_parameters(),
                                             wrapped.named_parameters(), strict=True):
                assert name == name2
                torch.testing.assert_close(q, p, rtol=0, atol=0)
    torch.testing.assert_close(theirs.tok_emb.weight, ours.tok_emb.weight, rtol=0, atol=0)
    # It trains: every parameter, the wrappers' own included, receives a gradient.
    idx = workloads.random_tokens(2, 17)
    workloads.train_step(theirs, idx)()  # runs, drops the gradients
    _, loss = theirs(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert all(p.grad is not None for p in theirs.parameters())


# ---------------------------------------------------------------------------------------------
# The quick suite


def test_quick_report_has_every_benchmark(quick_report):
    assert list(quick_report["benchmarks"]) == list(bench.BENCHMARKS)
    meta = quick_report["meta"]
    assert meta["threads"] == 1 and meta["clock"] == "process" and meta["quick"] is True
    assert meta["command"].startswith("mhc bench --quick")


def test_reports_name_the_cpu_they_ran_on(quick_report):
    """The report's CPU is /proc/cpuinfo's model name where there is one, and the markdown's
    first line names it (a report without it, as older JSON, still renders)."""
    from pathlib import Path

    from torch_mhc.tools.bench import report

    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in
             (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    meta = quick_report["meta"]
    if names:
        assert meta["cpu"] == names[0]
    first = report.markdown(quick_report).splitlines()[0]
    assert (f"{meta['cpu']} ({meta['cpu_count']} cores)" in first) == bool(meta["cpu"])
    older = {**quick_report, "meta": {k: v for k, v in meta.items() if k != "cpu"}}
    assert "cores)" not in report.markdown(older).splitlines()[0]


def _positive_ratios(entries: dict, baseline: str):
    assert entries[baseline]["ratio"] == 1.0  # exactly: its median over itself
    for name, e in entries.items():
        assert e["ratio"] > 0 and e["median_ms"] > 0, name
        assert e["min_ms"] <= e["median_ms"] <= e["max_ms"], name
        assert e["ratio_min"] <= e["ratio_max"], name


def test_quick_step_and_hyper_connections(quick_report):
    pytest.importorskip("hyper_connections")
    b = quick_report["benchmarks"]
    step, hc = b["step"], b["hyper_connections"]
    assert step["config"]["optimizer"] == "excluded"
    for res in step["results"]:
        assert list(res["entries"]) == ["residual", "hc", "mhc"]
        _positive_ratios(res["entries"], "residual")
    assert hc["config"]["hyper_connections_version"]
    for res, res_step in zip(hc["results"], step["results"], strict=True):
        assert list(res["entries"]) == ["residual", "mhc", "lucidrains_mhc"]
        _positive_ratios(res["entries"], "residual")
        # One shared measurement: the residual and our mHC are the very same runs.
        assert res["entries"]["mhc"] == res_step["entries"]["mhc"]


def test_step_times_the_successors_beside_mhc(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert bench_main(["--only", "step", "--sizes", "32", "--layers", "1", "--batch", "1",
                       "--seq", "16", "--repeats", "1", "--warmup", "0", "--successors",
                       "--threads", "1", "--clock", "process", "--json", str(path)]) == 0
    (res,) = json.loads(path.read_text())["benchmarks"]["step"]["results"]
    assert list(res["entries"]) == ["residual", "hc", "mhc", *bench.SUCCESSORS]
    _positive_ratios(res["entries"], "residual")
    # a progress line per round: each kind's ratio to the residual in that round
    line = next(x for x in capsys.readouterr().err.splitlines() if "round 1/1" in x)
    head, _, tail = line.partition(", ")
    assert head == "[bench] training step d=32: round 1/1"
    assert [item.rsplit(" ", 1)[0] for item in tail.split(", ")] == list(res["entries"])[1:]
    from torch_mhc.tools.bench.step import _round_ratios

    assert _round_ratios({"residual": [9.0, 2.0], "mhc": [1.0, 2.5], "hc": [1.0, 3.0]}) == \
        "mhc 1.250x, hc 1.500x"  # the last round's


def test_quick_saved_bytes_match_what_recomputation_keeps(quick_report):
    s = quick_report["benchmarks"]["saved"]
    cfg, e = s["config"], s["entries"]
    assert e["residual"]["ratio"] == 1.0
    assert e["mhc+recompute"]["bytes_per_token_per_connection"] < e["mhc"][
        "bytes_per_token_per_connection"
    ]
    # With recomputation the connections' own saves are replaced by what the groups keep:
    # the group input (n C per group) and every branch output (C per connection), so the
    # excess over the residual is (groups * n + L) * C * 4 bytes over L connections.
    n, c, conns = cfg["streams"], cfg["dim"], cfg["connections"]
    residual = e["residual"]["bytes_per_token_per_connection"]
    for k, entry in s["mhc_recompute_by_interval"].items():
        groups = math.ceil(conns / int(k))
        want = residual + (groups * n + conns) * c * 4 / conns
        assert entry["bytes_per_token_per_connection"] == pytest.approx(want, rel=1e-12), k
    opt = s["mhc_recompute_by_interval"][str(cfg["recompute_interval"])]
    assert opt["bytes_per_token_per_connection"] == e["mhc+recompute"][
        "bytes_per_token_per_connection"
    ]


def test_quick_sinkhorn_agrees_and_saves_only_the_logits(quick_report):
    s = quick_report["benchmarks"]["sinkhorn"]
    for res in s["results"]:
        t, n, _ = res["shape"]
        e = res["entries"]
        _positive_ratios(e, "unrolled")
        for name in ("sinkhorn", "ops.cpu"):
            assert e[name]["max_abs_diff"] < 1e-5, name
            assert e[name]["saved_bytes"] == t * n * n * 4, name  # the fp32 logits, once
        # The unrolled loop keeps every iterate: 20 iterations, several [T, n, n] each.
        assert e["unrolled"]["saved_bytes"] > 20 * t * n * n * 4


def test_quick_decode(quick_report):
    d = quick_report["benchmarks"]["decode"]
    assert [r["batch"] for r in d["results"]] == [1, 2]
    for res in d["results"]:
        e = res["entries"]
        _positive_ratios(e, "residual")
        assert e["residual"]["tokens_per_s_ratio"] == 1.0
        for v in ("residual", "hc", "mhc"):
            assert e[v]["tokens_per_s"] > 0 and e[v]["prefill_median_ms"] > 0
            want = res["batch"] * d["config"]["new_tokens"] / e[v]["median_ms"] * 1e3
            assert e[v]["tokens_per_s"] == pytest.approx(want, rel=1e-12)
            # the interleaved one-token steps: every step after the prefill, once per build
            assert e[v]["steps"] == (d["config"]["new_tokens"] - 1) * d["config"]["builds"]
            want = res["batch"] / e[v]["step_median_ms"] * 1e3
            assert e[v]["step_tokens_per_s"] == pytest.approx(want, rel=1e-12)
            ratio = e[v]["step_tokens_per_s"] / e["residual"]["step_tokens_per_s"]
            assert e[v]["step_tokens_per_s_ratio"] == pytest.approx(ratio, rel=1e-12)
            # paired step by step: the interval holds its median, with its coverage
            low, high, coverage = e[v]["step_tokens_per_s_ratio_interval"]
            assert low <= e[v]["step_tokens_per_s_ratio_paired"] <= high
            assert 0.95 <= coverage < 1
        assert e["residual"]["step_tokens_per_s_ratio_interval"] == [1.0, 1.0, coverage]


def test_saved_bytes_are_deterministic_across_calls(quick_report, capsys):
    # A second call, JSON on stdout this time (followed by the markdown tables).
    assert bench_main(["--quick", "--only", "saved,sinkhorn"]) == 0
    out = capsys.readouterr().out
    report, end = json.JSONDecoder().raw_decode(out)
    assert "### saved" in out[end:] and "### sinkhorn" in out[end:]
    assert list(report["benchmarks"]) == ["saved", "sinkhorn"]
    first = quick_report["benchmarks"]
    assert report["benchmarks"]["saved"]["entries"] == first["saved"]["entries"]
    for a, b in zip(report["benchmarks"]["sinkhorn"]["results"], first["sinkhorn"]["results"],
                    strict=True):
        assert ({k: v["saved_bytes"] for k, v in a["entries"].items()}
                == {k: v["saved_bytes"] for k, v in b["entries"].items()})


# ---------------------------------------------------------------------------------------------
# Bad input and the optional dependency


@pytest.mark.parametrize("argv, needle", [
    (["--only", "step,nope"], "unknown benchmark(s) ['nope']"),
    (["--sizes", "256,x"], "comma-separated integers"),
    (["--sizes", "0"], "integers >= 1"),
    (["--repeats", "0"], "integer >= 1"),
    (["--impl", "gpu"], "unknown op implementation 'gpu'"),
    (["--streams", "1"], "--streams must be >= 2"),
])
def test_bad_arguments_exit_2_with_a_message(argv, needle, capsys):
    assert bench_main(["--quick", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_hyper_connections_skipped_when_missing(monkeypatch, capsys):
    monkeypatch.setattr(workloads, "hyper_connections_version", lambda: None)
    assert bench_main(["--quick", "--only", "hyper_connections"]) == 0
    out = capsys.readouterr().out
    report, end = json.JSONDecoder().raw_decode(out)
    skipped = report["benchmarks"]["hyper_connections"]["skipped"]
    assert "pip install -e '.[bench]' in the torch-mhc checkout" in skipped
    assert "Skipped:" in out[end:]


def test_native_kernels_script_subtracts_the_eviction_time(capsys):
    """benchmarks/bench_native_kernels.py --evict: each kernel's figure minus the timed
    eviction alone, and every kernel of the table present."""

    from torch_mhc.ops.cpu import native

    if native.load() is None:
        pytest.skip("native CPU library unavailable")
    module = _bench_script("bench_native_kernels")
    assert module.main(["--tokens", "32", "--dim", "16", "--repeats", "1", "--evict", "1"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[: out.index("\n| kernel")])
    evict = result["median_ms"].pop("writing the eviction buffer alone")
    minus = result["median_minus_eviction_ms"]
    assert set(minus) == set(result["median_ms"]) and "maps_bwd (+ aggregation, linked)" in minus
    for name, ms in result["median_ms"].items():
        assert minus[name] == pytest.approx(ms - evict)
    with pytest.raises(SystemExit):
        module.main(["--evict", "-1"])


def test_decode_pools_rounds_over_builds_in_rotated_order(monkeypatch):
    """Each build times every variant; the rounds of all builds are pooled, and every build
    puts another variant first."""
    from torch_mhc.tools.bench import decode as decode_bench

    built = []
    real_build = decode_bench.build_model

    def build(kind, *args, **kwargs):
        built.append(kind)
        return real_build(kind, *args, **kwargs)

    monkeypatch.setattr(decode_bench, "build_model", build)
    out = decode_bench.bench_decode(dim=16, layers=1, batches=(1,), prompt=4, new_tokens=3,
                                    repeats=2, warmup=0, builds=3, clock="process")
    assert built == ["residual", "hc", "mhc", "hc", "mhc", "residual", "mhc", "residual", "hc"]
    assert out["config"]["builds"] == 3
    for e in out["results"][0]["entries"].values():
        assert len(e["runs_ms"]) == 6
    with pytest.raises(ValueError, match="builds must be >= 1"):
        decode_bench.bench_decode(builds=0)


def test_decode_steps_after_any_warmup_fit_the_cache():
    """The warm-up steps rewrite the positions the timed steps use: warm-ups beyond one do
    not run past the cache (prompt + new_tokens positions)."""
    from torch_mhc.tools.bench.decode import time_decode_steps
    from torch_mhc.tools.bench.workloads import build_model, random_tokens

    model = build_model("mhc", 16, 1, 4, 8 + 4).eval()
    times = time_decode_steps({"mhc": model}, random_tokens(1, 8), 4, 3, "process", "cpu")
    assert len(times["mhc/step"]) == 3 and all(t > 0 for t in times["mhc/step"])


def test_ops_benchmark_times_the_successors_beside_mhc(capsys):
    """mhc bench --ops --kinds: one entry per implementation and kind, each successor's row
    given as a ratio to the same implementation's mHC; an unknown kind is refused."""
    from torch_mhc.tools.bench import ops as ops_bench

    result = ops_bench.measure(["reference", "cpu"], tokens=8, streams=4, dim=16, repeats=1,
                               warmup=0, kinds=("mhc", "kromhc", "mhc-static-res"))
    med = result["median_ms"]
    assert set(med) == {"reference", "cpu", "reference kromhc", "cpu kromhc",
                        "reference mhc-static-res", "cpu mhc-static-res", "residual"}
    table = ops_bench.markdown(result)
    row = next(line for line in table.splitlines() if line.startswith("| cpu kromhc |"))
    assert row.split("|")[-2].strip() == f"{med['cpu kromhc'] / med['cpu']:.3f}"
    rows = [line.split("|")[1].strip() for line in table.splitlines()[2:]]
    assert rows == ["reference mhc", "cpu mhc", "reference kromhc", "cpu kromhc",
                    "reference mhc-static-res", "cpu mhc-static-res", "residual x + f"]
    with pytest.raises(ValueError, match="argument --kinds: expected names from mhc, hc, "
                                         "mhc-lite.* got 'mhc,mhc-heavy'"):
        ops_bench._names("--kinds", ["mhc,mhc-heavy"], ops_bench.OP_KINDS)


@pytest.mark.parametrize("tokens", [6, 32])
@pytest.mark.parametrize("kind", ["hc", "mhc", "kromhc"])
def test_connection_step_gradients_match_the_reference_ops(kind, tokens):
    """The connection step `mhc bench --ops` times (HC's included) gives every input the
    gradients the reference ops give on the same inputs (32 tokens: HC's native passes; 6:
    its torch path, whose merge writes its own part of dx), each run anew, and --kinds takes
    hc."""
    from tests.helpers.op_cases import TOL, assert_close
    from torch_mhc.tools.bench import ops as ops_bench
    from torch_mhc.tools.bench.workloads import connection_step

    steps = {impl: connection_step(impl, tokens, 4, 16, torch.float32, "cpu", kind)
             for impl in ("reference", "cpu")}
    for step in steps.values():
        step()
    for ref, got in zip(steps["reference"].leaves, steps["cpu"].leaves, strict=True):
        if ref is None:
            assert got is None
            continue
        assert got.grad is not None and torch.equal(got.detach(), ref.detach())
        assert_close(got.grad, ref.grad, TOL[torch.float32])
    # a second run starts from no gradients: the same ones again, not their sum
    first = [t.grad.clone() for t in steps["cpu"].leaves if t is not None]
    steps["cpu"]()
    for before, t in zip(first, [t for t in steps["cpu"].leaves if t is not None], strict=True):
        assert_close(t.grad, before, TOL[torch.float32])
    assert ops_bench._names("--kinds", ["mhc,hc", "kromhc", "hc"], ops_bench.OP_KINDS) == [
        "mhc", "hc", "kromhc"]


@pytest.mark.parametrize("calls, frozen", [("library", False), ("ctypes", True)])
def test_decode_in_situ_script_parts_nest_and_the_patches_come_off(capsys, calls, frozen):
    """benchmarks/bench_decode_in_situ.py: every mHC call takes the prepared native calls
    (the library's, or ctypes' with --calls ctypes; inside a frozen_connections block with
    --frozen), each part lies within the one around it, and the library, the Decoder and
    the Connection are restored."""

    from torch_mhc.connections import Connection, base
    from torch_mhc.ops.cpu import decode, native

    lib = native.load()
    if lib is None:
        pytest.skip("native CPU library unavailable")
    module = _bench_script("bench_decode_in_situ")
    before = (decode.Decoder.mix_in, decode.Decoder.mix_out, lib.decoding_calls(),
              Connection.__dict__["_prepared_decoder"])
    threads = torch.get_num_threads()
    try:  # two rounds: each median is then a mean, so the sums below compare as the parts do
        assert module.main(["--kinds", "mhc", "--batch", "2", "--dim", "16", "--layers", "1",
                            "--prompt", "4", "--steps", "3", "--rounds", "2",
                            "--calls", calls, *(["--frozen"] if frozen else [])]) == 0
    finally:
        torch.set_num_threads(threads)
    assert (decode.Decoder.mix_in, decode.Decoder.mix_out, lib.decoding_calls(),
            Connection.__dict__["_prepared_decoder"]) == before
    assert not getattr(base._FROZEN, "open", None)  # the block, if any, closed
    out = capsys.readouterr().out
    results = json.loads(out[: out.index("\n| kind")])["results"]
    assert list(results) == ["residual", "mhc"]
    res, mhc = results["residual"], results["mhc"]
    assert res["connections"] == mhc["connections"] == 2
    assert res["prepared_calls_per_step"] == 0 and mhc["prepared_calls_per_step"] == 2
    assert res["us_per_call"]["mix_in"] == 0 and res["us_per_call"]["native merge"] == 0
    assert res["us_per_call"]["lookup"] == 0  # the residual has no prepared path
    u = mhc["us_per_call"]
    assert 0 < u["native maps"] <= u["mix_in"] and 0 < u["native merge"] <= u["mix_out"]
    assert 0 < u["lookup"]
    assert u["lookup"] + u["mix_in"] + u["mix_out"] <= mhc["connection_minus_branch_us"]
    with pytest.raises(SystemExit):
        module.main(["--steps", "0"])


def test_decode_paths_script_runs_a_second_build_of_the_kernels(tmp_path, capsys):
    """benchmarks/bench_decode_paths.py --against SOURCE: the extra model's prepared calls
    run the library built from SOURCE (same values), and a source whose call block differs
    is refused with the reason."""
    import ctypes

    from torch_mhc.connections import ManifoldHyperConnection, base
    from torch_mhc.ops.cpu import build, native

    if native.load() is None or build._compiler() is None:
        pytest.skip("native CPU library unavailable")
    module = _bench_script("bench_decode_paths")
    other = module._library_from(str(build.SOURCE), str(tmp_path))
    torch.manual_seed(0)
    conn = ManifoldHyperConnection(16, 4, 0, torch.nn.Linear(16, 16), impl="cpu")
    twin = ManifoldHyperConnection(16, 4, 0, torch.nn.Linear(16, 16), impl="cpu")
    twin.load_state_dict(conn.state_dict())
    module._built_from(twin, other)
    x = torch.randn(2, 1, 4, 16)
    with torch.no_grad():
        assert torch.equal(twin(x), conn(x))
    (dec,) = [d for d in base._DECODERS[id(twin)].values() if d is not None]
    assert dec._lib is other
    assert dec._call.maps == ctypes.cast(other._lib.decode_maps, ctypes.c_void_p).value
    bad = tmp_path / "old.c"  # a library without the block's entry points (before 90c52e6)
    bad.write_text("void decode_maps(void) {}\n")
    (tmp_path / "old").mkdir()  # another file name: dlopen hands back a loaded one by name
    with pytest.raises(SystemExit, match="decode_call block is not this library's"):
        module._library_from(str(bad), str(tmp_path / "old"))


def test_profile_step_ops_script_counts_each_connections_ops_per_step(tmp_path, capsys):
    """benchmarks/profile_step_ops.py: per kind and step, one native maps and merge call
    (forward and backward) per connection, none for the residual; the table shows them."""

    from torch_mhc.ops.cpu import native

    if native.load() is None:
        pytest.skip("native CPU library unavailable")
    module = _bench_script("profile_step_ops")
    threads = torch.get_num_threads()
    try:
        assert module.main(["--dim", "16", "--layers", "2", "--batch", "2", "--seq", "8",
                            "--steps", "2", "--warmup", "1", "--top", "3",
                            "--json", str(tmp_path / "p.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    report = json.loads(out[: out.index("\n| op |")])
    assert report == json.loads((tmp_path / "p.json").read_text())
    res, mhc = (report["self_ms_and_calls_per_step"][k] for k in ("residual", "mhc"))
    for op in ("maps_fwd", "maps_bwd", "post_merge_fwd", "post_merge_bwd"):
        name = f"torch_mhc::cpu_{'mhc_' if op.startswith('maps') else ''}{op}"
        assert mhc[name][1] == 4 and name not in res  # 2 blocks x 2 connections, each step
        row = next(line for line in out.splitlines() if line.startswith(f"| {name} |"))
        assert row.endswith(f"| {mhc[name][0]:.1f} (4) |")
    with pytest.raises(SystemExit):
        module.main(["--steps", "0"])


def test_profile_decode_call_script_profiles_one_call(tmp_path, capsys):
    """benchmarks/profile_decode_call.py: per impl, the time of one no-grad call on one token
    and the profiled ops per call (the reference's Sinkhorn once a call, its loop's column and
    row sums 2 iters - 1 times); the JSON printed is the one written."""
    module = _bench_script("profile_decode_call")  # (no --threads: torch's own stay)
    assert module.main(["--impls", "reference", "--dim", "16", "--calls", "5", "--rounds", "2",
                        "--profiled", "3", "--top", "50", "--json", str(tmp_path / "d.json")]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[: out.index("\n### reference")])
    assert report == json.loads((tmp_path / "d.json").read_text())
    ref = report["results"]["reference"]
    timing = ref["us_per_call"]
    assert 0 < timing["min"] <= timing["median"] <= timing["max"]
    calls = {name: count for name, _, _, _, count in ref["ops"]}
    assert calls["_Sinkhorn"] == 1
    assert calls["aten::sum"] >= 2 * 20 - 1  # the default 20 iterations
    with pytest.raises(SystemExit):
        module.main(["--calls", "0"])


def test_decode_call_times_the_prepared_path_or_the_ops_path(monkeypatch):
    """"cpu" calls the connection (its prepared native calls, every call), "cpu/ops" its ops
    (never the prepared calls); a bad suffix is refused, and no_launches refuses to stand in
    for kernels the interpreter does not run."""
    from torch_mhc.ops.cpu import decode, native
    from torch_mhc.tools.bench.decode_call import no_launches, profile_call

    if native.load() is None:
        pytest.skip("native CPU library unavailable")
    prepared = []
    mix_in = decode.Decoder.mix_in
    monkeypatch.setattr(decode.Decoder, "mix_in",
                        lambda self, x: (prepared.append(1), mix_in(self, x))[1])
    counts = {}
    for impl in ("cpu", "cpu/ops"):
        prepared.clear()
        profile_call("mhc", impl, 16, 4, "cpu", torch.float32, calls=3, rounds=2, profiled=2)
        counts[impl] = len(prepared)
    assert counts == {"cpu": 3 + 2 * 3 + 2, "cpu/ops": 0}  # warm-up, rounds, profiled
    with pytest.raises(ValueError, match="NAME/ops, got 'cpu/fast'"):
        profile_call("mhc", "cpu/fast", 16, 4, "cpu", torch.float32)
    if importlib.util.find_spec("triton") is not None and "TRITON_INTERPRET" not in os.environ:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"), no_launches():
            pass


def test_decode_call_keeps_the_kernels_beside_the_host_rows():
    """A kernel's profiler row has device time and no host time: the table keeps the rows of
    most host time and, beside them, those of most device time."""
    from torch_mhc.tools.bench.decode_call import kept_rows

    host = [[f"op{i}", 1.0, 10.0 + i, 0.0, 1] for i in range(5)]
    kernels = [[f"kernel{i}", 0.0, 0.0, 1.0 + i, 1] for i in range(5)]
    launcher = [["custom_op", 5.0, 50.0, 3.0, 1]]  # host time and its kernels' device time
    rows = kept_rows(host + kernels + launcher, top=2)
    assert [r[0] for r in rows] == ["custom_op", "op4", "kernel4", "kernel3"]


def test_profile_step_ops_script_interleaves_the_kinds(monkeypatch):
    """The kinds' steps run warm-ups first, then one profiled step of every kind a round, the
    order rotated each round (a kind profiled after the others showed slower elementwise ops)."""
    module = _bench_script("profile_step_ops")
    calls = []

    def fake_train_step(model, idx):
        kind = model.cfg.connection
        return lambda: calls.append((kind, torch.autograd.profiler._is_profiler_enabled))

    monkeypatch.setattr(module, "train_step", fake_train_step)
    result = module.profile(["residual", "mhc", "hc"], 16, 1, 1, 4, steps=3, warmup=1)
    assert calls == [("residual", False), ("mhc", False), ("hc", False),
                     ("residual", True), ("mhc", True), ("hc", True),
                     ("mhc", True), ("hc", True), ("residual", True),
                     ("hc", True), ("residual", True), ("mhc", True)]
    assert set(result) == {"residual", "mhc", "hc"}


def test_native_builds_script_reads_a_commits_source_and_refuses_a_wrong_one(capsys):
    """benchmarks/bench_native_builds.py: --against REV builds native.c as git has it at REV;
    a revision git does not know is refused, naming it, before anything is built."""
    import subprocess
    from pathlib import Path

    repo = Path(__file__).parents[2]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                          text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    module = _bench_script("bench_native_builds")
    committed = subprocess.run(["git", "show", "HEAD:src/torch_mhc/ops/cpu/native.c"],
                               cwd=repo, capture_output=True, text=True, check=True).stdout
    assert module._source_at(head.stdout.strip()) == committed
    assert "maps_bwd" in committed
    with pytest.raises(SystemExit, match="no-such-rev"):
        module.main(["--against", "no-such-rev"])
    assert "building" not in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.main(["--against", "HEAD", "--repeats", "1"])
    assert "--repeats >= 2, got 2048, 512, 1, 8, 1" in capsys.readouterr().err


def test_native_builds_script_builds_with_other_flags_in_place_of_the_librarys(monkeypatch,
                                                                              capsys, tmp_path):
    """--with-cflags: a build of this checkout's source with the flags added, a define it names
    taking the place of the library's own define of that name (not both on one command line);
    nothing to time against is refused before anything is built."""
    from torch_mhc.ops.cpu import build

    module = _bench_script("bench_native_builds")
    with pytest.raises(SystemExit):
        module.main([])
    assert "--against REV or --with-cflags" in capsys.readouterr().err
    commands = []
    monkeypatch.setattr(build, "_compiler", lambda: ["cc"])
    monkeypatch.setattr(build, "FLAGS", ["-O3"])
    monkeypatch.setattr(build, "OPENMP", [])
    monkeypatch.setattr(build, "tuning_flags", lambda: ["-DTORCH_MHC_SKINNY_W=16", "-DKEEP=1"])
    monkeypatch.setattr(build, "_compile", lambda command, flags, lib, src: commands.append(
        flags))
    monkeypatch.setattr(module.native, "NativeOps", lambda path: path)
    module._build("int x;", ["-DTORCH_MHC_SKINNY_W=8", "-mno-avx512f"], tmp_path, "b")
    module._build("int x;", ["-D", "KEEP=2"], tmp_path, "c")
    assert commands == [["-O3", "-DKEEP=1", "-DTORCH_MHC_SKINNY_W=8", "-mno-avx512f"],
                        ["-O3", "-DTORCH_MHC_SKINNY_W=16", "-D", "KEEP=2"]]
    # main: this checkout's source once as it is, once with each --with-cflags (after
    # --cflags), each with its own flags
    built = []

    def stop_after_two(source, flags, out_dir, name):
        built.append((source == build.SOURCE.read_text(), flags))
        if len(built) == 2:
            raise SystemExit("stop")
    monkeypatch.setattr(module, "_build", stop_after_two)
    with pytest.raises(SystemExit, match="stop"):
        module.main(["--cflags=-O2", "--with-cflags=-DA=1 -DB"])
    assert built == [(True, ["-O2"]), (True, ["-O2", "-DA=1", "-DB"])]


def test_native_builds_table_gives_each_interval_its_coverage():
    """Five rounds cannot give a 95% interval: the table says what each interval covers."""
    from torch_mhc.tools.bench.timing import summarize

    module = _bench_script("bench_native_builds")
    times = {"this checkout": [1.0, 1.1, 1.2, 1.3, 1.4], "b": [2.0, 2.1, 2.3, 2.6, 2.9]}
    table = module._table(summarize(times, "this checkout"), "maps forward, cflags none")
    lines = table.splitlines()
    assert lines[0].startswith("| build (maps forward, cflags none) |")
    assert lines[2] == "| this checkout | 1.200 | 1.000-1.400 | 1.000 (1.000-1.000, 94%) |"
    assert lines[3].startswith("| b | 2.300 | 2.000-2.900 | ")
    assert lines[3].endswith(", 94%) |")


def test_native_builds_script_runs_the_model_step_on_each_build_and_restores_the_library():
    """benchmarks/bench_native_builds.py --pass step: each entry runs the mHC model's training
    step with its own build as the library every pass calls, and the library loaded before
    is the one native.load() returns afterwards."""
    from torch_mhc.ops.cpu import native

    lib = native.load()
    if lib is None:
        pytest.skip("native CPU library unavailable")
    module = _bench_script("bench_native_builds")

    class Counting:  # the library, counting the passes called through it
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):
            attr = getattr(lib, name)
            if name in ("maps_fwd", "maps_bwd", "merge_fwd", "merge_bwd"):
                self.calls.append(name)
            return attr

    a, b = Counting(), Counting()
    times = module._time_restoring(lambda: module._model_steps({"a": a, "b": b}, 16, 1), 2,
                                   "process")
    assert native.load() is lib
    assert {name: len(ts) for name, ts in times.items()} == {"a": 2, "b": 2}
    # one block: two connections, each with its maps and merge forward and backward, in the
    # two warm-up and two timed steps of each entry
    for c in (a, b):
        assert sorted(set(c.calls)) == ["maps_bwd", "maps_fwd", "merge_bwd", "merge_fwd"]
        assert len(c.calls) == 4 * 2 * 4

    # --pass connection: one connection, forward and backward, per run
    a, b = Counting(), Counting()
    module._time_restoring(lambda: module._connection_steps({"a": a, "b": b}, "mhc", 8, 16),
                           3, "process")
    assert native.load() is lib
    for c in (a, b):  # 2 warm-up and 3 timed runs
        assert sorted(c.calls) == sorted(["maps_bwd", "maps_fwd", "merge_bwd", "merge_fwd"] * 5)


def test_connection_calls_script_compares_both_and_restores_the_dispatch_check(capsys):
    """benchmarks/bench_connection_calls.py: both comparisons with their entries (the C
    layout loops checked equal to torch's copies before timing), native_call's dispatch check
    put back afterwards, bad counts refused with the values named."""
    from torch_mhc.ops.cpu import native
    from torch_mhc.ops.cpu import ops as cpu

    if native.load() is None:
        pytest.skip("native CPU library unavailable")
    module = _bench_script("bench_connection_calls")
    check = cpu.dispatch_mode_active
    assert module.main(["--tokens", "4", "--calls", "2", "--repeats", "2"]) == 0
    assert cpu.dispatch_mode_active is check
    out = capsys.readouterr().out
    results = json.loads(out[: out.index("\n| comparison")])["results"]
    assert {name: set(entries) for name, entries in results.items()} == {
        "connection forward + backward, 4 tokens": {"custom ops", "direct"},
        "maps backward's layout copies (K = 2048, M = 24)": {"torch copies", "C loops"},
    }
    for entries in results.values():
        assert all(len(e["runs_ms"]) == 2 and e["min_ms"] > 0 for e in entries.values())
    with pytest.raises(SystemExit):
        module.main(["--repeats", "1"])
    assert "--repeats >= 2, got 8, 200, 1, 1" in capsys.readouterr().err


def test_ops_benchmark_lists_take_spaces_commas_and_repeats():
    """mhc bench --ops: --impls and --kinds take names space- or comma-separated, a repeated
    option adds to its list, each name is kept once, and the defaults fill in."""
    from torch_mhc.tools.bench import ops as ops_bench

    parser = argparse.ArgumentParser()
    ops_bench.add_arguments(parser)
    args = parser.parse_args(["--impls", "cpu", "--impls", "reference,cpu", "--kinds", "hc",
                              "mhc,kromhc"])
    ops_bench.check_arguments(args)
    assert args.impls == ["cpu", "reference"] and args.kinds == ("hc", "mhc", "kromhc")
    args = parser.parse_args([])
    ops_bench.check_arguments(args)
    assert args.impls == ["reference", "cpu"] and args.kinds == ("mhc",)


@pytest.mark.parametrize("module", ["suite", "ops"])
def test_bench_help_gives_every_valued_options_default(module):
    """Every option of `mhc bench` (and of `--ops`) that takes a value says in its help what
    it defaults to; flags and options with no default (--json) need not."""
    import importlib

    parser = argparse.ArgumentParser()
    importlib.import_module(f"torch_mhc.tools.bench.{module}").add_arguments(parser)
    missing = [
        a.option_strings[-1] for a in parser._actions
        if a.nargs != 0 and a.option_strings and a.dest not in ("json", "help")
        and "default" not in (a.help or "")
    ]
    assert missing == []


def test_step_memory_script_reads_each_variants_memory_after_every_step(capsys):
    """benchmarks/bench_step_memory.py: each variant in a process of its own, its resident
    memory after every step and its peak; bad sizes refused."""
    module = _bench_script("bench_step_memory")
    assert module.main(["--dim", "16", "--layers", "2", "--seq", "8", "--batch", "2",
                        "--steps", "2"]) == 0
    out = capsys.readouterr().out
    results = json.loads(out[: out.index("\n| variant")])["results"]
    assert list(results) == ["residual", "mhc", "mhc+recompute"]
    for r in results.values():
        assert len(r["after_step_mib"]) == 2
        assert 0 < r["before_mib"] <= r["peak_mib"] and max(r["after_step_mib"]) <= r["peak_mib"]
        assert r["growth_per_step_mib"] == r["after_step_mib"][1] - r["after_step_mib"][0]
    with pytest.raises(SystemExit):
        module.main(["--steps", "1"])
