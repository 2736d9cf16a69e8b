"""`mhc train --parallel ddp | fsdp | pp` under torchrun reproduces the single-process run.

Two CPU processes (gloo) launched by `torchrun --standalone` run the real command line on a
tiny model and corpus; the training losses they log (rank 0's metrics.jsonl) must equal those
of a plain `mhc train` with the same config to rtol 1e-5 (same seed, same global batches: the
ranks differ only in how the sums are split). An impossible layout must fail before training
with exit code 2 in the worker and a message naming the problem. Each launch has a timeout,
so a hang fails instead of blocking the suite.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers import launch

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                       reason="torch.distributed with the gloo backend is not available"),
]

TIMEOUT_S = 120  # one launch takes ~10 s on 2 busy cores
RTOL = 1e-5
STEPS = 4


def _flags(tmp_path: Path, out: str, *extra: str, steps: int = STEPS) -> list[str]:
    corpus = tmp_path / "corpus.txt"  # written by the single_losses fixture
    return [
        "train", "--data", str(corpus), "--cache-dir", str(tmp_path / "cache"),
        "--val-fraction", "0.1", "--dim", "32", "--n-layers", "2", "--n-heads", "2",
        "--max-seq-len", "16", "--seq-len", "16", "--batch-size", "4", "--steps", str(steps),
        "--lr", "3e-3", "--warmup", "2", "--eval-every", "0", "--eval-batches", "2",
        "--gain-every", "0", "--gain-batch-size", "2", "--log-every", "1", "--no-progress",
        "--no-tensorboard", "--quiet", "--dtype", "fp32", "--device", "cpu", "--threads", "1",
        "--out-dir", str(tmp_path / out), *extra,
    ]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    code, out = launch.run(cmd, TIMEOUT_S, " ".join(cmd))
    return subprocess.CompletedProcess(cmd, code, out)


def _torchrun(args: list[str]) -> list[str]:
    return launch.torchrun("-m", "torch_mhc.tools.cli", *args)


def _train_losses(out_dir: Path) -> list[float]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r["loss"] for r in records if r["kind"] == "train"]


@pytest.fixture(scope="module")
def single_losses(tmp_path_factory, corpus_writer) -> tuple[Path, list[float]]:
    tmp = tmp_path_factory.mktemp("train_dist")
    corpus_writer(tmp / "corpus.txt")
    done = _run([sys.executable, "-m", "torch_mhc", *_flags(tmp, "single")])
    assert done.returncode == 0, done.stdout[-4000:]
    losses = _train_losses(tmp / "single")
    assert len(losses) == STEPS
    return tmp, losses


@pytest.mark.parametrize("mode", [
    ["--parallel", "ddp"],
    ["--parallel", "fsdp"],
    ["--parallel", "pp", "--pp-schedule", "1f1b", "--micro-batches", "2"],
], ids=["ddp", "fsdp", "pp_1f1b"])
def test_parallel_train_logs_the_single_process_losses(single_losses, mode):
    tmp, reference = single_losses
    out = f"run_{mode[1]}"
    done = _run(_torchrun(_flags(tmp, out, *mode)))
    assert done.returncode == 0, done.stdout[-6000:]
    losses = _train_losses(tmp / out)
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, reference, strict=True), start=1):
        assert abs(got - want) <= RTOL * abs(want), f"step {step}: {got} vs {want}"
    assert losses[-1] < losses[0]  # it trained: the comparison is not of two constant runs
    assert (tmp / out / "ckpt" / "meta.json").is_file()  # the DCP checkpoint is complete


def test_impossible_layout_fails_before_training(tmp_path, corpus):
    # batch 4 cannot be split into 3 micro-batches
    done = _run(_torchrun(_flags(tmp_path, "bad", "--parallel", "pp", "--micro-batches", "3")))
    assert done.returncode != 0
    assert "exitcode  : 2" in done.stdout  # torchrun's report of the workers' exit code
    assert "mhc train: error: impossible parallel layout" in done.stdout
    assert "batch_size 4 is not divisible into 3 micro-batches" in done.stdout
    assert not (tmp_path / "bad").exists()  # nothing was written


def test_two_rank_checkpoint_resumes_in_one_process(single_losses):
    # FSDP2 on 2 ranks saves a DCP checkpoint at step STEPS; plain `mhc train --resume` (no
    # torchrun) continues it exactly as it continues the single-process run's checkpoint
    tmp, _ = single_losses
    done = _run(_torchrun(_flags(tmp, "fsdp_saved", "--parallel", "fsdp")))
    assert done.returncode == 0, done.stdout[-6000:]
    shutil.copytree(tmp / "single", tmp / "single_resumed")  # the fixture's run stays as it was
    for out in ("fsdp_saved", "single_resumed"):
        args = _flags(tmp, out, "--resume", steps=STEPS + 2)
        done = _run([sys.executable, "-m", "torch_mhc", *args])
        assert done.returncode == 0, done.stdout[-4000:]
    from_dcp, from_file = _train_losses(tmp / "fsdp_saved"), _train_losses(tmp / "single_resumed")
    assert len(from_dcp) == len(from_file) == STEPS + 2
    for got, want in zip(from_dcp[STEPS:], from_file[STEPS:], strict=True):
        assert abs(got - want) <= RTOL * abs(want)


def test_one_process_checkpoint_resumes_as_a_pipeline(single_losses):
    """The reverse of the above, with tied embeddings (the default): one process saves the
    head's optimizer state under the embedding's name only, which the pipeline's last stage
    (holding a copy of the head) reads for its copy; the pipeline then continues with the
    one-process resume's losses. It stopped on "Missing key ... optim.state.lm_head.weight"."""
    tmp, _ = single_losses
    for out in ("to_pipeline", "to_single"):
        shutil.copytree(tmp / "single", tmp / out)  # the fixture's run stays as it was
    pipeline = ["--parallel", "pp", "--pp-schedule", "1f1b", "--micro-batches", "2"]
    done = _run(_torchrun(_flags(tmp, "to_pipeline", "--resume", *pipeline, steps=STEPS + 2)))
    assert done.returncode == 0, done.stdout[-6000:]
    done = _run([sys.executable, "-m", "torch_mhc",
                 *_flags(tmp, "to_single", "--resume", steps=STEPS + 2)])
    assert done.returncode == 0, done.stdout[-4000:]
    got, want = _train_losses(tmp / "to_pipeline"), _train_losses(tmp / "to_single")
    assert len(got) == len(want) == STEPS + 2
    for g, w in zip(got[STEPS:], want[STEPS:], strict=True):
        assert abs(g - w) <= RTOL * abs(w)


def test_generate_reads_the_two_rank_checkpoint(single_losses, capsys):
    """One checkpoint format: `mhc generate` reads what FSDP2 on 2 ranks wrote, and decodes
    what the single-process run's checkpoint decodes (greedy; the weights agree to rtol)."""
    from torch_mhc.tools.cli import main

    tmp, _ = single_losses
    if not (tmp / "run_fsdp" / "ckpt").is_dir():
        done = _run(_torchrun(_flags(tmp, "run_fsdp", "--parallel", "fsdp")))
        assert done.returncode == 0, done.stdout[-6000:]
    texts = []
    for out in ("run_fsdp", "single"):
        args = ["generate", "--checkpoint", str(tmp / out), "--prompt", "def ",
                "--temperature", "0", "--max-new-tokens", "8", "--device", "cpu"]
        assert main(args) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("def ")
