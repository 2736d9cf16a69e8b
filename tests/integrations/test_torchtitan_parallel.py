"""The mHC llama3 debug model under torchtitan's own parallelisms, on 2 gloo processes.

Each test launches tests/integrations/titan_worker.py with torchrun (about 30 s on 2 busy cores) and
compares its losses with the same 3 AdamW steps in one process (`titan_worker.run_single`).
Every parallel run also has torchtitan's selective activation checkpointing on, as its debug
configuration does.

Tolerance. FSDP2 and the pipeline compute the same sums in another order (gradients reduced
over ranks, the batch split into halves or micro-batches); measured on 2026-11-30: losses equal
to 6e-8 relative after 3 steps. rtol = 1e-5, as in tests/lm/test_parallel.py, leaves a
hundredfold margin while a real mistake (a stage missing a block, streams reduced twice, a
connection's gradient not reduced) moves the losses by 1e-3 or more. A resumed run repeats
the exact operations of the uninterrupted one: equal to the last bit.

TP2 with sequence parallelism sums partial products across ranks (row-parallel attention
output and feed-forward): measured 1.6e-6 relative after 3 steps, for the unconverted model
as for the converted one; rtol = 1e-5 holds it too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import launch as launch_helpers
from tests.helpers import titan_support as S

pytestmark = [
    pytest.mark.skipif(not S.AVAILABLE, reason=S.SKIP_REASON),
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                       reason="torch.distributed with the gloo backend is not available"),
    pytest.mark.distributed,
    pytest.mark.slow,
]

WORKER = Path(__file__).with_name("titan_worker.py")
RTOL = 1e-5  # see the module docstring


def launch(scenario: str, outdir: Path) -> list[dict]:
    cmd = launch_helpers.torchrun(str(WORKER), scenario, str(outdir))
    code, out = launch_helpers.run(cmd, 240, f"torchtitan scenario {scenario!r}")
    if code != 0:
        pytest.fail(f"torchtitan scenario {scenario!r} failed (exit {code}):\n{out[-6000:]}")
    return [torch.load(outdir / f"{scenario}_rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def single_losses() -> list[float]:
    from tests.integrations import titan_worker as W

    torch.manual_seed(0)
    losses = W.run_single()
    assert losses[-1] < losses[0] - 0.1  # the trajectory moves: a comparison means something
    return losses


def _close(got: list[float], ref: list[float], rtol: float = RTOL) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(ref, dtype=torch.float64), rtol=rtol, atol=0.0)


def test_fsdp2_trains_like_one_process_and_resumes_from_dcp(single_losses, tmp_path):
    """FSDP2 over 2 ranks (each on half of every batch) with torchtitan's per-block
    compile (fullgraph, aot_eager backend; connections converted with fp32=False, which that
    compile needs): the single process's losses; the DCP checkpoint saved after 1 step,
    loaded into a differently initialised sharded model (keys checked first), continues with
    the uninterrupted run's losses."""
    from tests.integrations import titan_worker as W

    r0, r1 = launch("fsdp", tmp_path)
    assert r0["losses"] == r1["losses"]
    _close(r0["losses"], single_losses)
    assert r0["resumed"] == r0["losses"][W.SAVE_AT:]
    assert r1["resumed"] == r1["losses"][W.SAVE_AT:]


def test_pipeline_of_two_stages_trains_like_one_process(single_losses, tmp_path):
    """torchtitan's pipeline_llm cuts the converted model into 2 stages, [B, T, n, C] streams
    travelling between them (expanded in layer 0, reduced in layer 5); 1F1B over 2
    micro-batches: the single process's losses."""
    r0, r1 = launch("pp", tmp_path)
    assert r0["losses"] == r1["losses"]
    _close(r0["losses"], single_losses)


def test_tensor_parallel_with_sequence_parallel_trains_like_one_process(single_losses,
                                                                          tmp_path):
    """TP2 + SP (each rank holds half the heads and half the sequence between blocks, the
    connections replicated): the single process's losses, and after 3 steps the same
    connection parameters on both ranks, moved away from their initial values."""
    from tests.integrations import titan_worker as W

    r0, r1 = launch("tp", tmp_path)
    assert r0["losses"] == r1["losses"]
    _close(r0["losses"], single_losses)
    init = W.build_initialised().state_dict()
    assert len(r0["connections"]) == 2 * 6 * 5
    for name, value in r0["connections"].items():
        assert torch.equal(value, r1["connections"][name]), name
        assert not torch.equal(value, init[name]), f"{name} did not train"


def test_connections_stay_float32_under_bf16_fsdp(tmp_path):
    """torchtitan's default FSDP casts parameters to bf16. The connections are FSDP units of
    their own in float32 (the converter's fp32=True), so the converted model's initial loss
    is the unconverted model's under the same bf16 layout (measured: equal to the last bit;
    bound 1e-6 relative). Left in their block's bf16 unit (fp32=False), the rounded biases
    move it by 4e-6 relative (measured), which this bound would catch. Built in torchtitan's
    order (meta device, parallelize, to_empty, init_states), the sharded connections get
    their documented initial values exactly (reset_parameters on DTensor shards)."""
    r0, r1 = launch("fsdp_bf16", tmp_path)
    assert r0 == r1
    assert r0["fp32_dtype"] == "torch.float32" and r0["bf16_dtype"] == "torch.bfloat16"
    assert abs(r0["fp32_mhc"] - r0["fp32_None"]) <= 1e-6 * r0["fp32_None"]
    assert abs(r0["bf16_mhc"] - r0["bf16_None"]) > 1e-6 * r0["bf16_None"]
    assert r0["meta_init_mismatch"] == []
