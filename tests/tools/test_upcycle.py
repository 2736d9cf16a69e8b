"""Tests of `mhc upcycle`: a tiny residual run converted to hc, mhc and mhc-lite and continued
on two seeds; the conversion preserves the function, the files parse, a rerun skips what is
finished and resumes what is not, and bad input is one line with exit status 2."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from torch_mhc.lm.model import LM, ModelConfig
from torch_mhc.lm.train import build_optimizer, train
from torch_mhc.lm.train.checkpoint import read_run_state
from torch_mhc.tools.cli import main
from torch_mhc.tools.upcycle.source import fresh_optimizer_state, upcycled_model

KINDS = ("hc", "mhc", "mhc-lite")
STEPS = 2


@pytest.fixture(scope="module")
def upcycled(tmp_path_factory, tiny_config_under):
    root = tmp_path_factory.mktemp("upcycle")
    train(tiny_config_under(root, "residual", steps=4, out_dir=str(root / "res")))
    out = root / "up"
    argv = ["upcycle", "--from", str(root / "res"), "--kinds", ",".join(KINDS), "--steps",
            str(STEPS), "--seeds", "2", "--out", str(out), "--eval-every", "0"]
    assert main(argv) == 0
    return root, out, argv


def test_conversion_preserves_the_validation_loss(upcycled):
    _, out, _ = upcycled
    report = json.loads((out / "upcycle.json").read_text())
    rows = report["rows"]
    assert {(r["kind"], r["seed"]) for r in rows} == {
        (k, s) for k in ("residual", *KINDS) for s in report["seeds"]}
    assert len(report["seeds"]) == 2
    ref = report["residual_start_val_loss"]
    assert math.isclose(ref, report["source_val_loss"], rel_tol=1e-4)
    for r in rows:
        assert math.isclose(r["start_val_loss"], ref, rel_tol=1e-4), r
        assert r["steps"] == STEPS and math.isfinite(r["val_loss"]) and r["step_ms"] > 0
        assert (r["max_gain"] is None) == (r["kind"] == "residual")


def test_files_and_paired_statistics(upcycled):
    _, out, _ = upcycled
    report = json.loads((out / "upcycle.json").read_text(),
                        parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))
    assert [p["kind"] for p in report["paired"]] == list(KINDS)
    by_seed = {(r["kind"], r["seed"]): r["val_loss"] for r in report["rows"]}
    for p in report["paired"]:
        assert p["n"] == 2 and math.isfinite(p["ci95"]) and p["ci95"] >= 0
        diffs = [by_seed[p["kind"], s] - by_seed["residual", s] for s in report["seeds"]]
        assert math.isclose(p["delta_mean"], sum(diffs) / 2, rel_tol=1e-9, abs_tol=1e-12)
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "report.md").read_text()
    for kind in KINDS:
        assert f"| {kind} |" in md and f"- {kind}: " in md
    warmup = report["schedule"]["warmup"]
    assert f"after {warmup} warmup step{'' if warmup == 1 else 's'}," in md
    assert f"; seeds {report['seeds'][0]}, {report['seeds'][1]}, the same batches" in md
    assert "-0.0000" not in md
    for kind in ("residual", *KINDS):  # each continuation is a finished `mhc train` run
        state = read_run_state(out / kind / f"seed{report['seeds'][0]}" / "ckpt")
        assert state["step"] == STEPS and state["model_config"]["connection"] == kind


def test_rerun_skips_finished_and_resumes_unfinished(upcycled, capsys):
    _, out, argv = upcycled
    results = sorted(out.glob("*/seed*/result.json"))
    assert len(results) == 2 * (1 + len(KINDS))
    before = {p: p.stat().st_mtime_ns for p in results}
    redo = out / "mhc" / "seed1" / "result.json"
    old = json.loads(redo.read_text())["result"]["val_loss"]
    redo.unlink()
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum("skipped" in line for line in lines) == len(results) - 1
    assert sum("resuming" in line for line in lines) == 1
    assert all(p.stat().st_mtime_ns == t for p, t in before.items() if p != redo)
    assert json.loads(redo.read_text())["result"]["val_loss"] == pytest.approx(old, rel=1e-6)


def test_upcycled_model_computes_the_residual_function():
    torch.manual_seed(0)
    residual = LM(ModelConfig(connection="residual", dim=32, n_layers=2, n_heads=2,
                              max_seq_len=16)).eval()
    idx = torch.randint(0, 256, (2, 16))
    want, _ = residual(idx)
    for kind in ("hc", "mhc", "mhc-lite", "kromhc", "mhc-static-res"):
        got, _ = upcycled_model(residual, kind, 4).eval()(idx)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=kind)


def test_fresh_optimizer_state_moves_nothing():
    from torch_mhc.lm.config import TrainConfig

    model = LM(ModelConfig(connection="mhc", dim=32, n_layers=1, n_heads=2, max_seq_len=16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = build_optimizer(model, TrainConfig(model=model.cfg))
    fresh_optimizer_state(optimizer)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    steps = [s["step"] for s in optimizer.state.values()]
    assert steps and all(float(s) == 0 for s in steps)
    assert all(float(s["exp_avg"].abs().max()) == 0 for s in optimizer.state.values())


def _bad_cases(root, out):
    src = str(root / "res")
    unfinished = root / "unfinished"
    if not unfinished.exists():  # a residual run folder whose checkpoint is at step 0 of 2
        unfinished.mkdir()
        shutil.copytree(out / "residual" / "seed1" / "ckpt.prev", unfinished / "ckpt")
    (root / "empty").mkdir(exist_ok=True)
    return {
        "missing": ["--from", str(root / "nowhere")],
        "not a run": ["--from", str(root / "empty")],
        "another kind": ["--from", str(out / "hc" / "seed1")],
        "unfinished": ["--from", str(unfinished)],
        "unknown kind": ["--from", src, "--kinds", "hc,bogus"],
        "kromhc, 3 streams": ["--from", src, "--kinds", "kromhc", "--streams", "3"],
        "steps 0": ["--from", src, "--steps", "0"],
        "seeds 0": ["--from", src, "--seeds", "0"],
        "streams 0": ["--from", src, "--streams", "0"],
    }


def test_bad_input_is_one_line_and_exit_2(upcycled, capsys):
    root, out, _ = upcycled
    for case, args in _bad_cases(root, out).items():
        argv = ["upcycle", "--steps", "1", "--out", str(root / "bad"), *args]
        capsys.readouterr()
        assert main(argv) == 2, case
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mhc upcycle: error: "), (case, err)
    assert not (root / "bad").exists()  # refused before anything was written


def test_a_comparison_s_folder_points_at_its_residual_run(upcycled, capsys):
    """--from a `mhc compare` folder (one run per kind): the residual run is the one to pass,
    not the first run in it by name."""
    root, _, _ = upcycled
    cmp = root / "cmp"
    if not cmp.exists():
        shutil.copytree(root / "res", cmp / "residual")
        shutil.copytree(root / "res", cmp / "hc")
    assert main(["upcycle", "--from", str(cmp), "--steps", "1", "--out", str(root / "bad2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"mhc upcycle: error: --from {cmp} holds a comparison's runs, not one run: "
                   f"pass its residual run, --from {cmp / 'residual'}")


def test_a_warmup_past_the_steps_is_warned_of(upcycled, capsys):
    """As mhc train and compare warn: the learning rate would never reach its peak. Once,
    when the first continuation starts; an upcycling refused says only why."""
    root, _, _ = upcycled
    capsys.readouterr()
    argv = ["upcycle", "--from", str(root / "res"), "--kinds", "hc", "--warmup", str(STEPS),
            "--out", str(root / "warm"), "--eval-every", "0"]
    assert main([*argv, "--steps", str(STEPS)]) == 0
    err = capsys.readouterr().err
    warning = (f"mhc upcycle: warning: warmup ({STEPS}) >= steps ({STEPS}): the learning rate "
               "rises for the whole run")
    assert err.count(warning) == 1, err
    # the same folder with other settings: refused by its first continuation
    assert main([*argv, "--steps", str(STEPS - 1)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a continuation with other settings" in err[0], err


def test_report_numbers_that_round_to_zero_carry_no_minus():
    from torch_mhc.tools.upcycle import report as upcycle_report

    fmt = upcycle_report._fmt
    assert [fmt(-1e-6, "+.4f"), fmt(-1e-6), fmt(-2e-4, "+.4f"), fmt(float("nan"))] == [
        "+0.0000", "0.0000", "-0.0002", "n/a"]


def test_interrupt_says_how_to_finish(upcycled, tmp_path, capsys, monkeypatch):
    """Ctrl-C in one continuation: exit 130 and a line saying to run it again (the
    trainer's own line names `mhc train --resume`, which would continue that run alone)."""
    from torch_mhc.lm.train import RunInterrupted
    from torch_mhc.tools.upcycle import run as upcycle_run

    _, _, argv = upcycled
    argv = [*argv[:argv.index("--out") + 1], str(tmp_path / "up"),
            *argv[argv.index("--out") + 2:]]

    def interrupted(cfg, corpus=None, on_start=None):
        raise RunInterrupted("interrupted after step 1; checkpoint x, which `mhc train "
                             "--resume` continues", 1, "x")

    monkeypatch.setattr(upcycle_run, "train", interrupted)
    capsys.readouterr()
    assert main(argv) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("mhc upcycle: interrupted in ") and last.endswith(
        "after step 1; run the same `mhc upcycle` again to finish: it skips the "
        "finished runs and resumes this one")
