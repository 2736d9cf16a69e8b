"""Each `mhc` command refuses a folder another command wrote, before writing anything there.

A real training run's folder is offered to `mhc compare`, `sweep` and `upcycle`, and each
other command's own file is put into a folder offered to the rest: every command that did not
write it stops with one line naming the file and its writer, and the folder is unchanged.
"""

from __future__ import annotations

import pytest

from tests.helpers.cli import assert_one_line_error, run_cli
from torch_mhc.lm.train import ConfigError
from torch_mhc.tools.out_dirs import MARKERS, check_out_dir

COMMANDS = ("train", "compare", "sweep", "upcycle")


def _argv(command: str, out, tiny_flags, source) -> list:
    data = tiny_flags[tiny_flags.index("--data"):tiny_flags.index("--data") + 4]
    if command == "train":
        return ["train", *tiny_flags, "--out-dir", out]
    if command == "compare":
        return ["compare", "--preset", "tiny", *data, "--out", out]
    if command == "sweep":
        return ["sweep", *data, "--out", out, "--no-progress"]
    return ["upcycle", "--from", source, "--kinds", "mhc", "--steps", "2", "--out", out]


def _listing(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.stat().st_mtime_ns
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def train_run(tmp_path_factory, tiny_config_under):
    from torch_mhc.lm.train import train

    root = tmp_path_factory.mktemp("out_dirs")
    train(tiny_config_under(root, "residual", steps=2, out_dir=str(root / "run")))
    return root / "run"


@pytest.mark.parametrize("command", ["compare", "sweep", "upcycle"])
def test_a_training_run_folder_is_refused_by_the_other_commands(command, train_run,
                                                                 tiny_flags, capsys):
    before = _listing(train_run)
    code, _, err = run_cli(_argv(command, train_run, tiny_flags, train_run), capsys)
    assert_one_line_error(code, err, f"holds ckpt, written by mhc train: mhc {command} would "
                                     "write its own files beside it; choose another folder")
    assert _listing(train_run) == before


@pytest.mark.parametrize("command, marker", [
    (command, marker) for command in COMMANDS
    for marker in ("report.json", "sweep.json", "upcycle.json")
    if MARKERS[marker] != f"mhc {command}"])
def test_another_commands_file_is_refused(command, marker, tmp_path, train_run, tiny_flags,
                                          capsys):
    writer = MARKERS[marker]
    out = tmp_path / "out"
    out.mkdir()
    (out / marker).write_text("{}")
    before = _listing(out)
    code, _, err = run_cli(_argv(command, out, tiny_flags, train_run), capsys)
    flag = "--out-dir" if command == "train" else "--out"
    assert_one_line_error(code, err, f"{flag} {out} holds {marker}, written by {writer}")
    assert _listing(out) == before


@pytest.mark.parametrize("command, marker, below", [
    ("train", "report.json", "mhc"), ("train", "report.json", "mhc/seed0"),
    ("train", "upcycle.json", "hc/seed1"), ("compare", "upcycle.json", "mhc"),
    ("sweep", "report.json", "hc"), ("train", "sweep.json", "cells/mhc-L2-lr0.01-s0")])
def test_a_folder_among_another_commands_runs_is_refused(command, marker, below, tmp_path,
                                                         train_run, tiny_flags, capsys):
    """A comparison's and an upcycling's runs live in <kind>/ and <kind>/seed<S>/, a sweep's
    in cells/<cell>/: a training run put there by hand would sit among them (and export-hf
    --kind would export it as the comparison's)."""
    root = tmp_path / "theirs"
    root.mkdir()
    (root / marker).write_text("{}")
    out = root / below
    before = _listing(root)
    code, _, err = run_cli(_argv(command, out, tiny_flags, train_run), capsys)
    flag = "--out-dir" if command == "train" else "--out"
    assert_one_line_error(code, err, f"{flag} {out} lies inside ",
                          f"a folder of {MARKERS[marker]} (it holds {marker}), among that "
                          "command's runs")
    assert _listing(root) == before


@pytest.mark.parametrize("below", ["notes", "mhc/plots", "mhc/seed0/x", "cells"])
def test_other_folders_beside_another_commands_files_are_the_users(below, tmp_path):
    """Only the folders a command keeps its runs in are refused: a folder that merely holds a
    report.json (a common name) takes any other folder below it."""
    (tmp_path / "report.json").write_text("{}")
    assert check_out_dir(tmp_path / below, "mhc train") == tmp_path / below


def test_a_relative_folder_is_placed_where_it_lies(tmp_path, monkeypatch):
    """'../x' from inside a comparison lies beside it, not inside it; 'mhc' there lies
    among its runs."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "report.json").write_text("{}")
    monkeypatch.chdir(theirs)
    check_out_dir("../other", "mhc train")
    check_out_dir("../other/mhc", "mhc train")
    with pytest.raises(ConfigError, match="--out mhc lies inside .*theirs, a folder of mhc "
                                          "compare"):
        check_out_dir("mhc", "mhc train")
