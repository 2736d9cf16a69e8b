"""benchmarks/gpu_check.py (tools.bench.gpu_check): the one command prepared for the first GPU.

Its dry run (tiny shapes, CPU tensors, Triton's interpreter) runs here so that the script
cannot rot: every section must run without error and the correctness check must pass.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_mhc.tools.bench import gpu_check

ROOT = Path(__file__).resolve().parents[2]
CASES = ("large", "nan_fill", "params", "compile", "contexts", "eps", "far_logits")
OP_NAMES = ["mhc_maps_fwd", "mhc_maps_bwd", "pre_aggregate_fwd", "pre_aggregate_bwd",
            "post_merge_fwd", "post_merge_bwd", "sinkhorn_fwd", "sinkhorn_bwd",
            "mhc_maps_pre_bwd", "post_merge_bwd_no_dx"]
# What a CPU cannot run, recorded as skipped rows with their reason.
GPU_ONLY = {"CUDA graph", "non-default stream"}


def _assert_the_cases_ran(sections, cases=CASES):
    """Every case section passed with a value per row; only the GPU-only rows skipped."""
    for name in cases:
        res = sections[name]["result"]
        assert res["all_pass"] is True, (name, res)
        for r in res["rows"]:
            if "skipped" in r:
                assert r["case"] in GPU_ONLY and r["skipped"] == "needs a CUDA device", r
                continue
            assert r["pass"] and r["worst_over_tol"] <= 1, r
            assert isinstance(r["max_rel_err"], float) and set(r["errors"]) == set(r["tols"]), r
    cases_of = {name: {r["case"] for r in sections[name]["result"]["rows"]} for name in cases}
    assert cases_of["contexts"] == {"autocast float16", "non-contiguous (strided)",
                                    "non-contiguous (transposed)", "non-contiguous (expanded)",
                                    "non-default stream"}
    assert cases_of["far_logits"] == {"far logits (far)", "far logits (mixed)"}
    assert cases_of["compile"] == {"torch.compile(fullgraph=True)", "CUDA graph"}
    far = sections["far_logits"]["result"]["rows"]
    assert all(r["log_domain_fraction"] > 0 for r in far)
    assert {r["log_domain_fraction"] for r in far if "far)" in r["case"]} == {1.0}
    eps = sections["eps"]["result"]["rows"]
    assert {r["op"] for r in eps} == {"mhc_maps", "sinkhorn"} and all(r["deterministic"]
                                                                      for r in eps)
    large = sections["large"]["result"]["rows"]
    assert sections["large"].get("process", "own (isolated)") == "own (isolated)"
    assert {r["case"] for r in large} == {"> 2^31 elements (first tokens)",
                                          "> 2^31 elements (last tokens)"}
    assert all(r["finite_everywhere"] for r in large)


@pytest.mark.slow
def test_dry_run_writes_every_section(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run",
         "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["meta"]["dry_run"] is True
    sections = report["sections"]
    assert list(sections) == list(gpu_check.SECTIONS)
    for name, sec in sections.items():
        assert "error" not in sec and "skipped" not in sec, (name, sec)
    rows = [r for name in ("correctness", "correctness_rest")
            for r in sections[name]["result"]["rows"]]
    assert {r["op"] for r in rows} == {"mhc_maps", "pre_aggregate", "post_merge", "sinkhorn"}
    assert {(r["dtype"], r["n"]) for r in rows} == {(d, n) for d in ("float32", "float16")
                                                    for n in (2, 4)}
    assert all(r["pass"] and r["worst_over_tol"] <= 1 and r["deterministic"] for r in rows), rows
    _assert_the_cases_ran(sections)
    kernels = sections["kernels"]["result"]["rows"]
    # mHC's ops, and at its n = 4 every successor's maps (their launches, ops/triton/aot.py)
    successors = {f"variant_maps_{way}:{kind}" for way in ("fwd", "bwd")
                  for kind in ("mhc-lite", "kromhc", "mhc-static-res")}
    assert {r["op"] for r in kernels} == set(OP_NAMES) | successors
    assert all("error" not in r and r["method"] == "wall" for r in kernels), kernels
    assert all(r["ms"] > 0 and r["bytes"] > 0 and r["fraction_of_copy"] > 0 for r in kernels)
    step = sections["step"]["result"]["entries"]
    assert set(step) == {"residual", "hc", "mhc", "mhc+recompute"}
    assert step["residual"]["ratio"] == 1.0 and step["mhc"]["ratio"] > 0
    # one connection's decoding call per impl: its time, and the reference's Sinkhorn among
    # its profiled ops (once a call)
    call = sections["decode"]["result"]["call"]
    assert set(call) == {"cpu", "cpu/ops", "reference"}
    # the prepared decoding path gives the ops' bits, each kind and batch
    equal = sections["decode"]["result"]["prepared_equal"]
    assert {(r["kind"], r["batch"]) for r in equal} == {
        (k, b) for k in ("mhc", "mhc-lite", "kromhc", "mhc-static-res") for b in (1, 8)}
    assert all(r["prepared"] and r["equal"] and r["max_abs_diff"] == 0.0 for r in equal), equal
    for r in call.values():
        assert 0 < r["us_per_call"]["min"] <= r["us_per_call"]["median"] <= r["us_per_call"]["max"]
    assert ["_Sinkhorn", 1.0] in [[row[0], row[4]] for row in call["reference"]["ops"]]
    md = (tmp_path / "gpu_check.md").read_text()
    for name in gpu_check.SECTIONS:
        assert f"## {name}" in md
    assert "### reference: " in md and "One mHC connection's call on one token" in md
    assert "The prepared decoding path against the ops' path" in md


def test_a_decoding_call_that_fails_keeps_the_decode_sections_other_results():
    """An impl whose call profile fails is recorded with its error; the tokens/s and the other
    impl's profile stay, and the markdown shows the error under the impl's heading."""
    from torch_mhc.tools.bench.gpu_check import perf
    from torch_mhc.tools.bench.gpu_check.report import _section_lines

    cfg = {"device": "cpu", "decode": dict(dim=16, layers=1, batches=(1,), prompt=2,
                                           new_tokens=2,
                                           call=dict(impls=("reference", "nope"), calls=2,
                                                     rounds=1, profiled=1, top=3))}
    res = perf.bench_decode(cfg, torch.float32)
    assert res["results"][0]["entries"]["mhc"]["tokens_per_s"] > 0
    assert res["call"]["reference"]["us_per_call"]["median"] > 0
    assert res["call"]["nope"]["error"].startswith("UnknownImplError: unknown op implementation")
    md = "\n".join(_section_lines("decode", res))
    assert "### nope: UnknownImplError: " in md and "### reference: " in md


def test_a_failing_section_is_recorded_and_the_others_run(tmp_path, monkeypatch):
    def broken(cfg):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(gpu_check, "bench_sinkhorn", broken)
    monkeypatch.setattr(gpu_check, "bench_kernels", lambda cfg: {"rows": []})
    report = gpu_check.run(str(tmp_path), dry_run=True, only=("sinkhorn", "kernels"))
    assert "kernel exploded" in report["sections"]["sinkhorn"]["error"]
    assert report["sections"]["kernels"]["result"] == {"rows": []}
    on_disk = json.loads((tmp_path / "gpu_check.json").read_text())
    assert on_disk["sections"]["sinkhorn"]["error"] == report["sections"]["sinkhorn"]["error"]
    assert "kernel exploded" in (tmp_path / "gpu_check.md").read_text()


def test_the_time_budget_skips_later_sections(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "bench_kernels", lambda cfg: {"rows": []})
    report = gpu_check.run(str(tmp_path), budget_s=0.0, dry_run=True, only=("kernels",))
    assert "time budget" in report["sections"]["kernels"]["skipped"]


def test_needs_a_gpu_without_dry_run(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="needs a CUDA device.*--dry-run"):
        gpu_check.run(str(tmp_path))
    assert not (tmp_path / "gpu_check.json").exists()


def test_mhc_bench_gpu_aot_and_ops_hand_over_their_options(monkeypatch):
    from torch_mhc.ops.triton import aot as triton_aot
    from torch_mhc.tools.bench import ops
    from torch_mhc.tools.cli import main

    seen = {}
    monkeypatch.setattr(gpu_check, "run_command", lambda args: seen.setdefault("gpu", args) and 3)
    monkeypatch.setattr(triton_aot, "run_command", lambda args: seen.setdefault("aot", args) and 4)
    monkeypatch.setattr(ops, "run_command", lambda args: seen.setdefault("ops", args) and 5)
    assert main(["bench", "--gpu", "--dry-run", "--out", "x"]) == 3
    assert main(["bench", "--aot", "--n", "2"]) == 4
    assert main(["bench", "--threads", "1", "--ops"]) == 5  # a switch anywhere on the line
    assert vars(seen["gpu"]) == {"out": "x", "budget_s": 270.0, "dry_run": True,
                                 "only": gpu_check.SECTIONS, "plan": False}
    assert seen["aot"].n == (2,) and seen["aot"].cc == triton_aot.FULL["cc"]
    assert seen["ops"].threads == 1 and seen["ops"].impls == ["reference", "cpu"]


def test_bench_tools_report_bad_options_in_one_line(capsys):
    from torch_mhc.tools.cli import main

    assert main(["bench", "--gpu", "--dry-run", "--only", "kernels,nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu_check: error: --only: unknown sections ['nope']")
    assert err.count("\n") == 1 and err.endswith("(see gpu_check --help)\n"), err
    assert main(["bench", "--aot", "--dtypes", "fp64"]) == 2
    assert "error: --dtypes: expected some of" in capsys.readouterr().err
    assert main(["bench", "--ops", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: mhc bench --ops")
    for bad, message in ((["--tokens", "-5"], "argument --tokens: expected an integer >= 1, "
                                              "got '-5'"),
                         (["--streams", "0"], "argument --streams: expected an integer >= 1"),
                         (["--profile", "--repeats", "0"], "argument --repeats: expected"),
                         (["--impls", "cpu", "nope"], "argument --impls: expected names from "
                          "reference, cpu, triton, inductor (space- or comma-separated), got "
                          "'cpu nope'"),
                         (["--kinds", "mhc,bogus"], "argument --kinds: expected names from mhc, "
                                                    "hc, "),
                         (["--profile", "--kinds", "hc"], "--profile times the cpu ops' mHC "
                                                          "passes; it takes no --kinds")):
        assert main(["bench", "--ops", *bad]) == 2, bad
        err = capsys.readouterr().err
        assert err.startswith("mhc bench --ops: error: ") and message in err, err
        assert err.count("\n") == 1, err


def test_the_triton_tools_name_the_missing_extra(monkeypatch, capsys):
    """Without triton, `mhc bench --aot`, `--ops --impls triton` and the bytes model's table
    say what to install instead of raising ModuleNotFoundError."""
    import importlib.util
    import runpy

    from torch_mhc.tools.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else find_spec(name, *a))
    assert main(["bench", "--aot", "--n", "2"]) == 2
    assert ("the ahead-of-time compile check needs triton (pip install -e '.[triton]' in the "
            "torch-mhc checkout"
            in capsys.readouterr().err)
    assert main(["bench", "--ops", "--impls", "triton"]) == 2
    assert "--impls triton needs triton (pip install" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("torch_mhc.ops.triton.traffic", run_name="__main__")
    assert exit_.value.code == 2
    assert "the bytes model of the Triton kernels needs triton" in capsys.readouterr().err


def test_plan_lists_the_cases_without_a_gpu(capsys):
    from torch_mhc.tools.cli import main

    assert main(["bench", "--gpu", "--plan"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan == json.loads(json.dumps(gpu_check.PLAN))
    assert plan[0]["n"] == [2, 3, 4, 5, 8, 12, 16] and plan[0]["implemented"] is True
    text = json.dumps(plan)
    for part in ("determinism", "2^31", "NaN", "CUDA-graph", "autocast", "L2", "eps > 0"):
        assert part in text, part
    for case in plan:  # what the dry run cannot run says why
        assert set(case) >= {"case", "implemented", "dry_run_skip", "section"}
    assert all(case["implemented"] is True for case in plan), plan
    sections = {s.strip() for case in plan for s in case["section"].split(",")}
    assert sections - {"every check section"} == set(gpu_check.SECTIONS)


# ---------------------------------------------------------------------------------------------
# The case sections in this process, with the reference ops standing in for the kernels
# ---------------------------------------------------------------------------------------------


def _exact(fn, same_dtype):
    """fn computed in float32 whatever autocast says, as the kernels (the maps on x and phi
    in the autocast dtype, as the triton maps' autocast rule hands them); the result cast back
    to the first input's dtype where the op's contract keeps it (aggregation, merge, Sinkhorn)."""
    import torch

    def run(*args, **kwargs):
        if not same_dtype and torch.is_autocast_enabled("cpu"):
            dt = torch.get_autocast_dtype("cpu")
            args = (args[0].to(dt), args[1].to(dt), *args[2:])
        with torch.autocast("cpu", enabled=False):
            out = fn(*(a.float() if isinstance(a, torch.Tensor) else a for a in args), **kwargs)
        return out.to(args[0].dtype) if same_dtype else out

    return run


def _stand_in(monkeypatch, **broken):
    """ops.get_impl("triton") as the reference computed in fp32 (within every tolerance), with
    the ops named in `broken` replaced."""
    import dataclasses

    from torch_mhc import ops

    real = ops.get_impl
    ref = real("reference")
    fake = dataclasses.replace(
        ref, name="triton", mhc_maps=_exact(ref.mhc_maps, False),
        pre_aggregate=_exact(ref.pre_aggregate, True),
        post_merge=_exact(ref.post_merge, True), sinkhorn=_exact(ref.sinkhorn, True))
    fake = dataclasses.replace(fake, **{k: v(getattr(fake, k)) for k, v in broken.items()})

    def get_impl(name="auto", device=None, dtype=None):
        return fake if name == "triton" else real(name, device, dtype)

    monkeypatch.setattr(ops, "get_impl", get_impl)
    monkeypatch.setitem(gpu_check.DRY, "isolated", ())  # the stand-in lives in this process


def test_every_case_reports_values_in_json_and_markdown(tmp_path, monkeypatch):
    _stand_in(monkeypatch)
    report = gpu_check.run(str(tmp_path), dry_run=True, only=CASES)
    _assert_the_cases_ran(report["sections"])
    on_disk = json.loads((tmp_path / "gpu_check.json").read_text())
    assert on_disk["sections"]["eps"]["result"] == report["sections"]["eps"]["result"]
    md = (tmp_path / "gpu_check.md").read_text()
    for part in ("## far_logits", "far logits (mixed)", "> 2^31 elements (last tokens)",
                 "non-contiguous (expanded)", "skipped: needs a CUDA device", "worst_over_tol"):
        assert part in md, part


def test_a_wrong_map_fails_its_rows_and_the_command(tmp_path, monkeypatch):
    """H_res off by 1% (well past 2e-5): every mhc_maps row fails, naming h_res."""
    def wrong(maps):
        def run(*args, **kwargs):
            h_pre, h_post, h_res = maps(*args, **kwargs)
            return h_pre, h_post, h_res * 1.01
        return run

    _stand_in(monkeypatch, mhc_maps=wrong)
    only = ("correctness", "params", "eps", "far_logits")
    report = gpu_check.run(str(tmp_path), dry_run=True, only=only)
    for name in only:
        rows = report["sections"][name]["result"]["rows"]
        assert report["sections"][name]["result"]["all_pass"] is False
        for r in rows:
            if r["op"] == "mhc_maps" and r["case"] != "eps > 0, only H_post used":
                assert not r["pass"] and r["errors"]["h_res"] > r["tols"]["h_res"], r
            else:  # the other ops, and H_post alone, are right
                assert r["pass"], r
    args = argparse.Namespace(out=str(tmp_path), budget_s=270.0, dry_run=True,
                              only=("eps",), plan=False)
    assert gpu_check.run_command(args) == 1
    assert "| False |" in (tmp_path / "gpu_check.md").read_text()


def test_the_large_case_catches_an_error_in_the_last_tokens_only(tmp_path, monkeypatch):
    """As an offset overflowing past 2^31 elements would: the last token's merge is wrong."""
    def last_token_wrong(merge):
        def run(*args):
            out = merge(*args)
            return out.index_fill(0, out.new_tensor([out.shape[0] - 1], dtype=int), 0.0)
        return run

    _stand_in(monkeypatch, post_merge=last_token_wrong)
    rows = gpu_check.run(str(tmp_path), dry_run=True, only=("large",))["sections"]["large"]
    failed = {(r["op"], r["case"]) for r in rows["result"]["rows"] if not r["pass"]}
    assert failed == {("post_merge", "> 2^31 elements (last tokens)")}


def test_an_error_in_one_case_is_recorded_and_the_next_case_runs(tmp_path, monkeypatch):
    def raises(op):
        def run(*args, **kwargs):
            raise RuntimeError("launch failed")
        return run

    _stand_in(monkeypatch, sinkhorn=raises)
    rows = gpu_check.run(str(tmp_path), dry_run=True, only=("eps",))["sections"]["eps"]
    rows = rows["result"]["rows"]
    assert all("launch failed" in r["error"] for r in rows if r["op"] == "sinkhorn")
    assert all(r["pass"] for r in rows if r["op"] == "mhc_maps")


def test_cases_past_the_budget_are_skipped_with_the_reason(tmp_path, monkeypatch):
    _stand_in(monkeypatch)
    cfg = {**gpu_check.DRY, "deadline": 0.0}
    res = gpu_check.check_eps(cfg)
    assert res["rows"] and all(r["skipped"] == "time budget spent" for r in res["rows"])
    assert res["all_pass"] is True  # nothing ran, nothing failed: the report lists them


def test_a_crashed_isolated_section_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    def crashed(cmd, **kwargs):
        assert kwargs["env"][gpu_check.CHILD_ENV] == "1" and cmd[-1] == "--dry-run"
        return subprocess.CompletedProcess(cmd, -11, "", "an illegal memory access")

    monkeypatch.setattr(gpu_check.subprocess, "run", crashed)
    monkeypatch.setattr(gpu_check, "bench_kernels", lambda cfg: {"rows": []})
    report = gpu_check.run(str(tmp_path), dry_run=True, only=("large", "kernels"))
    assert "exited with -11" in report["sections"]["large"]["error"]
    assert "an illegal memory access" in report["sections"]["large"]["error"]
    assert report["sections"]["kernels"]["result"] == {"rows": []}


def test_tolerances_are_the_kernel_tests_per_output():
    import torch

    from torch_mhc.tools.bench.gpu_check.checks import tolerances

    bf16, f32 = torch.bfloat16, torch.float32
    x, h = torch.zeros(2, 4, 8, dtype=bf16), torch.zeros(2, 4)
    # out and x's gradient at bf16's resolution; the fp32 map's gradient at fp32's (the
    # kernels compute in fp32); an implementation computing in bf16 at bf16's for all.
    assert tolerances("pre_aggregate", [x, h]) == [1.6e-2, 1.6e-2, 2e-5]
    assert tolerances("pre_aggregate", [x, h], impl="inductor") == [1.6e-2] * 3
    params = [torch.zeros(32, 24, dtype=dt) for dt in (f32, bf16)]
    # maps 2e-3 (TF32 for half streams), x 1.6e-2, parameters max(2e-3, their dtype's)
    assert tolerances("mhc_maps", [x, *params]) == [2e-3] * 3 + [1.6e-2, 2e-3, 1.6e-2]
    assert tolerances("mhc_maps", [x.float(), params[0]]) == [2e-5] * 3 + [2e-5, 1e-4]
