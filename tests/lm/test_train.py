"""Tests of torch_mhc.lm.train: learning, exact resume, the spike policy, checkpoints, config."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

import torch_mhc.lm.train.checkpoint as C
import torch_mhc.lm.train.steps as S
from torch_mhc.lm.model import LM
from torch_mhc.lm.train import (
    CheckpointError,
    ConfigError,
    LRSchedule,
    SpikeGuard,
    TrainConfig,
    TrainingDiverged,
    load_checkpoint,
    train,
)

# ---------------------------------------------------------------------------------------------
# Learning and the result


@pytest.mark.parametrize("residual", ["residual", "hc", "mhc"])
def test_model_learns_tiny_corpus(tmp_path, residual, tiny_config):
    cfg = tiny_config(residual, steps=60, batch_size=8, eval_every=30)
    r = train(cfg)
    start = r.loss_history[0]
    assert abs(start - math.log(256)) < 0.3  # an untrained byte model is near uniform
    assert r.final_loss < 0.45 * start
    assert r.val_loss < 0.45 * start
    assert r.val_bpb == pytest.approx(r.val_loss / math.log(2), rel=1e-12)
    assert [v["step"] for v in r.val_history] == [30, 60]
    assert len(r.loss_history) == len(r.grad_norm_history) == len(r.lr_history) == 60
    assert r.steps == 60 and r.tokens_per_s > 0 and r.step_time_median_s > 0
    assert r.peak_mem_bytes >= 0 and r.peak_mem_kind
    assert r.params == sum(p.numel() for p in LM(cfg.model).parameters())
    if residual == "residual":
        assert r.gain_history == [] and math.isnan(r.max_composite_gain_fwd)
    else:
        # gains at the start and at the end (gain_every = 0)
        assert [g["step"] for g in r.gain_history] == [0, 60]
        assert len(r.gain_history[-1]["composite_fwd"]) == 2 * cfg.model.n_layers


def test_initial_gains_and_mhc_rows(tmp_path, tiny_config):
    """At initialisation HC's H_res is the identity (gain exactly 1); mHC's rows sum to 1 at
    every step, so its composite forward gain stays 1 up to rounding."""
    hc = train(tiny_config("hc", steps=4, gain_every=2))
    assert hc.gain_history[0]["max_composite_fwd"] == pytest.approx(1.0, abs=1e-12)
    assert hc.gain_history[0]["max_composite_bwd"] == pytest.approx(1.0, abs=1e-12)
    mhc = train(tiny_config("mhc", steps=4, gain_every=2))
    for g in mhc.gain_history:
        assert g["max_composite_fwd"] == pytest.approx(1.0, abs=1e-5)


def test_same_seed_same_run_and_variants_start_alike(tmp_path, tiny_config):
    a = train(tiny_config("mhc"))
    b = train(tiny_config("mhc"))
    assert a.loss_history == b.loss_history  # bitwise: seeded weights and data order
    res = train(tiny_config("residual"))
    # every connection starts as the residual network, on the same first batch
    assert a.loss_history[0] == pytest.approx(res.loss_history[0], abs=1e-5)
    c = train(tiny_config("mhc", seed=1))
    assert c.loss_history[0] != a.loss_history[0]


def test_lr_schedule_cosine_and_step():
    cfg = TrainConfig(steps=100, lr=1.0, min_lr=0.1, warmup=10, schedule="cosine")
    s = LRSchedule(cfg)
    assert s(0) == pytest.approx(0.1) and s(9) == pytest.approx(1.0)
    assert s(10) == pytest.approx(1.0)
    mid = 10 + 45  # half-way through the cosine
    assert s(mid) == pytest.approx(0.1 + 0.9 * 0.5)
    assert s(100) == pytest.approx(0.1)
    step = LRSchedule(replace(cfg, schedule="step", step_decay=0.316))
    assert step(79) == 1.0
    assert step(80) == pytest.approx(0.316)
    assert step(89) == pytest.approx(0.316)
    assert step(90) == pytest.approx(0.316**2)


def test_step_schedule_is_used_in_training(tmp_path, tiny_config):
    r = train(tiny_config(steps=10, warmup=0, schedule="step", step_decay=0.5))
    assert r.lr_history == pytest.approx([3e-3] * 8 + [1.5e-3] + [7.5e-4])


# ---------------------------------------------------------------------------------------------
# Checkpoint and resume


class Crash(Exception):
    pass


def _crash_at(monkeypatch, call: int):
    """Make the call-th training forward raise Crash (as if the process died there)."""
    real = S.forward_loss
    calls = {"n": 0}

    def forward_loss(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise Crash(f"simulated crash in forward {call}")
        return real(*args, **kwargs)

    monkeypatch.setattr(S, "forward_loss", forward_loss)


def test_resume_equals_uninterrupted_run(tmp_path, monkeypatch, tiny_config):
    kw = dict(steps=10, checkpoint_every=4, gain_every=3, eval_every=5, log_every=1)
    full = train(tiny_config("mhc", out_dir=str(tmp_path / "full"), **kw))

    cut_dir = tmp_path / "cut"
    # forwards 1-5: steps 1-5; 6-7: the evaluation at step 5 (2 batches); 8-9: steps 6-7;
    # the 10th, step 8's, crashes: the last checkpoint is step 4's
    _crash_at(monkeypatch, call=10)
    with pytest.raises(Crash):
        train(tiny_config("mhc", out_dir=str(cut_dir), **kw))
    monkeypatch.undo()
    assert load_checkpoint(cut_dir)["step"] == 4

    resumed = train(tiny_config("mhc", out_dir=str(cut_dir), resume=True, **kw))
    assert resumed.steps == 10
    # bit for bit: the same weights, optimizer moments, RNG states and data position
    assert resumed.loss_history == full.loss_history
    assert resumed.grad_norm_history == full.grad_norm_history
    assert resumed.val_loss == full.val_loss
    assert [g["step"] for g in resumed.gain_history] == [0, 3, 6, 9, 10]
    for mine, theirs in zip(resumed.gain_history, full.gain_history, strict=True):
        for key in ("composite_fwd", "composite_bwd", "layer_bwd"):
            assert [c["max"] for c in mine[key]] == pytest.approx(
                [c["max"] for c in theirs[key]], rel=1e-6)

    # the metrics file reads as one run: the lines the crashed run wrote after step 4 are gone
    def train_steps(d):
        lines = [json.loads(s) for s in (d / "metrics.jsonl").read_text().splitlines()]
        return [(x["step"], x["loss"]) for x in lines if x["kind"] == "train"]

    cut, whole = train_steps(cut_dir), train_steps(tmp_path / "full")
    assert [s for s, _ in cut] == [s for s, _ in whole] == list(range(1, 11))
    assert [v for _, v in cut] == [v for _, v in whole]
    final_a, final_b = load_checkpoint(tmp_path / "full"), load_checkpoint(cut_dir)
    for part in ("model", "optimizer"):
        assert final_a[part].keys() == final_b[part].keys()
        for name, value in final_a[part].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(final_b[part][name], value), name
            else:
                assert final_b[part][name] == value, name


def test_resume_refuses_another_model(tmp_path, tiny_config):
    out = tmp_path / "run"
    train(tiny_config("mhc", out_dir=str(out), steps=2))
    before = _folder_bytes(out / "ckpt")
    with pytest.raises(CheckpointError, match=r"another model \(dim: checkpoint 32, config 64"):
        train(tiny_config("mhc", out_dir=str(out), steps=4, resume=True, dim=64))
    with pytest.raises(CheckpointError, match="connection: checkpoint 'mhc', config 'hc'"):
        train(tiny_config("hc", out_dir=str(out), steps=4, resume=True))
    # a fresh run must not replace the checkpoint either
    with pytest.raises(ConfigError, match="ckpt exists"):
        train(tiny_config("mhc", out_dir=str(out), steps=4))
    assert _folder_bytes(out / "ckpt") == before


def test_resume_refuses_another_batch_shape_without_falling_back(tmp_path, tiny_config,
                                                                  capsys):
    """Another batch size is the launch's setting, not a damaged checkpoint: one error that
    says what the run was trained on, and no fallback to ckpt.prev (which cannot fit
    either)."""
    out = tmp_path / "run"
    cfg = tiny_config("mhc", out_dir=str(out), steps=2)
    train(cfg)
    def files():  # (the run's lock is taken and released by every launch)
        return {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*")
                if p.name != ".lock"}

    before = files()
    capsys.readouterr()
    with pytest.raises(ConfigError, match=(
            f"ckpt was trained on batches of {cfg.batch_size} x {cfg.seq_len} tokens from "
            "[0-9,]+ training tokens; this launch has batches of 1 x "
            f"{cfg.seq_len} tokens from [0-9,]+ training tokens: a resumed run keeps its "
            "batch size, sequence length and data")):
        train(tiny_config("mhc", out_dir=str(out), steps=4, resume=True, batch_size=1))
    assert "ckpt.prev" not in capsys.readouterr().err
    assert files() == before


# ---------------------------------------------------------------------------------------------
# Spike policy


def _poison(monkeypatch, step: int, how):
    """Replace the training forward's loss at `step` (1-based) by how(loss, model)."""
    real = S.forward_loss
    calls = {"n": 0}

    def forward_loss(model, x, y, device, amp_dtype):
        loss = real(model, x, y, device, amp_dtype)
        if model.training:
            calls["n"] += 1
            if calls["n"] == step:
                return how(loss, model)
        return loss

    monkeypatch.setattr(S, "forward_loss", forward_loss)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch, tiny_config):
    out = tmp_path / "run"
    snapshot = {}
    real_save = C.save_checkpoint

    def save_and_snapshot(out_dir, model, optimizer, state, **kwargs):
        path = real_save(out_dir, model, optimizer, state, **kwargs)
        snapshot[state["step"]] = _folder_bytes(path)
        return path

    monkeypatch.setattr(C, "save_checkpoint", save_and_snapshot)
    _poison(monkeypatch, 5, lambda loss, model: loss * float("nan"))
    cfg = tiny_config("mhc", out_dir=str(out), steps=10, checkpoint_every=3)
    with pytest.raises(TrainingDiverged, match=r"not finite\) at step 5") as info:
        train(cfg)
    assert info.value.step == 5
    assert "last good checkpoint" in str(info.value) and "left untouched" in str(info.value)
    assert list(snapshot) == [3]
    assert _folder_bytes(out / "ckpt") == snapshot[3]  # byte for byte
    assert not (out / "ckpt.prev").exists()
    result = info.value.result
    assert result.steps == 4 and len(result.loss_history) == 4
    assert all(math.isfinite(v) for v in result.loss_history)
    lines = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["kind"] == "stopped" and lines[-1]["step"] == 5


def test_loss_spike_stops(tmp_path, monkeypatch, tiny_config):
    _poison(monkeypatch, 6, lambda loss, model: loss * 10.0)
    with pytest.raises(TrainingDiverged, match=r"loss spike at step 6: .* > 4 x the running mean"):
        train(tiny_config("residual", steps=10))


def test_spike_factor_zero_lets_a_spike_through(tmp_path, monkeypatch, tiny_config):
    _poison(monkeypatch, 6, lambda loss, model: loss * 10.0)
    r = train(tiny_config("residual", steps=8, spike_factor=0.0))
    assert r.steps == 8 and r.loss_history[5] > 20


def test_nan_gradient_stops_before_the_update(tmp_path, monkeypatch, tiny_config):
    def nan_grad(loss, model):
        # adds exactly 0 to the loss, but d sqrt(u)/du at u = 0 is inf, times 0 gives NaN
        return loss + torch.sqrt(model.tok_emb.weight.sum() * 0.0)

    _poison(monkeypatch, 3, nan_grad)
    with pytest.raises(TrainingDiverged, match=r"gradient norm is nan \(not finite\) at step 3"):
        train(tiny_config("hc", steps=6))


def test_spike_guard_unit():
    g = SpikeGuard(factor=3.0, window=2)
    assert g.check_loss(1, 100.0) is None  # nothing to compare with yet
    g.accept(1.0)
    g.accept(2.0)
    g.accept(4.0)  # the window keeps 2.0 and 4.0: mean 3.0
    assert g.check_loss(4, 8.9) is None
    assert "loss spike at step 4" in g.check_loss(4, 9.1)
    assert "not finite" in g.check_loss(4, float("inf"))
    h = SpikeGuard(3.0, 2)
    h.load_state_dict(g.state_dict())
    assert list(h.recent) == [2.0, 4.0]


# ---------------------------------------------------------------------------------------------
# Configuration


def test_config_validation_messages(tmp_path, tiny_config):
    cases = [
        ({"connection": "dense"}, "connection must be one of"),
        ({"seq_len": 64}, "seq_len 64 is longer than the model allows: max_seq_len is 32"),
        ({"steps": 0}, "steps must be an integer >= 1, got 0"),
        ({"lr": -1.0}, "lr must be a number > 0.0"),
        ({"min_lr": 1.0}, "min_lr (1.0) must not exceed lr"),
        ({"schedule": "linear"}, "schedule must be one of"),
        ({"dtype": "fp16"}, "dtype must be one of"),
        ({"spike_factor": 0.5}, "spike_factor must be 0"),
        ({"device": "tpu"}, "device must be"),
        ({"batch_size": 2.5}, "batch_size must be an integer"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=_re(message)):
            tiny_config().updated(overrides).validate()
    with pytest.raises(ConfigError, match="unknown config key 'step'"):
        TrainConfig().updated({"step": 3})
    with pytest.raises(ConfigError, match="unknown model config key 'width'"):
        TrainConfig().updated({"model": {"width": 3}})


def test_config_round_trip():
    cfg = TrainConfig().updated({"dim": 64, "n_heads": 2, "steps": 7, "model": {"streams": 2}})
    assert cfg.model.dim == 64 and cfg.model.streams == 2 and cfg.steps == 7
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_threads_setting_holds_for_the_run_and_is_restored(tmp_path, tiny_config,
                                                           monkeypatch):
    """threads sets torch's thread count while the run trains; afterwards (also after a
    failure inside the run) the process has the count it had before."""
    from torch_mhc.lm.train import trainer

    seen = []
    loop = trainer.Trainer._loop

    def recording_loop(self, start):
        seen.append(torch.get_num_threads())
        return loop(self, start)

    monkeypatch.setattr(trainer.Trainer, "_loop", recording_loop)
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    train(tiny_config("residual", steps=1, threads=other))
    assert seen == [other] and torch.get_num_threads() == before

    def failing_loop(self, start):
        seen.append(torch.get_num_threads())
        raise RuntimeError("inside the run")

    monkeypatch.setattr(trainer.Trainer, "_loop", failing_loop)
    with pytest.raises(RuntimeError, match="inside the run"):
        train(tiny_config("residual", steps=1, threads=other))
    assert seen == [other, other] and torch.get_num_threads() == before
    with pytest.raises(ConfigError, match="threads must be an integer >= 0"):
        tiny_config(threads=-1).validate()


def test_bad_data_inputs(tmp_path, tiny_config):
    with pytest.raises(ConfigError, match="does not exist"):
        train(tiny_config(data=str(tmp_path / "nope.txt")))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match="is empty"):
        train(tiny_config(data=str(empty)))
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n" * 4)
    with pytest.raises(ConfigError, match="corpus shorter than one batch"):
        train(tiny_config(data=str(short)))


def _folder_bytes(folder) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _re(text: str) -> str:
    import re

    return re.escape(text)
