"""Fixtures of the trainer's checkpoint tests: one tiny finished run, trained once per module
and copied for each test that may damage it."""

from __future__ import annotations

import shutil

import pytest

from torch_mhc.lm.train import train


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory, tiny_config_under):
    root = tmp_path_factory.mktemp("trained")
    train(tiny_config_under(root, "mhc", out_dir=str(root / "run"), steps=4,
                            checkpoint_every=2))
    return root / "run"


@pytest.fixture
def trained(tmp_path, trained_once, corpus):
    """A run folder with ckpt (step 4) and ckpt.prev (step 2) of tiny_config's run."""
    shutil.copytree(trained_once, tmp_path / "run")
    return tmp_path / "run"
