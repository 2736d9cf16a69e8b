"""Fixtures shared by every test folder (helpers that are plain functions and classes live in
tests/helpers/, imported as `tests.helpers.<name>`; no test module imports another).

- `corpus`: a small, very regular text corpus (~14 KB) a tiny model learns in a few dozen steps
  (`corpus_writer(path)` writes it elsewhere);
- `tiny_config(connection="mhc", **overrides)`: a TrainConfig of a 2-block, width-32 LM on it,
  fp32 on the CPU, quiet, a few steps (seconds); `tiny_config_under(root, ...)` the same for
  module-wide fixtures;
- `tiny_flags`: the same as `mhc train` flags (without --data / --cache-dir);
- `run_python(code, timeout)`: a fresh interpreter running code, for import-level checks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TINY_FLAGS = ["--dim", "32", "--n-layers", "2", "--n-heads", "2", "--max-seq-len", "32",
              "--seq-len", "32", "--batch-size", "4", "--steps", "4", "--warmup", "1",
              "--eval-batches", "2", "--gain-batch-size", "2", "--val-fraction", "0.1",
              "--quiet", "--no-progress", "--no-tensorboard", "--dtype", "fp32",
              "--device", "cpu"]


def write_corpus(path: Path, n_lines: int = 400) -> Path:
    lines = [f"def f{i % 17}(x):\n    return x * {i % 7} + {i % 5}\n" for i in range(n_lines)]
    path.write_text("".join(lines))
    return path


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus.txt")


@pytest.fixture(scope="session")
def corpus_writer():
    """write_corpus(path) for fixtures wider than a test."""
    return write_corpus


@pytest.fixture
def tiny_flags(tmp_path, corpus) -> list[str]:
    return [*TINY_FLAGS, "--data", str(corpus), "--cache-dir", str(tmp_path / "cache")]


def make_tiny_config(root: Path, connection: str = "mhc", **overrides):
    """The tiny run's TrainConfig, its corpus and token cache under root."""
    from torch_mhc.lm.config import TrainConfig
    from torch_mhc.lm.model import ModelConfig

    corpus = root / "corpus.txt"
    if not corpus.exists():
        write_corpus(corpus)
    cfg = TrainConfig(
        model=ModelConfig(dim=32, n_layers=2, n_heads=2, max_seq_len=32, connection=connection),
        data=str(corpus), cache_dir=str(root / "cache"), val_fraction=0.1,
        batch_size=4, seq_len=32, steps=8, lr=3e-3, min_lr=3e-4, warmup=2,
        eval_every=0, eval_batches=2, gain_every=0, gain_batch_size=2, log_every=2,
        quiet=True, progress=False, tensorboard=False, dtype="fp32", device="cpu",
    )
    return cfg.updated(overrides)


@pytest.fixture
def tiny_config(tmp_path, corpus):
    def make(connection: str = "mhc", **overrides):
        return make_tiny_config(tmp_path, connection, **overrides)

    return make


@pytest.fixture(scope="session")
def tiny_config_under():
    """tiny_config_under(root, connection, **overrides), for fixtures wider than a test."""
    return make_tiny_config


@pytest.fixture
def run_python():
    def run(code: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, **kwargs)

    return run


# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
# Checkpoint folders


def file_sums(folder: Path) -> dict[str, list[int]]:
    """{name: [size, CRC-32]} of every file in a checkpoint folder but meta.json."""
    import zlib

    return {p.name: [p.stat().st_size, zlib.crc32(p.read_bytes())]
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != "meta.json"}


@pytest.fixture
def reseal():
    """reseal(folder): rewrite meta.json's sums to match the files as they are now, as an
    attacker (or a careless edit) could: what is then refused is refused by content."""
    import json

    def run(folder: Path) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        meta["files"] = file_sums(folder)
        (folder / "meta.json").write_text(json.dumps(meta))

    return run
