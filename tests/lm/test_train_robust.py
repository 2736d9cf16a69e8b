"""The run folder against links, damaged state and stops at any instruction: symbolic links
are refused and never followed, a rotation stopped at any filesystem step loses no verified
checkpoint, everything a checkpoint holds is validated with a fall back, and every failure or
signal reaching `mhc` is one line with its exit status."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import signal
from pathlib import Path

import pytest
import torch

import torch_mhc.lm.parallel.checkpoint as C
import torch_mhc.lm.train.checkpoint as ckpt
import torch_mhc.lm.train.trainer as T
from tests.helpers.cli import one_line, run_cli
from torch_mhc.lm.model import LM
from torch_mhc.lm.train import RunLock, RunLockedError, load_checkpoint, load_model


def tree_bytes(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture
def outside(tmp_path) -> Path:
    """A folder outside the run, with a file whose bytes must never change."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "precious.txt").write_bytes(b"do not touch\n" * 10)
    return folder


# ---------------------------------------------------------------------------------------------
# Symbolic links: refused with one line, never followed, never deleted through


def test_symlinked_lock_is_refused_and_its_target_untouched(tmp_path, outside, tiny_flags,
                                                            capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").symlink_to(outside / "precious.txt")
    before = tree_bytes(outside)
    code, _, err = run_cli(["train", *tiny_flags, "--out", out], capsys)
    assert code == 2
    line = one_line(err)
    assert line.startswith("mhc train: error: the lock ") and "is a symbolic link" in line
    assert tree_bytes(outside) == before and (out / ".lock").is_symlink()
    assert not (out / "ckpt").exists()


def test_lock_that_is_a_hard_link_or_not_a_file_is_refused(tmp_path, outside):
    os.link(outside / "precious.txt", tmp_path / ".lock")
    before = tree_bytes(outside)
    with pytest.raises(RunLockedError, match="has 2 hard links: refusing"):
        RunLock(tmp_path).acquire()
    assert tree_bytes(outside) == before
    other = tmp_path / "other"
    (other / ".lock").mkdir(parents=True)
    with pytest.raises((RunLockedError, IsADirectoryError)):
        RunLock(other).acquire()


@pytest.mark.parametrize("name", ["ckpt", "ckpt.prev", "ckpt.partial", "ckpt.old",
                                  "metrics.jsonl"])
def test_symlinked_run_files_are_refused(trained, outside, tiny_flags, capsys, name):
    target = outside / "a_checkpoint"
    if name == "metrics.jsonl":
        target = outside / "precious.txt"
    else:
        shutil.copytree(trained / "ckpt.prev", target)
    shutil.rmtree(trained / name, ignore_errors=True)
    with_file = trained / name
    if with_file.exists():
        with_file.unlink()
    with_file.symlink_to(target)
    before = tree_bytes(outside)
    code, _, err = run_cli(["train", *tiny_flags, "--out", trained, "--steps", "6",
                            "--resume"], capsys)
    assert code == 2
    line = one_line(err)
    assert f"{trained / name} is a symbolic link" in line and "refusing to follow it" in line
    assert tree_bytes(outside) == before and with_file.is_symlink()


def test_rotation_refuses_a_link_it_would_delete_through(tmp_path, outside):
    out = tmp_path / "run"
    model = torch.nn.Linear(2, 2)
    ckpt.save_checkpoint(out, model, None, {"step": 1})
    ckpt.save_checkpoint(out, model, None, {"step": 2})
    shutil.rmtree(out / "ckpt.prev")
    (out / "ckpt.prev").symlink_to(outside)
    before = tree_bytes(outside)
    with pytest.raises(OSError, match="ckpt.prev is a symbolic link"):
        ckpt.save_checkpoint(out, model, None, {"step": 3})
    assert tree_bytes(outside) == before
    assert C.read_extra(out / "ckpt")["step"] == 2


# ---------------------------------------------------------------------------------------------
# Rotation: the last verified checkpoint survives a fall back and a stop at any step


def test_fallback_sets_the_corrupt_one_aside_and_keeps_the_good_one(trained,
                                                                    resumes_from_prev):
    raw = bytearray((trained / "ckpt" / "__0_0.distcp").read_bytes())
    raw[100] ^= 0xFF
    (trained / "ckpt" / "__0_0.distcp").write_bytes(bytes(raw))
    corrupt = tree_bytes(trained / "ckpt")
    resumes_from_prev(f"moved {trained / 'ckpt'} aside to ckpt.corrupt-1", steps=4)
    assert load_checkpoint(trained / "ckpt.prev")["step"] == 2  # the one resumed from
    assert tree_bytes(trained / "ckpt.corrupt-1") == corrupt


def _state(cfg, step: int) -> dict:
    return {"format": ckpt.CHECKPOINT_FORMAT, "model_config": cfg.model.to_dict(),
            "train_config": {}, "step": step, "sampler": {}, "rng": {}, "history": {},
            "spike": {}}


def _model_at(cfg, step: int) -> LM:
    model = LM(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    return model


def _newest_verified(cfg) -> tuple[Path, int]:
    """What a resume loads: the checkpoint and the step its tensors hold."""
    path, state = ckpt.open_for_resume(cfg, say=lambda message: None)
    model = LM(cfg.model)
    ckpt.restore(path, model, None)
    value = next(model.parameters()).flatten()[0].item()
    assert value == state["step"], (path, value, state["step"])
    return path, state["step"]


class _StopAt:
    """Wraps every filesystem step of a save; raises KeyboardInterrupt instead of the k-th."""

    NAMES = ("_rename", "remove_tree", "atomic_write", "fsync_dir")

    def __init__(self, monkeypatch, k: int):
        self.k, self.calls, self.stopped = k, [], None
        for name in self.NAMES:
            monkeypatch.setattr(C, name, self._wrap(name, getattr(C, name)))
        monkeypatch.setattr(C.dcp, "save", self._wrap("dcp.save", C.dcp.save))

    def _wrap(self, name, fn):
        def step(*args, **kwargs):
            self.calls.append((name, args))
            if len(self.calls) == self.k:
                self.stopped = (name, args)
                raise KeyboardInterrupt(f"stopped at {name}")
            return fn(*args, **kwargs)
        return step

    def committed(self) -> bool:
        """Whether the new checkpoint was renamed into place before the stop."""
        return any(name == "_rename" and Path(args[0]).name == "ckpt.partial"
                   for name, args in self.calls[:self.k - 1])


@pytest.mark.parametrize("scenario", ["plain", "after_fallback"])
def test_rotation_stopped_at_every_step_keeps_the_newest_verified(tmp_path, tiny_config,
                                                                  monkeypatch, scenario):
    base = tmp_path / "base"
    cfg = tiny_config("mhc", out_dir=str(base), resume=True, steps=100)
    for step in (1, 2):
        ckpt.save_checkpoint(base, _model_at(cfg, step), None, _state(cfg, step))
    verified = base / "ckpt"
    older = 2
    if scenario == "after_fallback":  # ckpt is damaged: the run resumed from ckpt.prev
        raw = bytearray((base / "ckpt" / "__0_0.distcp").read_bytes())
        raw[64] ^= 0xFF
        (base / "ckpt" / "__0_0.distcp").write_bytes(bytes(raw))
        verified, older = base / "ckpt.prev", 1
    k, completed = 0, False
    while not completed:
        k += 1
        out = tmp_path / f"stop{k}"
        shutil.copytree(base, out)
        mine = cfg.updated({"out_dir": str(out)})
        with monkeypatch.context() as m:
            stop = _StopAt(m, k)
            try:
                ckpt.save_checkpoint(out, _model_at(cfg, 3), None, _state(cfg, 3),
                                     verified=out / verified.name, say=lambda message: None)
                completed = True
            except KeyboardInterrupt:
                pass
        expected = 3 if completed or stop.committed() else older
        path, step = _newest_verified(mine)
        assert step == expected, (k, stop.stopped, sorted(p.name for p in out.iterdir()))
        # the next save settles what the stopped one left and keeps it as the previous
        ckpt.save_checkpoint(out, _model_at(cfg, 4), None, _state(cfg, 4), verified=path,
                             say=lambda message: None)
        assert _newest_verified(mine) == (out / "ckpt", 4)
        assert C.read_extra(out / "ckpt.prev")["step"] == expected, (k, stop.stopped)
        assert not {"ckpt.old", "ckpt.partial", "ckpt.deleting", "ckpt.prev.deleting"} & {
            p.name for p in out.iterdir()}
    assert k > 10  # every step of the save was a stop point once


# ---------------------------------------------------------------------------------------------
# Everything read is validated; any failure of the newer checkpoint falls back


def _edit_extra(folder: Path, reseal, **changes) -> None:
    extra = torch.load(folder / "extra.pt", weights_only=True)
    extra.update(changes)
    torch.save(extra, folder / "extra.pt")
    reseal(folder)


@pytest.mark.parametrize("damage, message", [
    ("crc_text", "meta.json has a malformed entry 'extra.pt'"),
    ("step_text", "holds an invalid step 'four'"),
    ("step_negative", "holds an invalid step -3"),
    ("storage_outside", "points outside its checkpoint folder"),
])
def test_invalid_checkpoint_content_falls_back(trained, reseal, damage, message):
    last = trained / "ckpt"
    if damage == "crc_text":
        meta = json.loads((last / "meta.json").read_text())
        meta["files"]["extra.pt"][1] = "abc"
        (last / "meta.json").write_text(json.dumps(meta))
    elif damage.startswith("step"):
        _edit_extra(last, reseal, step="four" if damage == "step_text" else -3)
    else:
        with open(last / ".metadata", "rb") as f:
            metadata = pickle.load(f)  # our own file: trusted here
        for info in metadata.storage_data.values():
            info.relative_path = "../ckpt.prev/__0_0.distcp"
        with open(last / ".metadata", "wb") as f:
            pickle.dump(metadata, f)
        reseal(last)
    said = []
    model = load_model(trained, say=said.append)
    assert isinstance(model, LM)
    assert len(said) == 1 and message in said[0] and "ckpt.prev" in said[0], said


def test_truncated_shard_with_resealed_sums_resumes_from_prev(trained, reseal,
                                                              resumes_from_prev):
    shard = trained / "ckpt" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:200])
    reseal(trained / "ckpt")
    resumes_from_prev("cannot be loaded")
    lines = [json.loads(s) for s in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"][:2] == [2, 4]


def test_interrupted_rotation_left_in_old_is_found(trained):
    (trained / "ckpt").rename(trained / "ckpt.old")  # stopped between the two renames
    shutil.rmtree(trained / "ckpt.prev")
    said = []
    load_model(trained, say=said.append)
    assert load_checkpoint(trained)["step"] == 4


# ---------------------------------------------------------------------------------------------
# The CLI's one boundary: one line and the documented status for any failure or signal


def _writer_raises(monkeypatch, error: BaseException) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    def fail(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(FileSystemWriter, "write_data", fail)


@pytest.mark.parametrize("error, status, needle", [
    (KeyboardInterrupt(), 130, "mhc train: interrupted"),
    (OSError(errno.EFBIG, "File too large"), 3, "file too large (over the file-size limit"),
    (OSError(errno.ENOSPC, "No space left on device"), 3, "no space left on the device"),
    (PermissionError(errno.EACCES, "Permission denied", "/x/y"), 2,
     "error: Permission denied (EACCES): /x/y"),
])
def test_failures_inside_dcp_save_are_one_line(tmp_path, tiny_flags, capsys, monkeypatch,
                                               error, status, needle):
    out = tmp_path / "run"
    assert run_cli(["train", *tiny_flags, "--out", out, "--steps", "2"], capsys)[0] == 0
    before = tree_bytes(out / "ckpt")
    _writer_raises(monkeypatch, error)
    code, _, err = run_cli(["train", *tiny_flags, "--out", out, "--steps", "4", "--resume"],
                           capsys)
    line = one_line(err)
    assert code == status and needle in line, line
    if error.__class__ is OSError and error.errno == errno.EFBIG:
        assert "no space" not in line
    assert tree_bytes(out / "ckpt") == before and not (out / "ckpt.partial").exists()


@pytest.mark.parametrize("error, needle", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't "
                  "allocate memory: you tried to allocate 68719476736 bytes. Error code 12"),
     "model too large for memory: dim 32"),
    (MemoryError(), "model too large for memory: dim 32"),
])
def test_model_too_large_for_memory_is_one_line(tmp_path, tiny_flags, capsys, monkeypatch,
                                                error, needle):
    def build(*args, **kwargs):
        raise error

    monkeypatch.setattr(T, "build_model", build)
    code, _, err = run_cli(["train", *tiny_flags, "--out", tmp_path / "run"], capsys)
    assert code == 2 and needle in one_line(err)


def test_unexpected_error_is_one_line(tmp_path, tiny_flags, capsys, monkeypatch):
    def build(*args, **kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(T, "build_model", build)
    monkeypatch.delenv("MHC_TRACEBACK", raising=False)
    code, _, err = run_cli(["train", *tiny_flags, "--out", tmp_path / "run"], capsys)
    assert code == 4 and "internal error, ZeroDivisionError: boom" in one_line(err)


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_the_final_save_exits_128_plus_signum(tmp_path, tiny_flags, capsys,
                                                            monkeypatch, signum, status):
    save = ckpt.save_checkpoint

    def save_then_signal(*args, **kwargs):
        os.kill(os.getpid(), signum)
        return save(*args, **kwargs)

    monkeypatch.setattr(T.ckpt, "save_checkpoint", save_then_signal)
    out = tmp_path / "run"
    code, _, err = run_cli(["train", *tiny_flags, "--out", out, "--steps", "2"], capsys)
    assert code == status
    assert one_line(err).startswith("mhc train: interrupted after step 2; checkpoint")
    assert load_checkpoint(out)["step"] == 2


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_teardown_exits_128_plus_signum(tmp_path, tiny_flags, capsys,
                                                      monkeypatch, signum, status):
    release = RunLock.release

    def release_with_signal(self):
        try:
            os.kill(os.getpid(), signum)
        finally:
            release(self)

    monkeypatch.setattr(RunLock, "release", release_with_signal)
    out = tmp_path / "run"
    code, _, err = run_cli(["train", *tiny_flags, "--out", out, "--steps", "2"], capsys)
    assert code == status and f"interrupted by {signal.Signals(signum).name}" in one_line(err)
    assert load_checkpoint(out)["step"] == 2
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the command restored it
