"""Tests of the `mhc` command: flags, TOML config and precedence, generation, bad input."""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sys

import pytest
import torch

from tests.helpers.cli import assert_one_line_error
from tests.helpers.cli import run_cli as run
from torch_mhc.lm.config import build_config, load_toml
from torch_mhc.lm.train import ConfigError, TrainConfig, load_checkpoint

# ---------------------------------------------------------------------------------------------
# train, config file, precedence


def test_train_writes_checkpoint_and_metrics(tmp_path, tiny_flags, capsys):
    out = tmp_path / "run"
    code, _, err = run(["train", *tiny_flags, "--connection", "hc", "--out", out],
                       capsys)
    assert code == 0, err
    state = load_checkpoint(out)
    assert state["step"] == 4 and state["model_config"]["connection"] == "hc"
    assert state["model_config"]["dim"] == 32
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert any('"kind": "eval"' in line for line in lines)
    # without a folder the run trains and says at its start that it keeps nothing
    loud = [f for f in tiny_flags if f != "--quiet"]
    code, text, err = run(["train", *loud, "--steps", "1"], capsys)
    assert code == 0, err
    first = text.splitlines()[0]
    assert first.startswith("training mhc") and first.endswith(
        "; no out_dir (--out-dir): nothing is saved")
    # --resume alone: which folder's run to continue, in the flags' words too
    code, _, err = run(["train", *tiny_flags, "--resume"], capsys)
    assert code == 2 and "set out_dir (--out-dir) too" in err and "(--resume)" in err


def test_toml_config_and_precedence(tmp_path, tiny_flags, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text(
        'steps = 3\nlr = 0.002\nschedule = "step"\n\n[model]\nconnection = "mhc"\nstreams = 2\n'
    )
    out = tmp_path / "run"
    # the file sets steps = 3 and lr; the flag --steps 5 wins over the file
    code, _, err = run(["train", *tiny_flags, "--config", toml, "--steps", "5",
                        "--out-dir", out], capsys)
    assert code == 0, err
    saved = load_checkpoint(out)["train_config"]
    assert saved["steps"] == 5  # flag over file (and over TINY's --steps 4, given earlier)
    assert saved["lr"] == 0.002 and saved["schedule"] == "step"  # file over defaults
    assert saved["model"]["connection"] == "mhc" and saved["model"]["streams"] == 2
    assert saved["model"]["dim"] == 32  # flag; the file does not set it


def test_build_config_layers(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("dim = 64\nn_heads = 2\nsteps = 10\n")
    base = TrainConfig().updated({"steps": 99, "lr": 0.01})
    cfg = build_config(base, toml, {"steps": 20})
    assert (cfg.model.dim, cfg.steps, cfg.lr) == (64, 20, 0.01)
    assert load_toml(toml) == {"dim": 64, "n_heads": 2, "steps": 10}


def test_toml_errors(tmp_path, tiny_flags, capsys):
    bad_key = tmp_path / "bad.toml"
    bad_key.write_text("steps = 3\nlearning_rate = 0.1\n")
    code, _, err = run(["train", *tiny_flags, "--config", bad_key], capsys)
    assert_one_line_error(code, err, "unknown config key 'learning_rate'", str(bad_key))
    bad_model_key = tmp_path / "bad_model.toml"
    bad_model_key.write_text("[model]\nwidth = 3\n")
    with pytest.raises(ConfigError, match="unknown model config key 'width'"):
        load_toml(bad_model_key)
    broken = tmp_path / "broken.toml"
    broken.write_text("steps = = 3\n")
    code, _, err = run(["train", *tiny_flags, "--config", broken], capsys)
    assert_one_line_error(code, err, "is not valid TOML")
    code, _, err = run(["train", "--config", tmp_path / "none.toml"], capsys)
    assert_one_line_error(code, err, "does not exist")
    wrong_type = tmp_path / "wrong_type.toml"
    wrong_type.write_text('log_every = "often"\n')
    code, _, err = run(["train", *tiny_flags, "--config", wrong_type], capsys)
    assert_one_line_error(code, err, "log_every must be an integer >= 1, got 'often'")


# ---------------------------------------------------------------------------------------------
# bad input: one line, exit code 2, nothing good overwritten


def test_missing_and_empty_data(tmp_path, tiny_flags, capsys):
    code, _, err = run(["train", *tiny_flags, "--data", tmp_path / "nope"], capsys)
    assert_one_line_error(code, err, "mhc train: error:", "does not exist")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    code, _, err = run(["train", *tiny_flags, "--data", empty], capsys)
    assert_one_line_error(code, err, "is empty")
    empty_dir = tmp_path / "empty_dir"
    empty_dir.mkdir()
    code, _, err = run(["train", *tiny_flags, "--data", empty_dir], capsys)
    assert_one_line_error(code, err, "holds no bytes")


def test_corpus_shorter_than_one_batch(tmp_path, tiny_flags, capsys):
    short = tmp_path / "short.txt"
    short.write_text("a = 1\n" * 5)  # 30 bytes: less than seq_len + 1 = 33
    code, _, err = run(["train", *tiny_flags, "--data", short], capsys)
    assert_one_line_error(code, err, "corpus shorter than one batch", "33")


def test_unknown_connection_kind(tmp_path, tiny_flags, capsys):
    code, _, err = run(["train", *tiny_flags, "--connection", "dense"], capsys)
    assert_one_line_error(code, err, "connection must be one of", "'dense'")


@pytest.mark.parametrize("where", ["flag", "top", "model"])
def test_former_name_of_the_connection_field(tmp_path, tiny_flags, capsys, where):
    """`residual` (the kind's former name) in a flag or a config file: one line naming
    `connection`, nothing trained."""
    if where == "flag":
        argv = ["train", *tiny_flags, "--residual", "hc", "--out", str(tmp_path / "r")]
    else:
        toml = tmp_path / "c.toml"
        toml.write_text('residual = "hc"\n' if where == "top" else '[model]\nresidual = "hc"\n')
        argv = ["train", *tiny_flags, "--config", str(toml), "--out", str(tmp_path / "r")]
    code, _, err = run(argv, capsys)
    assert_one_line_error(code, err, "residual", "connection")
    assert not (tmp_path / "r").exists()


def test_checkpoint_config_with_the_former_key_loads():
    from torch_mhc.lm.model import ModelConfig

    cfg = ModelConfig(connection="hc", dim=32, n_layers=1, n_heads=2, max_seq_len=16)
    old = {("residual" if k == "connection" else k): v for k, v in cfg.to_dict().items()}
    assert ModelConfig.from_dict(old) == cfg


def test_sequence_longer_than_model(tmp_path, tiny_flags, capsys):
    code, _, err = run(["train", *tiny_flags, "--seq-len", "64"], capsys)
    assert_one_line_error(code, err, "seq_len 64 is longer than the model allows",
                          "max_seq_len is 32")


def test_bad_flag_value_is_one_line(capsys):
    code, _, err = run(["train", "--steps", "many"], capsys)
    assert_one_line_error(code, err, "--steps", "invalid int value")


def test_corrupt_and_mismatched_checkpoints(tmp_path, tiny_flags, capsys, reseal):
    out = tmp_path / "run"
    assert run(["train", *tiny_flags, "--out", out], capsys)[0] == 0
    good = _files(out / "ckpt")

    # another model config: refused (before any tensor is read), checkpoint untouched
    code, _, err = run(["train", *tiny_flags, "--out", out, "--resume",
                        "--dim", "64", "--steps", "8"], capsys)
    assert_one_line_error(code, err, "was made for another model", "dim: checkpoint 32")
    # a fresh run into the same folder: refused
    code, _, err = run(["train", *tiny_flags, "--out", out], capsys)
    assert_one_line_error(code, err, "ckpt exists", "resume")
    assert _files(out / "ckpt") == good

    corrupt = tmp_path / "corrupt"
    shutil.copytree(out / "ckpt", corrupt)
    data = corrupt / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # a truncated save
    code, _, err = run(["train", *tiny_flags, "--out", tmp_path / "other",
                        "--resume", corrupt, "--steps", "8"], capsys)
    assert_one_line_error(code, err, "is corrupt: __0_0.distcp has size")
    code, _, err = run(["generate", "--checkpoint", corrupt], capsys)
    assert_one_line_error(code, err, "mhc generate: error:", "is corrupt")
    reseal(corrupt)  # the sums made to match: the truncated file itself is refused
    code, _, err = run(["generate", "--checkpoint", corrupt], capsys)
    assert_one_line_error(code, err, "cannot be loaded")
    assert not (tmp_path / "other" / "ckpt").exists()

    # weights that do not fit the config stored beside them
    tampered = tmp_path / "tampered"
    shutil.copytree(out / "ckpt", tampered)
    state = torch.load(tampered / "extra.pt", weights_only=True)
    state["model_config"]["n_layers"] = 3
    torch.save(state, tampered / "extra.pt")
    code, _, err = run(["generate", "--checkpoint", tampered], capsys)
    assert_one_line_error(code, err, "is corrupt: extra.pt")  # the sums catch the edit
    reseal(tampered)
    code, _, err = run(["generate", "--checkpoint", tampered], capsys)
    assert_one_line_error(code, err, "the weights do not fit the model")
    # a single-file checkpoint of an older version: one line, not a traceback
    old = tmp_path / "old" / "last.pt"
    old.parent.mkdir()
    torch.save({"model": {}}, old)
    code, _, err = run(["generate", "--checkpoint", old], capsys)
    assert_one_line_error(code, err, "is a file", "no longer read")
    code, _, err = run(["generate", "--checkpoint", old.parent], capsys)  # its folder
    assert_one_line_error(code, err, f"no checkpoint at {old.parent}", "it holds last.pt, a "
                          "single-file checkpoint of an earlier version, which is no longer read")


def _files(folder) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_resume_continues_to_more_steps(tmp_path, tiny_flags, capsys):
    out = tmp_path / "run"
    assert run(["train", *tiny_flags, "--out", out], capsys)[0] == 0
    code, _, err = run(["train", *tiny_flags, "--out", out, "--resume",
                        "--steps", "6"], capsys)
    assert code == 0, err
    assert load_checkpoint(out)["step"] == 6
    assert load_checkpoint(out / "ckpt.prev")["step"] == 4
    # resumed once more, finished: nothing to run, and the done line says so (not nan)
    loud = [flag for flag in tiny_flags if flag != "--quiet"]
    code, printed, err = run(["train", *loud, "--out", out, "--resume", "--steps", "6"], capsys)
    assert code == 0, err
    done = next(line for line in printed.splitlines() if line.startswith("done: 6 steps"))
    assert "no step in this launch" in done and "nan" not in done


def test_resume_takes_the_runs_own_settings(tmp_path, tiny_flags, capsys, monkeypatch):
    """--resume (a flag, a path or a config file's key) continues the run as it was set up
    (its sizes, data, schedule), under the flags and file given now; where and how it runs
    (out_dir, threads, device, ...) come from the launch."""
    from torch_mhc.lm.train import checkpoint

    out = tmp_path / "run"
    assert run(["train", *tiny_flags, "--out", out, "--lr", "0.002", "--connection", "hc",
                "--threads", "1"], capsys)[0] == 0
    code, _, err = run(["train", "--out-dir", out, "--resume", "--steps", "6", "--quiet"],
                       capsys)
    assert code == 0, err
    state = load_checkpoint(out)
    assert state["step"] == 6 and state["model_config"]["dim"] == 32
    assert state["model_config"]["connection"] == "hc"
    saved = state["train_config"]
    assert saved["lr"] == 0.002 and saved["steps"] == 6 and saved["batch_size"] == 4
    assert saved["threads"] == TrainConfig().threads  # the launch's, not the run's 1
    # resume as a config file's key, and a checkpoint path continued in another folder
    toml = tmp_path / "more.toml"
    toml.write_text(f'resume = true\nout_dir = "{out}"\nsteps = 7\nquiet = true\n')
    code, _, err = run(["train", "--config", toml], capsys)
    assert code == 0, err
    assert load_checkpoint(out)["step"] == 7
    code, _, err = run(["train", "--resume", out, "--out-dir", tmp_path / "next", "--steps", "8",
                        "--quiet"], capsys)
    assert code == 0, err
    assert load_checkpoint(tmp_path / "next")["step"] == 8
    assert load_checkpoint(out)["step"] == 7  # the run resumed from is left as it was
    # without a checkpoint to read, --resume fails as before, naming what is missing
    code, _, err = run(["train", "--out-dir", tmp_path / "none", "--resume"], capsys)
    assert_one_line_error(code, err, "no checkpoint to resume from")
    assert not (tmp_path / "none").exists()  # the refusal leaves no folder behind
    (tmp_path / "empty").mkdir()  # an existing folder without a checkpoint: the same refusal
    code, _, err = run(["train", "--out-dir", tmp_path / "empty", "--resume"], capsys)
    assert_one_line_error(code, err, "no checkpoint to resume from")
    # settings this version does not read: said, and the defaults stand (refused here: the
    # default model is not the run's)
    monkeypatch.setattr(checkpoint, "saved_train_config", lambda cfg: {"gone": 1})
    code, _, err = run(["train", "--out-dir", out, "--resume", "--steps", "9", "--warmup", "1"],
                       capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 2, err
    assert lines[0].startswith("mhc train: warning: the run's saved settings do not read here "
                               "(unknown config key 'gone'")
    assert "was made for another model" in lines[1]


def test_diverged_run_exits_1(tmp_path, tiny_flags, capsys):
    # lr 1e6 with no clipping: the loss explodes within a few steps
    code, _, err = run(["train", *tiny_flags, "--lr", "1e6", "--min-lr", "0",
                        "--grad-clip", "0", "--steps", "30", "--warmup", "0"], capsys)
    assert code == 1, err
    assert "training stopped:" in err and "at step" in err
    assert len(err.strip().splitlines()) == 1


def test_a_diverged_run_is_said_once(tmp_path, tiny_flags, capsys):
    """Not quiet: the run's log lines on stdout, the stop once, as the error line on stderr
    (the trainer's log said it too)."""
    flags = [f for f in tiny_flags if f != "--quiet"]
    code, out, err = run(["train", *flags, "--lr", "1e6", "--min-lr", "0", "--grad-clip", "0",
                          "--steps", "30", "--warmup", "0", "--no-progress"], capsys)
    assert code == 1, err
    assert out.startswith("training ") and "training stopped" not in out
    assert err.count("training stopped:") == 1


# ---------------------------------------------------------------------------------------------
# generate


def test_generate_with_and_without_cache(tmp_path, tiny_flags, capsys):
    out = tmp_path / "run"
    assert run(["train", *tiny_flags, "--out", out, "--steps", "20",
                "--connection", "mhc"], capsys)[0] == 0
    args = ["generate", "--checkpoint", out, "--prompt", "def f1(x):\n", "--temperature", "0",
            "--max-new-tokens", "16"]
    code, cached, err = run(args, capsys)
    assert code == 0, err
    assert "KV cache on" in err
    code, uncached, err = run([*args, "--no-cache"], capsys)
    assert code == 0, err
    assert "KV cache off" in err
    assert cached == uncached  # greedy decoding: the cache changes the speed, not the text
    assert cached.startswith("def f1(x):\n") and len(cached.encode()) >= 12
    import torch

    before = torch.get_num_threads()
    code, one_thread, err = run([*args, "--threads", "1"], capsys)
    assert code == 0 and one_thread == cached, err
    assert torch.get_num_threads() == before  # the command's setting ends with it
    code, _, err = run([*args, "--threads", "-1"], capsys)
    assert_one_line_error(code, err, "--threads must be >= 0 (0: torch's default), got -1")

    code, _, err = run(["generate", "--checkpoint", out, "--prompt", "x" * 40], capsys)
    assert_one_line_error(code, err, "longer than the model allows", "max_seq_len 32",
                          "--no-cache")
    # without the cache the window slides over a long prompt, as over the tokens made
    code, text, err = run(["generate", "--checkpoint", out, "--prompt", "y" * 10 + "x" * 40,
                           "--no-cache", "--temperature", "0", "--max-new-tokens", "4"], capsys)
    assert code == 0, err
    assert "[the prompt is 50 bytes: the model sees its last 32" in err
    code, cropped, err = run(["generate", "--checkpoint", out, "--prompt", "x" * 32,
                              "--no-cache", "--temperature", "0", "--max-new-tokens", "4"],
                             capsys)
    assert code == 0, err
    # the first 18 bytes of the prompt were out of view: the same 4 new bytes
    assert text == "y" * 10 + "x" * 8 + cropped
    code, _, err = run(["generate", "--checkpoint", out, "--prompt", "x" * 20,
                        "--max-new-tokens", "20"], capsys)
    assert_one_line_error(code, err, "exceed the model's max_seq_len 32", "--no-cache")
    # without --max-new-tokens, as many as the cache has positions for (not the usual 200)
    code, text, err = run(["generate", "--checkpoint", out, "--prompt", "x" * 20], capsys)
    assert code == 0, err
    assert ("[13 new tokens: as many as the model's max_seq_len 32 leaves after the 20-byte "
            "prompt (the last new token is never fed back, so it takes no position); "
            "--no-cache" in err)  # positions 0-31 hold the prompt and 12 of them
    assert "[13 tokens in" in err and len(text.encode()) >= 20
    code, text, err = run(["generate", "--checkpoint", out, "--prompt", "x" * 20,
                           "--no-cache", "--temperature", "0"], capsys)
    assert code == 0, err
    assert "[200 tokens in" in err and "new tokens:" not in err
    # a folder of runs (as `mhc compare` writes): the error names the runs inside
    shutil.copytree(out, tmp_path / "compare" / "mhc")
    shutil.copytree(out, tmp_path / "compare" / "hc" / "seed0")
    code, _, err = run(["generate", "--checkpoint", tmp_path / "compare"], capsys)
    assert_one_line_error(code, err, "it holds the runs hc/seed0, mhc",
                          f"e.g. {tmp_path / 'compare' / 'hc' / 'seed0'}")
    code, _, err = run(["generate", "--checkpoint", out, "--prompt", ""], capsys)
    assert_one_line_error(code, err, "--prompt must not be empty")


# ---------------------------------------------------------------------------------------------
# cost, help, python -m


def test_cost_prints_the_cost_model(capsys):
    import json

    from torch_mhc.tools.cost.model import PAPER_27B, CostConfig, estimate

    code, out, _ = run(["cost", "--preset", "paper-27b", "--json"], capsys)
    assert code == 0
    assert out == json.dumps(estimate(CostConfig(**PAPER_27B)), indent=2) + "\n"


def test_help_lists_subcommands(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    for name in ("train", "compare", "generate", "cost"):
        assert name in out


def test_output_into_a_closed_pipe_stops_quietly():
    """A command whose output's reader is gone (`mhc export-hf ... | head -0`) stops with 141
    (as under SIGPIPE) and no error line, where it said "error: Broken pipe (EPIPE)" with
    status 2 (and 1 with stderr on the same pipe). The first command prints its lines as
    export-hf does at its end, inside the `mhc` boundary; `mhc cost` is one of the tools
    with their own parsing (it printed a traceback)."""
    script = ("import sys; from torch_mhc.tools import cli; "
              "cli._dispatch = lambda argv: print('wrote it\\n' * 10000, flush=True) or 0; "
              "sys.exit(cli.main(['export-hf']))")
    commands = [[sys.executable, "-c", script],
                [sys.executable, "-m", "torch_mhc", "cost", "--preset", "paper-27b"]]
    for command, stderr in itertools.product(commands, (subprocess.PIPE, subprocess.STDOUT)):
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr)
        proc.stdout.close()  # before the interpreter has started: the first write fails
        err = proc.stderr.read().decode() if proc.stderr else ""
        assert proc.wait(timeout=120) == 141 and err == "", err


def test_every_option_with_a_default_names_it():
    """`mhc SUBCOMMAND --help` says what each optional value defaults to (flags, required
    options and options whose absence means "none" need not)."""
    import argparse

    from torch_mhc.tools.cli import build_parser

    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction)).choices
    missing = [
        f"mhc {name} {a.option_strings[-1]}"
        for name, parser in commands.items() for a in parser._actions
        if a.option_strings and a.nargs != 0 and not a.required
        and a.default not in (None, False, argparse.SUPPRESS)
        and "default" not in (a.help or "")
    ]
    assert sorted(commands) == sorted(["train", "compare", "sweep", "generate", "export-hf",
                                       "cost", "bench", "upcycle"])
    assert missing == []


def test_python_dash_m(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch_mhc", "train", "--connection", "dense"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert "\n" not in line
    assert line.startswith("mhc train: error: ModelConfig.connection must be one of ('residual', "
                           "'hc', 'mhc'")
    assert line.endswith(", got 'dense'")


def test_an_error_line_is_one_write(monkeypatch):
    """Ranks that each report an error share one terminal: a line written in two pieces (text,
    then newline) let two ranks' lines run into one. Each line leaves in one write."""
    from torch_mhc.lm.train import CheckpointError
    from torch_mhc.tools import boundary

    class Recorder:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)
            return len(text)

        def flush(self):
            pass

    err = Recorder()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("RANK", "1")
    assert boundary.report("mhc train", CheckpointError("checkpoint c is corrupt"), None) == 2
    assert err.writes == ["mhc train: error: checkpoint c is corrupt\n"]


def test_an_interrupt_is_said_by_rank_0_only(monkeypatch, capsys):
    """Under torchrun every rank stops alike at Ctrl-C: rank 0 says so, the others exit with
    the same status in silence (their lines ran into one)."""
    from torch_mhc.lm.train import RunInterrupted
    from torch_mhc.tools import boundary

    stop = RunInterrupted("interrupted after step 3; checkpoint x", 3, "x")
    for rank, said in (("1", ""), ("0", "mhc train: interrupted after step 3; checkpoint x\n")):
        monkeypatch.setenv("RANK", rank)
        assert boundary.report("mhc train", stop, None) == 130
        assert capsys.readouterr().err == said
