"""benchmarks/gpu_check.py (tools.bench.gpu_check): the one command prepared for the first GPU.

Its dry run (tiny shapes, CPU tensors, Triton's interpreter) runs here so that the script
cannot rot: every section must run without error and the correctness check must pass.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torch_mhc.tools.bench import gpu_check

ROOT = Path(__file__).resolve().parents[2]


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
    rows = sections["correctness"]["result"]["rows"]
    assert {r["op"] for r in rows} == {"mhc_maps", "pre_aggregate", "post_merge", "sinkhorn"}
    assert all(r["pass"] and r["worst_over_tol"] <= 1 and r["deterministic"] for r in rows), rows
    kernels = sections["kernels"]["result"]["rows"]
    assert len({r["kernel"] for r in kernels}) == 9
    assert all(r["ms"] > 0 and r["bytes"] > 0 and r["fraction_of_copy"] > 0 for r in kernels)
    step = sections["step"]["result"]["entries"]
    assert set(step) == {"residual", "hc", "mhc", "mhc+recompute"}
    assert step["residual"]["ratio"] == 1.0 and step["mhc"]["ratio"] > 0
    md = (tmp_path / "gpu_check.md").read_text()
    for name in gpu_check.SECTIONS:
        assert f"## {name}" in md


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


def test_bench_tools_report_bad_options_with_their_usage(capsys):
    from torch_mhc.tools.cli import main

    assert main(["bench", "--gpu", "--dry-run", "--only", "kernels,nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: gpu_check")
    assert "gpu_check: error: --only: unknown sections ['nope']" in err
    assert main(["bench", "--aot", "--dtypes", "fp64"]) == 2
    assert "error: --dtypes: expected some of" in capsys.readouterr().err
    assert main(["bench", "--ops", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: mhc bench --ops")


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
        assert set(case) >= {"case", "implemented", "dry_run_skip"}
