"""Tests of `mhc compare` (tiny preset): the files it writes and what they hold."""

from __future__ import annotations

import json
import math
import struct
import zlib

import pytest

from torch_mhc.lm.train import ConfigError, load_checkpoint
from torch_mhc.tools.cli import main
from torch_mhc.tools.compare.run import PRESETS, compare, preset_config

FIGURES = ("loss_curves.png", "grad_norm.png", "composite_gain.png", "gain_over_training.png",
           "health.png")


def read_png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG, after checking its signature and the IHDR chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    body = data[16:16 + length]
    (crc,) = struct.unpack(">I", data[16 + length:20 + length])
    assert zlib.crc32(kind + body) == crc
    assert data[-12:] == b"\x00\x00\x00\x00IEND\xaeB`\x82"
    return struct.unpack(">II", body[:8])


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory, corpus_writer):
    root = tmp_path_factory.mktemp("compare")
    corpus = corpus_writer(root / "corpus.txt")
    out = root / "out" / "nested"  # created if missing
    argv = ["compare", "--out", str(out), "--preset", "tiny", "--data", str(corpus),
            "--cache-dir", str(root / "cache"), "--val-fraction", "0.1", "--quiet",
            "--no-progress", "--no-tensorboard", "--device", "cpu", "--dtype", "fp32"]
    assert main(argv) == 0
    return out, json.loads((out / "report.json").read_text())


def test_peak_memory_does_not_depend_on_the_order_of_the_kinds(tiny_report, tmp_path,
                                                               corpus_writer):
    """Each kind's one-time costs in a process (its first step, the first checkpoint) are
    paid in a warm-up: the kind run first measured about 2 MiB more than run later."""
    corpus = corpus_writer(tmp_path / "corpus.txt")
    first, _ = tiny_report  # residual, hc, mhc
    argv = ["compare", "--out", str(tmp_path / "reversed"), "--preset", "tiny", "--data",
            str(corpus), "--cache-dir", str(tmp_path / "cache"), "--val-fraction", "0.1",
            "--quiet", "--no-progress", "--no-tensorboard", "--device", "cpu", "--dtype",
            "fp32", "--kinds", "mhc,hc,residual"]
    assert main(argv) == 0

    def peaks(folder):
        report = json.loads((folder / "report.json").read_text())
        return {v["kind"]: v["peak_mem_bytes"] / 2**20 for v in report["variants"]}

    a, b = peaks(first), peaks(tmp_path / "reversed")
    assert a.keys() == b.keys() == {"residual", "hc", "mhc"}
    assert all(abs(a[k] - b[k]) < 1.0 for k in a), (a, b)  # MiB
    assert not (first / ".warmup").exists() and not (tmp_path / "reversed" / ".warmup").exists()


def test_compare_writes_all_files(tiny_report):
    out, _ = tiny_report
    for name in ("report.json", "report.md", *FIGURES):
        assert (out / name).is_file(), name
    for name in FIGURES:
        width, height = read_png_size((out / name).read_bytes())
        assert width > 200 and height > 200
    for kind in ("residual", "hc", "mhc"):
        state = load_checkpoint(out / kind)
        assert state["model_config"]["connection"] == kind
        assert state["step"] == PRESETS["tiny"]["steps"]
        assert (out / kind / "metrics.jsonl").is_file()
    assert not list(out.glob(".*.tmp"))  # no temp file left behind


def test_report_json_contents(tiny_report):
    _, report = tiny_report
    assert report["preset"] == "tiny, modified"  # the data and a few flags were changed
    variants = {v["kind"]: v for v in report["variants"]}
    assert list(variants) == ["residual", "hc", "mhc"]
    steps = PRESETS["tiny"]["steps"]
    for kind, v in variants.items():
        for key in ("val_loss", "val_bpb", "tokens_per_s", "peak_mem_bytes", "step_time_ratio",
                    "max_composite_gain_fwd", "max_composite_gain_bwd", "params",
                    "connection_params"):
            assert key in v, (kind, key)
        assert v["steps_completed"] == steps and v["diverged"] is None
        assert v["val_bpb"] == pytest.approx(v["val_loss"] / math.log(2), rel=1e-12)
        assert 0 < v["val_loss"] < v["loss_history"][0]  # it learned something
        assert len(v["loss_history"]) == len(v["grad_norm_history"]) == steps
        assert v["tokens_per_s"] > 0 and v["peak_mem_bytes"] >= 0
    res, hc, mhc = variants["residual"], variants["hc"], variants["mhc"]
    # same seed, same first batch, and every connection starts as the residual network
    assert hc["loss_history"][0] == pytest.approx(res["loss_history"][0], abs=1e-5)
    assert mhc["loss_history"][0] == pytest.approx(res["loss_history"][0], abs=1e-5)
    assert res["step_time_ratio"] == 1.0
    assert hc["step_time_ratio"] == pytest.approx(
        hc["step_time_median_s"] / res["step_time_median_s"])
    # parameter budgets: the connections' parameters on top of the shared blocks
    assert res["connection_params"] == 0
    for v in (hc, mhc):
        assert v["params"] - res["params"] == v["connection_params"] > 0
    n, c, layers = 4, PRESETS["tiny"]["dim"], 2 * PRESETS["tiny"]["n_layers"]
    assert mhc["connection_params"] == layers * (n * c * (n * n + 2 * n) + 3 + n + n + n * n)
    assert hc["connection_params"] == layers * (n + n + n * n + c * (2 + n) + 2)
    # gains: none for the residual; mHC's rows sum to 1, so its forward gain is 1
    assert res["max_composite_gain_fwd"] is None and res["final_gains"] is None
    assert mhc["max_composite_gain_fwd"] == pytest.approx(1.0, abs=1e-5)
    assert hc["max_composite_gain_fwd"] >= 1.0 - 1e-6
    assert len(hc["final_gains"]["composite_fwd"]) == layers
    assert [g["step"] for g in mhc["gain_history"]] == [0, 10, 20]
    assert report["config"]["steps"] == steps and report["config"]["model"]["dim"] == c
    assert report["wall_time_s"] > 0


def test_report_md_contents(tiny_report):
    out, report = tiny_report
    md = (out / "report.md").read_text()
    for v in report["variants"]:
        row = next(line for line in md.splitlines() if line.startswith(f"| {v['kind']} |"))
        assert f"{v['val_bpb']:.4f}" in row
        assert f"{v['params']:,}" in row
    assert "## Parameter budgets" in md and "## Configuration" in md
    assert "| model.dim | 32 |" in md
    for name in FIGURES:
        assert f"({name})" in md


@pytest.mark.parametrize("flag", ["--out", "--out-dir"])  # --out-dir: as `mhc train` names it
def test_compare_refuses_a_file_as_out(tmp_path, capsys, flag):
    target = tmp_path / "report"
    target.write_text("keep me")
    assert main(["compare", flag, str(target), "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"mhc compare: error: --out {target} exists and is a file, expected "
                           "a folder (or nothing)")
    assert target.read_text() == "keep me"


def test_compare_validates_before_training(tmp_path):
    with pytest.raises(ConfigError, match="seq_len 64 is longer than the model allows"):
        compare(tmp_path / "x", preset="tiny", seq_len=64)
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset_config("huge")
    assert not (tmp_path / "x").exists()


def test_presets_are_valid():
    for name in PRESETS:
        preset_config(name).validate()
    stress = preset_config("stress")
    assert 2 * stress.model.n_layers >= 48
    assert stress.lr > preset_config("default").lr


def test_single_seed_report_says_it_cannot_test(tiny_report):
    out, report = tiny_report
    assert report["seeds"] == 1
    variants = {v["kind"]: v for v in report["variants"]}
    d = variants["mhc"]["vs_residual"]["val_loss"]
    want = variants["mhc"]["val_loss"] - variants["residual"]["val_loss"]
    assert d["mean"] == pytest.approx(want)
    assert d["ci_low"] is None and d["significant"] is None
    md = (out / "report.md").read_text()
    assert "- mhc: " in md and "one seed gives no interval" in md
    assert "One seed: " in md and "degrees of freedom" not in md
    # health: a row for each kind with an H_res, none for the residual
    assert "| mhc | 1.000 | 1.000 |" in md and variants["residual"]["health"] is None
    assert variants["mhc"]["health"]["max_abs_log_colsum"] >= 0.0
    assert variants["hc"]["health"]["max_logit_range"] is None  # HC takes no exp


@pytest.fixture(scope="module")
def seeds_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("seeds")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"def g{i % 13}(y):\n    return y + {i % 9}\n" for i in range(400)))
    out = root / "out"
    report = compare(out, preset="tiny", kinds=("residual", "mhc-lite", "kromhc"), seeds=2,
                     steps=6, eval_every=3, gain_every=3, data=str(corpus),
                     cache_dir=str(root / "cache"), val_fraction=0.1, quiet=True,
                     progress=False, tensorboard=False, device="cpu", dtype="fp32")
    return out, report


def test_seeds_are_paired_and_summarised(seeds_report):
    out, report = seeds_report
    assert report["seeds"] == 2 and report["config"]["seed"] == "0 to 1"
    variants = {v["kind"]: v for v in report["variants"]}
    for kind, v in variants.items():
        assert [r["seed"] for r in v["seed_runs"]] == [0, 1] == v["seeds"]
        for seed in (0, 1):
            assert (out / kind / f"seed{seed}" / "metrics.jsonl").is_file()
        losses = [r["val_loss"] for r in v["seed_runs"]]
        assert v["val_loss"] == v["val_loss_mean"] == pytest.approx(sum(losses) / 2)
        assert v["val_loss_sd"] == pytest.approx(abs(losses[0] - losses[1]) / math.sqrt(2))
    res = variants["residual"]["seed_runs"]
    assert res[0]["loss_history"][0] != res[1]["loss_history"][0]  # another seed, another run
    for kind in ("mhc-lite", "kromhc"):
        runs = variants[kind]["seed_runs"]
        for seed in (0, 1):  # same seed: same blocks, same batch, same start as the residual
            assert runs[seed]["loss_history"][0] == pytest.approx(
                res[seed]["loss_history"][0], abs=1e-5)
        diffs = [runs[s]["val_loss"] - res[s]["val_loss"] for s in (0, 1)]
        d = variants[kind]["vs_residual"]["val_loss"]
        mean, sd = sum(diffs) / 2, abs(diffs[0] - diffs[1]) / math.sqrt(2)
        half = 12.706204736174707 * sd / math.sqrt(2)  # t(0.975, 1 degree of freedom)
        assert d["mean"] == pytest.approx(mean) and d["sd"] == pytest.approx(sd)
        assert d["ci_low"] == pytest.approx(mean - half) and d["ci_high"] == pytest.approx(
            mean + half)
        assert d["significant"] == (not d["ci_low"] <= 0 <= d["ci_high"])


def test_seeds_report_md(seeds_report):
    out, report = seeds_report
    md = (out / "report.md").read_text()
    assert md.startswith("# mhc compare: residual vs mhc-lite vs kromhc (preset tiny, modified, "
                         "2 seeds)")
    assert "## Seeds and significance" in md and "Student's t with 1 degree of freedom" in md
    v = {v["kind"]: v for v in report["variants"]}["kromhc"]
    row = next(line for line in md.splitlines() if line.startswith("| kromhc | 2 |"))
    assert f"{v['val_loss_mean']:.4f} ± {v['val_loss_sd']:.4f}" in row
    assert "paired seeds (interval" in md
    width, height = read_png_size((out / "loss_curves.png").read_bytes())
    assert width > 200 and height > 200


def test_compare_rejects_bad_kinds_seeds_and_a_missing_text_file(tmp_path, capsys):
    with pytest.raises(ConfigError, match="unknown kind lite: kinds must be names from "
                       "residual, hc, mhc, mhc-lite, kromhc, mhc-static-res$"):
        compare(tmp_path / "a", preset="tiny", kinds=("residual", "lite"))
    with pytest.raises(ConfigError, match="got mhc, mhc"):
        compare(tmp_path / "a", preset="tiny", kinds=("mhc", "mhc"))
    with pytest.raises(ConfigError, match="seeds must be an integer >= 1, got 0"):
        compare(tmp_path / "a", preset="tiny", seeds=0)
    with pytest.raises(ConfigError, match="shakespeare preset trains on a text file given "
                       "with --data"):
        compare(tmp_path / "a", preset="shakespeare")
    assert main(["compare", "--out", str(tmp_path / "b"), "--preset", "tiny", "--kinds",
                 "residual,mhc-lite,nope"]) == 2
    assert "error: unknown kind nope: kinds must be names from" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_shakespeare_preset_is_nanogpts_cpu_recipe():
    from torch_mhc.tools.compare.run import preset_label

    cfg = preset_config("shakespeare")
    assert preset_label("shakespeare", cfg.updated({"data": "input.txt"})) == "shakespeare"
    assert preset_label("shakespeare", cfg.updated({"steps": 10})) == "shakespeare, modified"
    assert preset_label("tiny", preset_config("tiny").updated({"data": "x"})) == "tiny, modified"
    m = cfg.model
    assert (m.n_layers, m.n_heads, m.dim, m.max_seq_len) == (4, 4, 128, 64)
    assert (cfg.seq_len, cfg.batch_size, cfg.steps) == (64, 12, 2000)
    assert (cfg.lr, cfg.min_lr, cfg.beta2, cfg.val_fraction) == (1e-3, 1e-4, 0.99, 0.1)


def test_interval_near_zero_is_not_printed_as_zero():
    from torch_mhc.tools.compare.seeds import seeds_table, significance_lines

    d = {"mean": -0.0176, "sd": 0.007, "n": 3, "ci_low": -0.0352, "ci_high": 2.1e-05,
         "significant": False}
    v = {"kind": "hc", "seeds": [0, 1, 2], "val_loss_mean": 1.7574, "val_loss_sd": 0.0086,
         "val_bpb_mean": 2.5354, "val_bpb_sd": 0.0125, "vs_residual": {"val_loss": d,
                                                                       "val_bpb": None}}
    assert "| -0.0176 [-0.0352, +2.1e-05] | n/a | no |" in seeds_table([v])
    assert significance_lines([v]) == [
        "- hc: 0.0176 nats lower than the residual, not significant over 3 paired seeds "
        "(interval -0.0352 to +2.1e-05 includes 0)."]


def test_loss_plot_zooms_on_the_second_half():
    from matplotlib.figure import Figure

    from torch_mhc.tools.compare import plots

    # A run whose loss falls linearly from 10 to 1 over 100 steps, validated every 25 steps.
    losses = [10 - 9 * i / 99 for i in range(100)]
    run = {"loss_history": losses,
           "val_history": [{"step": s, "val_loss": 10 - 9 * (s - 1) / 99 + 0.5}
                           for s in (25, 50, 75, 100)]}
    ax = Figure().add_subplot()
    plots.loss_lines(ax, "mhc", run)
    plots.zoom_to_second_half(ax)
    assert ax.get_xlim() == (50, 100)
    # y spans the solid and dashed lines from step 50 on (running means from 5.55 down to
    # about 1.05, validation 6.05 at step 50), padded by 5% of the range: never the first
    # half's 10.
    low, high = ax.get_ylim()
    assert 0.5 < low < 1.0 and 5.5 < high < 6.5
    assert [t.get_text() for t in ax.legend().get_texts()] == [
        "mHC train (2-step running mean)", "mHC val"]


def test_loss_plot_zoom_keeps_the_seed_bands():
    """With several seeds the second half's y range holds the bands (lowest to highest
    seed), not only the mean lines."""
    from matplotlib.figure import Figure

    from torch_mhc.tools.compare import plots

    # two seeds 4 apart, falling from 10 and 14: the bands reach 4 above the mean
    seed_runs = [{"loss_history": [b - 9 * i / 99 for i in range(100)], "val_history": []}
                 for b in (8.0, 12.0)]
    ax = Figure().add_subplot()
    plots.loss_lines(ax, "mhc", {"seed_runs": seed_runs})
    plots.zoom_to_second_half(ax)
    low, high = ax.get_ylim()
    band_low, band_high = 8 - 9 * 99 / 99, 12 - 9 * 49 / 99  # lowest and highest from step 50
    assert low <= band_low and high >= band_high


def test_log_axes_label_their_ticks_as_plain_numbers():
    """The plots' log axes write 0.6, 2 and 1000 (matplotlib's LogFormatter: 6e-01 below
    one), and still leave unlabelled the minor ticks it leaves unlabelled."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from torch_mhc.tools.compare import plots

    fig = Figure()
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([1, 2], [0.5, 1.5])
    plots._plain_log_axis(ax)
    fig.canvas.draw()
    major = ax.yaxis.get_major_formatter()
    assert [major(v) for v in (0.6, 2.0, 1000.0)] == ["0.6", "2", "1000"]
    labels = [t.get_text() for t in ax.get_yticklabels(minor=True) if t.get_text()]
    assert "0.6" in labels and all("e" not in t for t in labels)
    ax.set_ylim(1e-3, 1e3)  # six decades: minor ticks unlabelled
    fig.canvas.draw()
    assert not [t.get_text() for t in ax.get_yticklabels(minor=True) if t.get_text()]
    # outside 0.001 .. 9999 powers of ten, not %g's 1e-07 beside 100000
    assert [plots._tick_text(v) for v in (1e-7, 1e4, 9999.0, 1e-3, 2.5e-5, 3e6)] == [
        "$10^{-7}$", "$10^{4}$", "9999", "0.001", "$2.5\\times10^{-5}$", "$3\\times10^{6}$"]
    ax.set_ylim(1e-8, 1e8)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert labels and not [t for t in labels if "e" in t and "times" not in t]


def test_interrupted_comparison_says_it_starts_over(tmp_path, capsys, monkeypatch):
    """Ctrl-C in a kind's run: exit 130 and one line naming the run, saying that a comparison
    does not resume (the run's own message offers `--resume`, which compare does not take)."""
    from torch_mhc.lm.train import RunInterrupted
    from torch_mhc.tools.compare import run as compare_run

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def g{i % 13}(y):\n    return y + {i % 9}\n" for i in range(400)))
    train = compare_run.train

    def interrupt_hc(cfg, **kwargs):
        if cfg.model.connection == "hc" and ".warmup" not in cfg.out_dir:
            raise RunInterrupted("interrupted after step 3; checkpoint x, which `mhc train "
                                 "--resume` continues", 3, "x")
        return train(cfg, **kwargs)

    monkeypatch.setattr(compare_run, "train", interrupt_hc)
    argv = ["compare", "--out", str(tmp_path / "out"), "--preset", "tiny", "--data",
            str(corpus), "--steps", "4", "--cache-dir", str(tmp_path / "cache"), "--quiet",
            "--no-progress", "--no-tensorboard"]
    assert main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("mhc compare: interrupted in the hc run after step 3; a comparison does "
                       "not resume: run `mhc compare` again to start it over")

    def interrupt_warm_up(cfg, **kwargs):  # the warm-up's checkpoint is nothing to resume
        if ".warmup" in cfg.out_dir:
            raise RunInterrupted("interrupted after step 1; checkpoint y, which `mhc train "
                                 "--resume` continues", 1, "y")
        return train(cfg, **kwargs)

    monkeypatch.setattr(compare_run, "train", interrupt_warm_up)
    assert main([*argv, "--out", str(tmp_path / "out2")]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("mhc compare: interrupted in the warm-up step of residual, before any "
                       "measured run; run `mhc compare` again to start it over")


def test_summary_table_without_a_residual_run_writes_n_a(tiny_report):
    """The "vs residual" column of a comparison without the residual: n/a, not n/ax."""
    from torch_mhc.tools.compare.report import summary_table

    _, report = tiny_report
    variants = [dict(v, step_time_ratio=None) for v in report["variants"]]
    rows = summary_table({**report, "variants": variants}).splitlines()[2:]
    assert rows and all(row.split(" | ")[10] == "n/a" for row in rows)
    rows = summary_table(report).splitlines()[2:]
    assert all(row.split(" | ")[10].endswith("x") for row in rows)


def test_an_earlier_comparisons_runs_are_removed_and_named(tmp_path):
    """Another comparison into the same folder replaces the earlier one: the runs of kinds
    it does not train and of other seed counts go, and compare names each on stderr."""
    from torch_mhc.tools.compare.run import remove_stale

    for folder in ("hc/seed0", "hc/seed1", "mhc/seed0", "mhc/seed1", "mhc/seed2", "residual",
                   "residual/ckpt", "mhc/seed3"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "residual" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "notes.txt").write_text("mine")
    removed = remove_stale(tmp_path, ("residual", "mhc"), [0, 1], written=[])
    assert removed == ["residual/ckpt/", "residual/metrics.jsonl", "hc/", "mhc/seed2/",
                       "mhc/seed3/"]
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "mhc", "mhc/seed0", "mhc/seed1", "notes.txt", "residual"]


def test_compare_says_which_earlier_runs_it_removed(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    (out / "hc" / "seed0").mkdir(parents=True)  # an earlier two-seed comparison's HC run
    compare(out, preset="tiny", kinds=("residual", "mhc"), steps=2, eval_every=2,
            gain_every=2, data=str(corpus), cache_dir=str(tmp_path / "cache"),
            val_fraction=0.1, quiet=True, progress=False, tensorboard=False, device="cpu",
            dtype="fp32")
    err = capsys.readouterr().err
    assert f"mhc compare: note: removed hc/ from {out}, left by an earlier comparison" in err
    assert not (out / "hc").exists() and (out / "mhc" / "metrics.jsonl").is_file()
