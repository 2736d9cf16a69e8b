"""Fixtures of the trainer's checkpoint tests: one tiny finished run, trained once per module
and copied for each test that may damage it."""

from __future__ import annotations

import shutil

import pytest

from torch_mhc.lm.train import load_checkpoint, train


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


@pytest.fixture
def resumes_from_prev(trained, tiny_config, capsys):
    """resumes_from_prev(why, steps=6): resume the run in `trained`, whose ckpt a test has
    damaged, to `steps`; assert that it fell back to ckpt.prev saying `why` and finished, and
    return stderr."""
    def resume(why: str, steps: int = 6) -> str:
        r = train(tiny_config("mhc", out_dir=str(trained), steps=steps, checkpoint_every=2,
                              resume=True))
        err = capsys.readouterr().err
        assert why in err and "resuming from the previous checkpoint" in err, err
        assert r.steps == steps and load_checkpoint(trained)["step"] == steps
        return err

    return resume
