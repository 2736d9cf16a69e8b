"""Running a (torchrun) command from a test: a clean environment and a timeout that kills the
launcher and all its workers, so a hang fails the test instead of blocking the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest


def clean_env() -> dict:
    """This process's environment without torchrun's variables, one thread per process."""
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)  # the test may itself run under a launcher
    env["OMP_NUM_THREADS"] = "1"
    return env


def torchrun(*args: str, nproc: int = 2) -> list[str]:
    """The command running args (a script and its arguments) on nproc local processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *args]


def run(cmd: list[str], timeout_s: float, what: str) -> tuple[int, str]:
    """(exit code, combined output) of cmd; pytest.fail after timeout_s."""
    # A new session, so a timeout can kill torchrun and its workers together.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=clean_env(), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what} did not finish in {timeout_s} s:\n{out[-4000:]}")
    return proc.returncode, out
