"""Tests of the `mhc` command's answers to unusual input: one line and exit status 2 before
any work starts, paths with ~, a config file merged with flags, and what a rerun of compare
leaves in its folder."""

from __future__ import annotations

import errno
import json
import math

import pytest
import torch

from tests.helpers.cli import assert_one_line_error
from tests.helpers.cli import run_cli as run
from torch_mhc.lm.config import build_config
from torch_mhc.lm.model import ModelConfig
from torch_mhc.lm.train import ConfigError, TrainConfig, load_checkpoint

SEED_MAX = 2**32 - 1


@pytest.fixture
def compare_flags(tmp_path, corpus):
    """A two-step tiny comparison on the test corpus."""
    return ["--preset", "tiny", "--data", corpus, "--cache-dir", tmp_path / "cache",
            "--val-fraction", "0.1", "--quiet", "--no-progress", "--no-tensorboard",
            "--device", "cpu", "--dtype", "fp32", "--steps", "2", "--warmup", "0",
            "--eval-every", "0", "--gain-every", "0", "--eval-batches", "1"]


# ---------------------------------------------------------------------------------------------
# compare: kinds that cannot use the stream count, seeds


@pytest.mark.parametrize("kinds, streams, needle", [
    ("residual,kromhc", 3, "kind kromhc cannot run with streams = 3"),
    ("mhc,mhc-lite", 6, "kind mhc-lite cannot run with streams = 6"),
])
def test_compare_refuses_a_kind_that_cannot_use_the_streams(tmp_path, capsys, kinds, streams,
                                                           needle):
    out = tmp_path / "cmp"
    code, stdout, err = run(["compare", "--out", out, "--preset", "tiny", "--kinds", kinds,
                             "--streams", streams], capsys)
    assert_one_line_error(code, err, "mhc compare: error:", needle, f"got n = {streams}")
    assert stdout == ""
    assert not out.exists()  # refused before any run started


def test_seed_must_fit_numpy(tmp_path, tiny_flags, capsys):
    code, _, err = run(["train", *tiny_flags, "--seed", SEED_MAX + 1], capsys)
    assert_one_line_error(code, err, f"seed must be an integer in [0, {SEED_MAX}], "
                          f"got {SEED_MAX + 1}")
    code, _, err = run(["train", *tiny_flags, "--seed", -1], capsys)
    assert_one_line_error(code, err, "seed must be an integer in [0,", "got -1")
    # the largest seed trains
    out = tmp_path / "run"
    code, _, err = run(["train", *tiny_flags, "--seed", SEED_MAX, "--steps", "1",
                        "--out", out], capsys)
    assert code == 0, err
    assert load_checkpoint(out)["train_config"]["seed"] == SEED_MAX


def test_compare_checks_the_last_seed(tmp_path, capsys):
    out = tmp_path / "cmp"
    code, _, err = run(["compare", "--out", out, "--preset", "tiny", "--seed", SEED_MAX - 1,
                        "--seeds", "3"], capsys)
    assert_one_line_error(code, err, f"seed + seeds - 1 must be <= {SEED_MAX}",
                          f"got seed {SEED_MAX - 1} and seeds 3")
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# model floats must be finite


@pytest.mark.parametrize("name", ["mlp_ratio", "init_std", "norm_eps", "rope_base"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_model_floats_must_be_finite(name, value):
    with pytest.raises(ValueError, match=f"ModelConfig.{name} must be a number > 0 and "
                                         f"finite, got {value}"):
        ModelConfig(**{name: value})


@pytest.mark.parametrize("flag", ["--mlp-ratio", "--init-std", "--norm-eps", "--rope-base"])
def test_infinite_model_flag_is_one_line(flag, tiny_flags, capsys):
    code, _, err = run(["train", *tiny_flags, flag, "inf"], capsys)
    assert_one_line_error(code, err, "must be a number > 0 and finite, got inf")


# ---------------------------------------------------------------------------------------------
# paths with ~


def test_user_paths_are_expanded_once(tmp_path, tiny_flags, capsys, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    cfg = TrainConfig(out_dir="~/r", cache_dir="~/c", data="~/d.txt", resume="~/r/ckpt")
    assert (cfg.out_dir, cfg.cache_dir, cfg.data, cfg.resume) == (
        str(home / "r"), str(home / "c"), str(home / "d.txt"), str(home / "r" / "ckpt"))
    assert cfg.updated({"steps": 5}).out_dir == str(home / "r")

    code, _, err = run(["train", *tiny_flags, "--steps", "1", "--out", "~/r"], capsys)
    assert code == 0, err
    assert load_checkpoint(home / "r")["step"] == 1
    assert list(cwd.iterdir()) == []  # no literal ./~ folder


def test_user_path_checked_where_it_is_written(tmp_path, tiny_flags, capsys, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / "taken").write_text("a file")
    monkeypatch.setenv("HOME", str(home))
    code, _, err = run(["train", *tiny_flags, "--out", "~/taken"], capsys)
    assert_one_line_error(code, err, f"out_dir {home / 'taken'} cannot be a folder")


# ---------------------------------------------------------------------------------------------
# config file merged with the flags before validation


def test_file_and_flags_are_validated_together(tmp_path, tiny_flags, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text("n_heads = 3\n")
    cfg = build_config(TrainConfig(), toml, {"dim": 48})
    assert (cfg.model.dim, cfg.model.n_heads) == (48, 3)
    # alone, the file does not fit the default width: the merged config is refused
    with pytest.raises(ConfigError, match=r"dim \(128\) must be divisible by n_heads \(3\)"):
        build_config(TrainConfig(), toml, {})
    # through the command line: the file's n_heads with the flag's width trains
    toml.write_text("[model]\nn_heads = 3\n")
    flags = [f for f in tiny_flags]
    i = flags.index("--n-heads")
    del flags[i:i + 2]
    out = tmp_path / "run"
    code, _, err = run(["train", *flags, "--config", toml, "--dim", "48", "--steps", "1",
                        "--out", out], capsys)
    assert code == 0, err
    saved = load_checkpoint(out)["train_config"]["model"]
    assert (saved["dim"], saved["n_heads"]) == (48, 3)


def test_file_errors_name_the_file(tmp_path, tiny_flags, capsys):
    toml = tmp_path / "bad.toml"
    toml.write_text('dim = "wide"\n')
    code, _, err = run(["train", *tiny_flags, "--config", toml], capsys)
    assert_one_line_error(code, err, f"config file {toml}:",
                          "ModelConfig.dim must be an integer >= 1, got 'wide'")
    toml.write_text("compile = 1\n")
    code, _, err = run(["train", *tiny_flags, "--config", toml], capsys)
    assert_one_line_error(code, err, f"config file {toml}:", "compile must be true or false",
                          "got 1")
    toml.write_text("steps = 3\n[model]\nsinkhorn_iter = 5\n")
    code, _, err = run(["train", *tiny_flags, "--config", toml], capsys)
    assert_one_line_error(code, err, f"config file {toml}:",
                          "unknown model config key 'sinkhorn_iter'; did you mean "
                          "'sinkhorn_iters'?")
    toml.write_text("warmpu = 3\n")
    code, _, err = run(["train", *tiny_flags, "--config", toml], capsys)
    assert_one_line_error(code, err, "unknown config key 'warmpu'; did you mean 'warmup'?")
    assert "known:" not in err  # one suggestion, not the list of every key


# ---------------------------------------------------------------------------------------------
# generate, bench


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_generate_temperature_must_be_finite(tmp_path, capsys, value):
    code, _, err = run(["generate", "--checkpoint", tmp_path, "--temperature", value], capsys)
    assert_one_line_error(code, err, "mhc generate: error: --temperature must be a finite "
                          f"number >= 0, got {float(value)}")


@pytest.mark.parametrize("value", ["-3", str(2**32)])
def test_generate_seed_lies_where_trains_does(tmp_path, capsys, value):
    code, _, err = run(["generate", "--checkpoint", tmp_path, "--seed", value], capsys)
    assert_one_line_error(code, err, f"mhc generate: error: --seed must lie in [0, {2**32 - 1}]"
                          f", got {value}")


def test_bench_checks_json_path_before_running(tmp_path, capsys):
    code, out, err = run(["bench", "--quick", "--json", tmp_path], capsys)
    assert_one_line_error(code, err, "mhc bench: error:", f"--json {tmp_path} is a folder")
    assert out == ""  # no benchmark ran
    missing = tmp_path / "missing" / "r.json"
    code, out, err = run(["bench", "--quick", "--json", missing], capsys)
    assert_one_line_error(code, err, f"its folder {tmp_path / 'missing'} does not exist")
    assert out == ""
    (tmp_path / "file").write_text("x")
    code, _, err = run(["bench", "--quick", "--json", tmp_path / "file" / "r.json"], capsys)
    assert_one_line_error(code, err, "does not exist (or is a file)")


def test_bench_ops_checks_json_path_before_running(tmp_path, capsys):
    for profile in ([], ["--profile"]):
        code, out, err = run(["bench", "--ops", *profile, "--tokens", "8", "--dim", "8",
                              "--json", tmp_path], capsys)
        assert code == 2 and out == ""  # nothing timed
        assert f"mhc bench --ops: error: --json {tmp_path} is a folder" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_bench_without_cuda_is_one_line(capsys):
    code, out, err = run(["bench", "--quick", "--device", "cuda"], capsys)
    assert_one_line_error(code, err, "mhc bench: error: --device cuda asked for, but CUDA is "
                          "not available here")
    assert out == ""
    code, out, err = run(["bench", "--gpu"], capsys)
    assert_one_line_error(code, err, "mhc bench: error: the GPU check needs a CUDA device",
                          "--dry-run")
    assert out == ""
    # what python -m torch_mhc.tools.bench.gpu_check runs
    from torch_mhc.tools.bench.command import run_bench_tool

    assert run_bench_tool("--gpu", [], prog="gpu_check") == 2
    assert_one_line_error(2, capsys.readouterr().err, "gpu_check: error: the GPU check needs")


def test_bench_unknown_device_is_one_line(capsys):
    code, _, err = run(["bench", "--quick", "--device", "tpu"], capsys)
    assert_one_line_error(code, err, "--device must be cpu, cuda or cuda:N, got 'tpu'")


# ---------------------------------------------------------------------------------------------
# compare: a run stopped at its first step, reruns into the same folder, ranks


@pytest.mark.parametrize("runs, code", [
    ({"residual": [None, None], "mhc": ["stopped", "stopped"]}, 0),  # one kind stopped
    ({"residual": ["stopped", None], "mhc": [None, "stopped"]}, 0),  # a seed of each
    ({"residual": ["stopped", "stopped"], "mhc": ["stopped", "stopped"]}, 1),
])
def test_compare_exits_1_only_when_every_run_stopped(tmp_path, compare_flags, capsys,
                                                      monkeypatch, runs, code):
    """Counted over the runs, not the variants: with several seeds a variant's "diverged"
    names its first stopped seed, and stopped runs among finished ones are findings."""
    from torch_mhc.tools.compare import run as compare_run

    def fake_compare(out, **kwargs):
        return {"wall_time_s": 0.0, "variants": [
            {"kind": kind, "diverged": next((d for d in seeds if d), None),
             "seed_runs": [{"seed": i, "diverged": d} for i, d in enumerate(seeds)]}
            for kind, seeds in runs.items()]}

    monkeypatch.setattr(compare_run, "compare", fake_compare)
    got, _, err = run(["compare", "--out", tmp_path / "cmp", *compare_flags, "--seeds", "2"],
                      capsys)
    assert got == code, err
    assert ("every run stopped (residual, mhc)" in err) == (code == 1)


def test_compare_reports_a_run_stopped_at_the_first_step(tmp_path, compare_flags, capsys):
    out = tmp_path / "cmp"
    code, _, err = run(["compare", "--out", out, *compare_flags, "--kinds", "residual,mhc",
                        "--init-std", "1e30"], capsys)
    # every variant stopped: exit 1 (the spike policy's status), the report written still
    assert code == 1, err
    assert "mhc compare: every run stopped (residual, mhc)" in err
    text = (out / "report.json").read_text()

    def refuse(name):
        raise AssertionError(f"report.json holds {name}, which is not JSON")

    report = json.loads(text, parse_constant=refuse)
    for v in report["variants"]:
        assert v["diverged"].startswith("training stopped:"), v["diverged"]
        assert "at step 1" in v["diverged"]
        assert v["val_loss"] is None and v["val_bpb"] is None
    assert "mhc (stopped)" in (out / "report.md").read_text()


def test_compare_rerun_removes_what_it_no_longer_writes(tmp_path, compare_flags, capsys):
    out = tmp_path / "cmp"
    code, _, err = run(["compare", "--out", out, *compare_flags, "--kinds", "residual,mhc",
                        "--seeds", "2"], capsys)
    assert code == 0, err
    assert {p.name for p in (out / "mhc").iterdir()} == {"seed0", "seed1"}
    assert (out / "health.png").exists() and (out / "composite_gain.png").exists()
    (out / "notes.txt").write_text("mine")
    (out / "mine").mkdir()

    code, _, err = run(["compare", "--out", out, *compare_flags, "--kinds", "residual"],
                       capsys)
    assert code == 0, err
    names = {p.name for p in out.iterdir()}
    # residual has no H_res: no gain or health figures; mhc was not trained this time
    assert names == {"report.json", "report.md", "loss_curves.png", "grad_norm.png",
                     "residual", "notes.txt", "mine"}
    assert not any(p.name.startswith("seed") for p in (out / "residual").iterdir())
    assert (out / "residual" / "metrics.jsonl").exists()
    assert load_checkpoint(out / "residual")["step"] == 2

    code, _, err = run(["compare", "--out", out, *compare_flags, "--kinds", "residual",
                        "--seeds", "2"], capsys)
    assert code == 0, err
    assert {p.name for p in (out / "residual").iterdir()} - {".lock"} == {"seed0", "seed1"}
    assert (out / "notes.txt").read_text() == "mine"


def test_compare_writes_and_prints_on_rank_0_only(tmp_path, compare_flags, capsys,
                                                  monkeypatch):
    out = tmp_path / "cmp"
    flags = [f for f in compare_flags if f != "--quiet"]
    monkeypatch.setenv("RANK", "1")
    code, stdout, err = run(["compare", "--out", out, *flags, "--kinds", "residual"], capsys)
    assert code == 0, err
    # (train's own log lines are rank 0's once torchrun's process group runs)
    assert "| residual |" not in stdout and "report:" not in stdout
    assert not (out / "report.json").exists() and not (out / "loss_curves.png").exists()
    # a config error: every rank has it, rank 0 says it
    code, _, err = run(["train", "--steps", "0"], capsys)
    assert (code, err) == (2, "")
    monkeypatch.setenv("RANK", "0")
    code, _, err = run(["train", "--steps", "0"], capsys)
    assert_one_line_error(code, err, "steps must be an integer >= 1, got 0")
    code, stdout, err = run(["compare", "--out", out, *flags, "--kinds", "residual"], capsys)
    assert code == 0, err
    assert "| residual |" in stdout
    assert (out / "report.json").exists()


# ---------------------------------------------------------------------------------------------
# help texts and messages


def test_compare_help_shows_the_preset_defaults(capsys):
    code, out, _ = run(["compare", "--help"], capsys)
    assert code == 0
    text = " ".join(out.split())
    assert "--steps N optimizer steps (default: from --preset)" in text
    assert "--seq-len N tokens (bytes) per sequence (default: from --preset)" in text
    assert "(default: 1000)" not in text  # TrainConfig's steps, which no preset uses
    # fields no preset sets keep TrainConfig's default
    assert "--grad-clip X max gradient norm (0: no clipping) (default: 1.0)" in text
    for flag in ("--data DATA", "--cache-dir DIR"):
        after = text.rsplit(flag, 1)[1].split(" --", 1)[0]  # the help, not the usage
        assert after.count("(default:") == 1, after


def test_generate_help_states_defaults(capsys):
    code, out, _ = run(["generate", "--help"], capsys)
    assert code == 0
    text = " ".join(out.split())
    assert ("--max-new-tokens N tokens (bytes) to generate after the prompt (default: 200, or "
            "as many as the model's max_seq_len leaves after the prompt with the KV cache)"
            in text)
    assert "--top-k K sample from the K most likely tokens only (default: all of them)" in text
    assert "--seed SEED seed of the sampling (default: 0)" in text


def test_unknown_flag_points_at_the_subcommand_help(capsys):
    code, _, err = run(["train", "--bogus"], capsys)
    assert_one_line_error(code, err, "mhc train: error: unrecognized arguments: --bogus "
                                     "(see mhc train --help)")  # no flag close to it
    # a misspelt flag: the closest one of its command (as the TOML keys get theirs)
    code, _, err = run(["train", "--conection", "mhc"], capsys)
    assert_one_line_error(code, err, "unrecognized arguments: --conection mhc (--conection: "
                                     "did you mean --connection?) (see mhc train --help)")
    code, _, err = run(["bench", "--quick", "--sizez=3"], capsys)
    assert_one_line_error(code, err, "mhc bench: error: unrecognized arguments: --sizez=3 "
                                     "(--sizez: did you mean --sizes?)")
    code, _, err = run(["cost", "--layer", "4"], capsys)  # mhc cost's own parser too
    assert_one_line_error(code, err, "mhc cost: error: unrecognized arguments: --layer 4 "
                                     "(--layer: did you mean --layers?)")


def test_a_flag_is_given_whole(tmp_path, capsys):
    """argparse would take a prefix of a flag for it: `mhc sweep --lr 0.1` as --lrs."""
    code, _, err = run(["sweep", "--out", tmp_path / "s", "--lr", "0.1"], capsys)
    assert_one_line_error(code, err, "unrecognized arguments: --lr 0.1 (--lr: did you mean "
                                     "--lrs?)")
    code, _, err = run(["train", "--ste", "3"], capsys)
    assert_one_line_error(code, err, "unrecognized arguments: --ste 3")
    assert not (tmp_path / "s").exists()


def test_warmup_not_shorter_than_steps_warns_once(tmp_path, tiny_flags, capsys):
    code, _, err = run(["train", *tiny_flags, "--steps", "2", "--warmup", "5"], capsys)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert warnings == ["mhc train: warning: warmup (5) >= steps (2): the learning rate rises "
                        "for the whole run and never reaches lr 0.001"]


def test_a_refused_run_says_only_why(tmp_path, tiny_flags, capsys):
    """The warmup warning comes once the run starts: a run refused (a checkpoint already in
    its folder) prints only its error line."""
    flags = [*tiny_flags, "--steps", "2", "--warmup", "5", "--out-dir", tmp_path / "run"]
    code, _, err = run(["train", *flags], capsys)
    assert code == 0 and "warning: warmup (5) >= steps (2)" in err, err
    code, _, err = run(["train", *flags], capsys)
    assert_one_line_error(code, err, "exists: pass resume (--resume) to continue that run")


def test_resuming_another_run_into_a_folder_holding_one_is_refused(tmp_path, tiny_flags, capsys):
    """--resume PATH forks the run at PATH into out_dir; where out_dir holds a run of its own
    that would replace it (its checkpoints, its metrics) without a word. Its own checkpoint
    as PATH continues it."""
    x, y = tmp_path / "x", tmp_path / "y"
    for out, kind in ((x, "mhc"), (y, "residual")):
        code, _, err = run(["train", *tiny_flags, "--steps", "2", "--connection", kind,
                            "--out-dir", out], capsys)
        assert code == 0, err
    before = {p: p.read_bytes() for p in sorted(x.rglob("*")) if p.is_file()}
    code, _, err = run(["train", *tiny_flags, "--steps", "4", "--out-dir", x, "--resume", y],
                       capsys)
    assert_one_line_error(code, err, f"ckpt exists: resuming {y} into {x} would replace the "
                                     "run there")
    assert {p: p.read_bytes() for p in sorted(x.rglob("*")) if p.is_file()} == before
    code, _, err = run(["train", *tiny_flags, "--steps", "4", "--out-dir", x, "--resume",
                        x / "ckpt"], capsys)
    assert code == 0, err
    code, _, err = run(["train", *tiny_flags, "--steps", "4", "--out-dir", tmp_path / "fork",
                        "--resume", y], capsys)
    assert code == 0, err


def test_an_op_implementation_that_cannot_run_is_bad_input(tmp_path, tiny_flags, capsys,
                                                           monkeypatch):
    """TORCH_MHC_IMPL naming no implementation, or the triton ops on the CPU, is the user's
    input (exit 2, one line), not an internal error; `mhc bench` says so before it runs, and
    its usage errors are one line like every command's."""
    monkeypatch.setenv("TORCH_MHC_IMPL", "foo")
    code, _, err = run(["train", *tiny_flags, "--steps", "1"], capsys)
    assert_one_line_error(code, err, "environment variable TORCH_MHC_IMPL: unknown op "
                                     "implementation 'foo'")
    code, _, err = run(["bench", "--quick", "--only", "saved"], capsys)
    assert_one_line_error(code, err, "TORCH_MHC_IMPL: unknown op implementation 'foo'")
    monkeypatch.delenv("TORCH_MHC_IMPL")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code, _, err = run(["bench", "--quick", "--only", "saved", "--impl", "triton"], capsys)
    assert_one_line_error(code, err, "impl='triton': the triton ops run on a GPU, got device "
                                     "cpu")
    monkeypatch.setenv("TORCH_MHC_IMPL", "triton")
    code, _, err = run(["train", *tiny_flags, "--steps", "1"], capsys)
    assert_one_line_error(code, err, "TORCH_MHC_IMPL=triton: the triton ops run on a GPU")
    monkeypatch.delenv("TORCH_MHC_IMPL")
    code, _, err = run(["bench", "--quick", "--only", "stepp"], capsys)
    assert_one_line_error(code, err, "mhc bench: error: argument --only: unknown benchmark(s) "
                                     "['stepp']")


def test_a_refused_comparison_says_only_why(tmp_path, compare_flags, capsys):
    """As mhc train: the warmup warning waits until nothing refuses the comparison, and is
    said once when it runs."""
    code, _, err = run(["compare", "--out", tmp_path / "cmp", "--preset", "tiny", "--kinds",
                        "residual,kromhc", "--streams", "3", "--steps", "2", "--warmup", "5"],
                       capsys)
    assert_one_line_error(code, err, "kind kromhc cannot run with streams = 3")
    code, _, err = run(["compare", "--out", tmp_path / "cmp", *compare_flags, "--kinds",
                        "residual,mhc", "--warmup", "5"], capsys)
    assert code == 0, err
    assert err.count("mhc compare: warning: warmup (5) >= steps (2)") == 1, err


def test_the_librarys_warnings_are_one_line_each(tmp_path, tiny_flags, capsys, monkeypatch):
    """A machine without a C compiler: the native kernels' fallback is said as the command's
    other warnings are, one `mhc train: warning:` line, not Python's file, line and source;
    another package's warning keeps Python's form."""
    import warnings

    from torch_mhc.ops.cpu import native

    monkeypatch.setenv("CC", "false")  # a compiler that fails: no native library
    monkeypatch.setenv("TORCH_MHC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_loaded", None)
    code, _, err = run(["train", *tiny_flags, "--steps", "2", "--connection", "mhc"], capsys)
    assert code == 0, err
    lines = [line for line in err.splitlines() if "warning" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith(
        "mhc train: warning: native CPU kernels unavailable ("), err
    assert "pure-torch fallback" in lines[0] and "RuntimeWarning" not in err
    from torch_mhc.tools.boundary import warnings_as_lines

    shown = []  # the form the process had before the command: Python's, or pytest's record
    monkeypatch.setattr(warnings, "showwarning", lambda m, c, f, n, *a: shown.append((
        str(m), c, f, n)))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with warnings_as_lines("mhc train"):
            warnings.warn_explicit("theirs", UserWarning, "/elsewhere/pkg.py", 3)
            # torch's warning raised on a line of the library keeps its form too
            warnings.warn_explicit("torch's", UserWarning, native.__file__, 5)
            warnings.warn_explicit("torch_mhc: ours,\n  in two lines", UserWarning,
                                   "/elsewhere/pkg.py", 4)
    assert shown == [("theirs", UserWarning, "/elsewhere/pkg.py", 3),
                     ("torch's", UserWarning, native.__file__, 5)]
    assert capsys.readouterr().err == "mhc train: warning: ours, in two lines\n"


@pytest.mark.parametrize("existing, keep_previous, needle", [
    (False, True, "this run has no checkpoint yet (free space, then run again)"),
    (True, True, "this run's previous checkpoint there is intact"),
    (True, False, "the earlier run's checkpoint there is left as it was"),
])
def test_disk_full_message_says_what_is_kept(tmp_path, monkeypatch, existing, keep_previous,
                                             needle):
    from torch_mhc.lm.train import DiskFullError
    from torch_mhc.lm.train import checkpoint as ckpt

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.par, "save_checkpoint", full)
    if existing:
        (tmp_path / "ckpt").mkdir()
    with pytest.raises(DiskFullError) as info:
        ckpt.save_checkpoint(tmp_path, torch.nn.Linear(2, 2), None, {},
                             keep_previous=keep_previous)
    assert needle in str(info.value)
    assert str(tmp_path / "ckpt") in str(info.value)


@pytest.mark.parametrize("argv", [
    ["train"], ["compare", "--out", "c"], ["generate", "--checkpoint", "c"],
    ["upcycle", "--from", "r", "--out", "u", "--steps", "2"]])
def test_a_missing_extra_is_named_with_the_command(argv, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as where the train extra is missing
    code, _, err = run(argv, capsys)
    assert_one_line_error(code, err, f"mhc {argv[0]}: error: tqdm is not installed: mhc "
                          f"{argv[0]} needs the training extra, pip install -e '.[train]' in "
                          "the torch-mhc checkout")
    assert not any(tmp_path.iterdir())


def test_version(capsys):
    import torch_mhc

    code, out, err = run(["--version"], capsys)
    assert code == 0 and out == f"torch-mhc {torch_mhc.__version__}\n" and err == ""
