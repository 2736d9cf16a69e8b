"""Checkpoints and run folders under attack: hostile and damaged files, a full disk, two runs in
one folder, Ctrl-C, torn metrics, stale temporary files, and the exit status of each."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import torch_mhc.lm.parallel as par
import torch_mhc.lm.train.metrics as M
from tests.helpers.cli import one_line, run_cli
from torch_mhc.lm.train import CheckpointError, RunLock, RunLockedError, load_checkpoint, train


def folder_bytes(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


class _RunsCode:
    """Unpickling it runs `touch <marker>` (what a crafted checkpoint would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# ---------------------------------------------------------------------------------------------
# No code runs on load


def test_crafted_metadata_runs_no_code(tmp_path, trained, reseal, tiny_config, capsys):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_RunsCode(marker))
    pickle.loads(payload)  # the payload is live: plain pickle runs it
    assert marker.exists()
    marker.unlink()

    ckpt = trained / "ckpt"
    (ckpt / ".metadata").write_bytes(payload)
    reseal(ckpt)  # sums that match: only the reader itself stands in the way
    model = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match=r"posix\.system is not a type DCP metadata holds"):
        par.load_checkpoint(ckpt, model)
    with pytest.raises(CheckpointError, match="not a type DCP metadata holds"):
        par.read_state_dict(ckpt)
    shutil.copytree(ckpt, tmp_path / "evil")  # on its own: refused
    code, _, err = run_cli(["generate", "--checkpoint", tmp_path / "evil"], capsys)
    assert code == 2 and "not a type DCP metadata holds" in one_line(err)
    # in its run folder: generation falls back to ckpt.prev, saying why
    code, _, err = run_cli(["generate", "--checkpoint", trained, "--max-new-tokens", "4"],
                           capsys)
    assert code == 0 and "not a type DCP metadata holds" in err.splitlines()[0]
    # resume = True: the damaged ckpt falls back to ckpt.prev, with a message
    r = train(tiny_config("mhc", out_dir=str(trained), steps=5, resume=True))
    assert "resuming from the previous checkpoint" in capsys.readouterr().err
    assert r.steps == 5 and len(r.loss_history) == 5
    assert not marker.exists()


def test_crafted_value_in_distcp_runs_no_code(tmp_path, reseal):
    """DCP's own planner unpickles non-tensor values in full; ours uses weights_only."""
    marker = tmp_path / "pwned"
    folder = tmp_path / "evil"
    state = {"model": {"w": torch.ones(2)}, "optim": {"param_groups.w.lr": _RunsCode(marker)}}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, checkpoint_id=folder)
    torch.save({}, folder / "extra.pt")
    (folder / "meta.json").write_text(json.dumps({"format": "torch_mhc.dcp.v2"}))
    reseal(folder)
    with pytest.raises(CheckpointError, match="cannot be loaded .*Weights only load failed"):
        par.read_state_dict(folder)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints: one line, exit 2; a damaged ckpt falls back to ckpt.prev


@pytest.mark.parametrize("damage, message", [
    ("flip", "is corrupt: __0_0.distcp has size"),
    ("truncate_metadata", "is corrupt: .metadata has size"),
    ("garbage_metadata_resealed", "is not valid DCP metadata"),
    ("truncate_metadata_resealed", "is not valid DCP metadata"),
    ("truncate_distcp_resealed", "cannot be loaded"),
    ("no_meta", "no checkpoint at"),
    ("bad_meta_json", "unreadable meta.json"),
])
def test_damaged_checkpoint_is_one_line(tmp_path, trained, reseal, tiny_flags, capsys, damage,
                                        message):
    ckpt = tmp_path / "damaged"
    shutil.copytree(trained / "ckpt", ckpt)
    data, meta = ckpt / "__0_0.distcp", ckpt / ".metadata"
    if damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01  # one bit of one weight
        data.write_bytes(bytes(raw))
    elif damage.startswith("truncate_metadata"):
        meta.write_bytes(meta.read_bytes()[:100])
    elif damage == "garbage_metadata_resealed":
        meta.write_bytes(b"\x80\x04garbage" * 10)
    elif damage == "truncate_distcp_resealed":
        data.write_bytes(data.read_bytes()[:1000])
    elif damage == "no_meta":
        (ckpt / "meta.json").unlink()
    elif damage == "bad_meta_json":
        (ckpt / "meta.json").write_text("{not json")
    if damage.endswith("resealed"):
        reseal(ckpt)
    for argv in (["generate", "--checkpoint", ckpt],
                 ["train", *tiny_flags, "--out", tmp_path / "new", "--resume", ckpt]):
        code, _, err = run_cli(argv, capsys)
        assert code == 2 and message in one_line(err), err
    assert not (tmp_path / "new" / "ckpt").exists()


def test_corrupt_last_falls_back_to_prev(trained, resumes_from_prev, capsys):
    raw = bytearray((trained / "ckpt" / "__0_0.distcp").read_bytes())
    raw[100] ^= 0xFF
    (trained / "ckpt" / "__0_0.distcp").write_bytes(bytes(raw))
    resumes_from_prev("is corrupt: __0_0.distcp")
    # generate falls back alike
    raw = bytearray((trained / "ckpt" / "__0_0.distcp").read_bytes())
    raw[100] ^= 0xFF
    (trained / "ckpt" / "__0_0.distcp").write_bytes(bytes(raw))
    code, text, err = run_cli(["generate", "--checkpoint", trained, "--max-new-tokens", "4",
                               "--temperature", "0"], capsys)
    assert code == 0 and text.startswith("def ")
    assert err.splitlines()[0].startswith("mhc generate: warning: ")
    assert "loading the previous checkpoint" in err.splitlines()[0]
    # the metrics file reads as one run resumed at step 2
    lines = [json.loads(s) for s in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"] == [2, 4, 6]


@pytest.mark.parametrize("sampler", [
    {"rng": {"bit_generator": "not a generator"}},  # a generator state numpy refuses
    {"batch_size": None},  # no batch shape: damaged, not another launch's setting
])
def test_damaged_sampler_state_falls_back_to_prev(trained, resumes_from_prev, reseal,
                                                  sampler):
    extra = torch.load(trained / "ckpt" / "extra.pt", weights_only=True)
    extra["sampler"] = {**extra["sampler"], **sampler}
    torch.save(extra, trained / "ckpt" / "extra.pt")
    reseal(trained / "ckpt")
    resumes_from_prev("does not fit this run")


def test_another_model_is_refused_before_any_tensor_is_read(trained, tiny_config, monkeypatch):
    def no_tensors(*args, **kwargs):
        raise AssertionError("tensors read before the configuration was checked")

    monkeypatch.setattr(par, "load_checkpoint", no_tensors)
    with pytest.raises(CheckpointError, match=r"another model \(dim: checkpoint 32, config 64"):
        train(tiny_config("mhc", out_dir=str(trained), steps=6, resume=True, dim=64))


def test_overwrite_never_leaves_two_runs_side_by_side(trained, tiny_config):
    """A fresh run with overwrite replaces ckpt and ckpt.prev of the run it overwrites once
    its own first checkpoint is complete; from then on ckpt.prev is its own."""
    train(tiny_config("mhc", out_dir=str(trained), steps=2, seed=1, overwrite=True))
    assert not (trained / "ckpt.prev").exists()
    state = load_checkpoint(trained)
    assert state["step"] == 2 and state["train_config"]["seed"] == 1
    train(tiny_config("mhc", out_dir=str(trained), steps=3, seed=1, resume=True))
    assert load_checkpoint(trained / "ckpt.prev")["train_config"]["seed"] == 1


# ---------------------------------------------------------------------------------------------
# A full disk: exit 3, the previous checkpoint intact, nothing half-written left


def test_disk_full_during_checkpoint_exits_3(tmp_path, tiny_flags, capsys, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    out = tmp_path / "run"
    assert run_cli(["train", *tiny_flags, "--out", out, "--steps", "2"], capsys)[0] == 0
    before = folder_bytes(out / "ckpt")

    def no_space(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", no_space)
    code, _, err = run_cli(["train", *tiny_flags, "--out", out, "--steps", "4", "--resume"],
                           capsys)
    assert code == 3
    assert "no space left on the device writing the checkpoint" in one_line(err)
    assert folder_bytes(out / "ckpt") == before
    assert not (out / "ckpt.partial").exists() and not list(out.glob(".*.tmp"))


def test_disk_full_writing_metrics_exits_3(tmp_path, tiny_flags, capsys, monkeypatch):
    def no_space(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(M, "_write_all", no_space)
    code, _, err = run_cli(["train", *tiny_flags, "--out", tmp_path / "run"], capsys)
    assert code == 3 and "no space left on the device writing" in one_line(err)


# ---------------------------------------------------------------------------------------------
# One run per folder; Ctrl-C


def _mhc(*args) -> list[str]:
    return [sys.executable, "-m", "torch_mhc", *map(str, args)]


@pytest.mark.slow
def test_second_run_is_refused_and_ctrl_c_checkpoints(tmp_path, tiny_flags):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(_mhc("train", *tiny_flags, "--out", out, "--steps", "100000",
                                  "--log-every", "1", "--threads", "1"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first run did not start training"
            time.sleep(0.2)
        lines_before = metrics.read_text().count("\n")
        second = subprocess.run(_mhc("train", *tiny_flags, "--out", out, "--overwrite"),
                                capture_output=True, text=True, timeout=120, env=env)
        assert second.returncode == 2
        line = one_line(second.stderr)
        assert f"is in use by process {first.pid}" in line and "one run per out_dir" in line
        assert metrics.read_text().count("\n") >= lines_before  # not replaced
        assert not (out / "ckpt").exists()  # nothing written by the refused run

        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130
    line = one_line(err)
    assert line.startswith("mhc train: interrupted after step ")
    # the command that continues the run, runnable as printed
    resume = shlex.join(["mhc", "train", "--out-dir", str(out), "--resume"])
    assert line.endswith(f"which `{resume}` continues")
    step = int(line.split("after step ")[1].split(";")[0])
    assert load_checkpoint(out)["step"] == step >= 3
    records = [json.loads(s) for s in metrics.read_text().splitlines()]
    assert records[-1] == {"kind": "stopped", "step": step, "reason": "interrupted"}
    assert (out / ".lock").read_text() == ""  # released: no owner left in the file


def test_lock_of_a_killed_process_is_taken_over(tmp_path, run_python):
    code = (f"import os, signal\nfrom torch_mhc.lm.train import RunLock\n"
            f"RunLock({str(tmp_path)!r}).acquire()\nprint(os.getpid(), flush=True)\n"
            f"os.kill(os.getpid(), signal.SIGKILL)\n")
    done = run_python(code)
    assert done.returncode == -signal.SIGKILL
    dead_pid = int(done.stdout.strip())
    assert (tmp_path / ".lock").read_text().strip() == str(dead_pid)  # left behind
    with RunLock(tmp_path) as lock:  # the kernel released the dead process's flock
        assert lock.stale_pid == dead_pid
        assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())
        with pytest.raises(RunLockedError, match=f"in use by process {os.getpid()}"):
            RunLock(tmp_path).acquire()  # a second lock, even in the same process


# ---------------------------------------------------------------------------------------------
# Stale temporary files, torn metrics


def test_stale_temp_files_and_torn_metrics_line(tmp_path, tiny_config):
    out = tmp_path / "run"
    train(tiny_config("mhc", out_dir=str(out), steps=4))
    (out / ".metrics.jsonl.k2j4.tmp").write_bytes(b"x" * 1000)  # a killed atomic write
    (out / "ckpt.partial").mkdir()  # a killed checkpoint save
    (out / "ckpt.partial" / "__0_0.distcp").write_bytes(b"x" * 1000)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 5, "lo')  # a line torn by a kill
    r = train(tiny_config("mhc", out_dir=str(out), steps=6, resume=True))
    assert r.steps == 6
    assert not list(out.glob(".*.tmp")) and not (out / "ckpt.partial").exists()
    records = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records if x["kind"] == "train"] == [2, 4, 6]


# ---------------------------------------------------------------------------------------------
# Bad settings of the folders: one line, exit 2


def test_bad_folders_are_one_line(tmp_path, tiny_flags, capsys):
    toml = tmp_path / "c.toml"
    toml.write_text("cache_dir = 5\n")
    code, _, err = run_cli(["train", "--config", toml, "--device", "cpu"], capsys)
    assert code == 2 and "cache_dir must be a folder path (a string), got 5" in one_line(err)

    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    code, _, err = run_cli(["train", *tiny_flags, "--out", a_file / "run"], capsys)
    assert code == 2
    assert f"out_dir {a_file / 'run'} cannot be a folder ({a_file} is a file)" in one_line(err)

    out = tmp_path / "run"
    (out / "metrics.jsonl").mkdir(parents=True)
    code, _, err = run_cli(["train", *tiny_flags, "--out", out], capsys)
    assert code == 2 and "metrics.jsonl is a folder" in one_line(err)


def test_help_lists_exit_statuses(capsys):
    code, out, _ = run_cli(["train", "--help"], capsys)
    assert code == 0
    for status, meaning in [("0", "finished"), ("1", "spike policy"), ("2", "bad input"),
                            ("3", "no space left"), ("130", "interrupted")]:
        assert any(line.split()[:1] == [status] and meaning in line
                   for line in out.splitlines()), status
