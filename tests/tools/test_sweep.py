"""Tests of `mhc sweep` (the smoke preset and smaller grids): the cells it records, the files
it writes, resuming, interruption, divergence as a result, and bad input."""

from __future__ import annotations

import json
import math

import pytest

from torch_mhc.tools.cli import main
from torch_mhc.tools.sweep import run as sweep_run
from torch_mhc.tools.sweep.grid import PRESETS, Cell

FIELDS = ("kind", "n_layers", "lr", "seed", "diverged", "val_loss", "max_gain", "step_ms")


def flags(root, out) -> list[str]:
    return ["sweep", "--out", str(out), "--data", str(root / "corpus.txt"), "--cache-dir",
            str(root / "cache"), "--val-fraction", "0.1", "--device", "cpu", "--dtype", "fp32",
            "--no-tensorboard", "--no-progress"]


def strict_json(path):
    def refuse(token):
        raise ValueError(f"non-finite {token} in {path}")

    return json.loads(path.read_text(), parse_constant=refuse)


def checkpoint_mtimes(out) -> dict[str, int]:
    return {str(p.relative_to(out)): p.stat().st_mtime_ns
            for p in (out / "cells").rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, corpus_writer):
    root = tmp_path_factory.mktemp("sweep")
    corpus_writer(root / "corpus.txt")
    out = root / "out"
    assert main([*flags(root, out), "--preset", "smoke"]) == 0
    return root, out


def test_smoke_sweep_writes_cells_report_and_heatmaps(smoke):
    _, out = smoke
    grid = PRESETS["smoke"]["grid"]
    cells = strict_json(out / "sweep.json")["cells"]
    assert len(cells) == len(grid["kinds"]) * len(grid["depths"]) * len(grid["lrs"])
    assert {(c["kind"], c["n_layers"], c["lr"]) for c in cells} == {
        (k, d, lr) for k in grid["kinds"] for d in grid["depths"] for lr in grid["lrs"]}
    for c in cells:
        for key in FIELDS:
            assert key in c, key
        assert c["diverged"] is False and math.isfinite(c["val_loss"]) and c["step_ms"] > 0
        assert (c["max_gain"] is None) == (c["kind"] == "residual")
        assert (out / "cells" / Cell.of(c).name / "ckpt").is_dir()
    for name in ("heatmap_loss.png", "heatmap_gain.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert "# mhc sweep (preset smoke, modified)" in report  # --data and others changed it
    for kind in grid["kinds"]:
        assert f"## {kind}" in report
    assert not list(out.glob(".*.tmp"))


def test_rerun_skips_every_finished_cell(smoke, capsys):
    root, out = smoke
    before = checkpoint_mtimes(out)
    cells = strict_json(out / "sweep.json")["cells"]
    capsys.readouterr()
    assert main([*flags(root, out), "--preset", "smoke"]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].startswith(
        f"sweep (smoke, modified): {len(cells)} cells, 0 to run, {len(cells)} recorded; "
        f"1 job, into {out}")
    assert printed.count("skipped (recorded in sweep.json)") == len(cells)
    assert f"0 cells run, {len(cells)} skipped" in printed
    assert checkpoint_mtimes(out) == before
    assert strict_json(out / "sweep.json")["cells"] == cells


def test_rerun_with_other_settings_is_refused(smoke, capsys):
    root, out = smoke
    assert main([*flags(root, out), "--preset", "smoke", "--steps", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other settings (differing: steps)" in err[0]


def test_interrupted_sweep_keeps_finished_cells(tmp_path, corpus, monkeypatch, capsys):
    from torch_mhc.lm.train import RunInterrupted

    out = tmp_path / "out"
    argv = [*flags(tmp_path, out), "--preset", "smoke", "--kinds", "residual,mhc",
            "--depths", "1", "--lrs", "0.003,0.03"]
    real, calls = sweep_run.run_cell, []

    def interrupting(cfg, corpus=None):
        calls.append(cfg.out_dir)
        if len(calls) == 3:  # as the trainer stops: its message names `mhc train --resume`
            raise RunInterrupted("interrupted after step 2; checkpoint x, which `mhc train "
                                 "--resume` continues", 2, "x")
        return real(cfg, corpus)

    monkeypatch.setattr(sweep_run, "run_cell", interrupting)
    capsys.readouterr()
    assert main(argv) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "mhc sweep: interrupted in cell residual-L1-lr0.03-s0 after step 2; run the same "
        "`mhc sweep` again to finish: it skips the finished cells and resumes this one")
    kept = strict_json(out / "sweep.json")["cells"]
    assert [Cell.of(c).name for c in kept] == [
        "residual-L1-lr0.003-s0", "mhc-L1-lr0.003-s0"]
    monkeypatch.setattr(sweep_run, "run_cell", real)
    assert main(argv) == 0
    cells = strict_json(out / "sweep.json")["cells"]
    assert len(cells) == 4 and cells[:2] == kept


def test_divergence_is_a_result(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    argv = [*flags(tmp_path, out), "--preset", "smoke", "--kinds", "hc", "--depths", "1",
            "--lrs", "0.003,1e3"]
    assert main(argv) == 0
    cells = {c["lr"]: c for c in strict_json(out / "sweep.json")["cells"]}
    assert cells[1e3]["diverged"] is True and cells[1e3]["val_loss"] is None
    assert "stopped" in cells[1e3]["stopped"]
    assert cells[0.003]["diverged"] is False and cells[0.003]["val_loss"] > 0
    assert "| hc | L1: 1000 |" in (out / "report.md").read_text()
    assert "hc-L1-lr1000.0-s0: diverged after" in capsys.readouterr().out


def test_two_jobs(tmp_path, corpus):
    out = tmp_path / "out"
    argv = [*flags(tmp_path, out), "--preset", "smoke", "--kinds", "residual,hc",
            "--depths", "1", "--lrs", "0.03", "--jobs", "2", "--quiet"]
    assert main(argv) == 0
    cells = strict_json(out / "sweep.json")["cells"]
    assert sorted(c["kind"] for c in cells) == ["hc", "residual"]
    assert all(not c["diverged"] for c in cells)
    assert (out / "heatmap_loss.png").is_file()


@pytest.mark.parametrize("extra, message", [
    (["--kinds", ","], "empty grid: no kinds"),
    (["--kinds", "residual,nope"], "unknown kind(s) nope"),
    (["--kinds", "kromhc", "--streams", "3"], "kind kromhc cannot run with streams = 3"),
    (["--depths", "0"], "depths must be integers >= 1"),
    (["--depths", "two"], "argument --depths"),
    (["--lrs", "0"], "lrs must be finite numbers > 0"),
    (["--lrs", "nan"], "lrs must be finite numbers > 0"),
    (["--lrs", "1e-3,inf"], "lrs must be finite numbers > 0"),
    (["--seeds", "0"], "seeds must be an integer >= 1"),
    (["--jobs", "0"], "jobs must be an integer >= 1"),
    (["--kinds", "hc,hc"], "kinds lists a value twice"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, corpus, capsys, extra, message):
    out = tmp_path / "out"
    assert main([*flags(tmp_path, out), "--preset", "smoke", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mhc sweep: error:"), err
    assert message in err[0]
    assert not out.exists()


def test_out_is_a_file(tmp_path, corpus, capsys):
    out = tmp_path / "file"
    out.write_text("x")
    assert main([*flags(tmp_path, out), "--preset", "smoke"]) == 2
    assert "exists and is a file" in capsys.readouterr().err


def test_gain_heatmap_labels_its_log_colour_bar_plainly(monkeypatch):
    """The log colour bar of heatmap_gain.png reads 2, 4, 6 (matplotlib wrote 2 x 10^0), and
    the figure's title sits above the panels' titles."""
    from torch_mhc.tools.sweep import report

    figures = []
    monkeypatch.setattr(report, "figure_png", lambda fig: figures.append(fig) or b"")
    table = {"hc": {(1, 0.003): {"gain": 1.01, "diverged": False},
                    (1, 0.03): {"gain": 9.5, "diverged": False}},
             "mhc": {(1, 0.003): {"gain": 1.0, "diverged": False},
                     (1, 0.03): {"gain": 1.0, "diverged": False}}}
    report.heatmap_png(table, "gain", "max composite Amax gain", log=True)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figures[0]
    FigureCanvasAgg(fig).draw()
    bar = fig.axes[-1]  # the colour bar's axes, added last
    labels = [t.get_text() for t in bar.get_yticklabels(minor=True) + bar.get_yticklabels()
              if t.get_text()]
    assert labels and all("times" not in t and "^" not in t for t in labels)
    renderer = fig.canvas.get_renderer()
    top = fig._suptitle.get_window_extent(renderer)
    for ax in fig.axes[:-1]:
        assert top.y0 >= ax.title.get_window_extent(renderer).y1
