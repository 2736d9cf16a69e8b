"""Where the Triton tests run (tests/ops/test_triton*.py): on a GPU in the test process;
without one, in Triton's interpreter in a fresh process with TRITON_INTERPRET=1 from the
start (it must precede triton's first import, which another module of a full run has
usually done already), started by run_in_fresh_interpreter.

Import after pytest.importorskip("triton").
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
INTERPRETER_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
RUN_HERE = ON_GPU or INTERPRETER_CHILD

if RUN_HERE:
    from torch_mhc.ops.triton import ops as tri

    assert tri.interpreted() == (not ON_GPU)
else:
    tri = None

kernel_test = pytest.mark.skipif(
    not RUN_HERE,
    reason="runs in a fresh TRITON_INTERPRET=1 process (see the module docstring)",
)

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# The kernels compute in fp32 and round once on store; compare with the reference run in
# fp32 (from the same rounded inputs) at the storage dtype's resolution.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def run_in_fresh_interpreter(test_file: str) -> None:
    """Run test_file's kernel tests in a child where TRITON_INTERPRET=1 precedes any triton
    import; fail with the child's output unless its tests passed (the test calling this
    skips itself there)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "skipped" in tail, tail


def assert_connection_matches_reference(conn_ref, conn_tri, x: torch.Tensor,
                                        upstream: torch.Tensor) -> None:
    """conn_tri (on DEVICE), and conn_tri under torch.compile(fullgraph=True), give
    conn_ref's output and gradients (of x and every parameter) for x on the CPU."""
    from tests.helpers.op_cases import assert_close

    compiled = torch.compile(conn_tri, fullgraph=True, backend="aot_eager")
    results = []
    for conn, dev in ((conn_ref, "cpu"), (conn_tri, DEVICE), (compiled, DEVICE)):
        xi = x.to(dev).requires_grad_()
        out = conn(xi)
        grads = torch.autograd.grad(out, [xi, *conn.parameters()], upstream.to(dev))
        results.append([out.cpu(), *[g.cpu() for g in grads]])
    for got in results[1:]:
        for a, e in zip(got, results[0], strict=True):
            assert_close(a, e, 2e-5)
