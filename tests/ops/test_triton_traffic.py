"""The bytes model of the Triton kernels (ops/triton/traffic.py): phi's re-reads counted, and
the table docs/performance.md states, computed from the plans (no GPU, no interpreter)."""

from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from torch_mhc.ops.triton import aot, traffic  # noqa: E402
from torch_mhc.ops.triton import ops as tri  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "performance.md"


def _launches(n, t, c, dtype=torch.bfloat16):
    return {launch.name: launch for _, launch in aot.op_launches(
        n, dtype, t, c, 20, smem=tri.SMEM_PER_BLOCK[90], ops=("mhc_maps_fwd", "mhc_maps_bwd"))}


def test_phi_is_counted_once_per_token_block():
    n, t, c = 4, 1000, 256
    launches = _launches(n, t, c)
    phi_bytes = n * c * (n * n + 2 * n) * 2  # bf16
    for name in ("mhc_xphi_kernel", "mhc_dx_kernel"):
        launch = launches[name]
        blocks = launch.grid[0]
        assert blocks == triton.cdiv(t, launch.constexprs["BLOCK_T"])
        assert dict(launch.reads)[1] == blocks
        once = sum(a.numel() * a.element_size() for i, a in enumerate(launch.args)
                   if isinstance(a, torch.Tensor) and i not in dict(launch.reads))
        reread = sum(launch.args[i].numel() * launch.args[i].element_size() * times
                     for i, times in launch.reads)
        assert traffic.launch_bytes(launch) == once + reread
        assert reread >= blocks * phi_bytes
    row = traffic.phi_traffic(n, c, t)
    assert row["fwd"]["phi_read_mb"] == pytest.approx(
        launches["mhc_xphi_kernel"].grid[0] * phi_bytes / 1e6)


def test_an_argument_passed_twice_counts_once():
    x = torch.empty(10, 4, device="meta")
    launch = tri.Launch(kernel=None, grid=(1,), args=(x, x, 3), constexprs={})
    assert traffic.launch_bytes(launch) == 160


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_decoding_splits_k_and_long_batches_take_large_token_blocks(n):
    """T <= 32: one token block (two of 16 in the forward at n = 16), K split over programs;
    T = 8192: token blocks of 64 or more (bf16; the forward's matmul at n = 16 keeps 16,
    what compiles without spills on sm_80)."""
    for t in (1, 8, 32):
        for name in ("mhc_xphi_kernel", "mhc_dx_kernel"):
            launch = _launches(n, t, 4096)[name]
            blocks = triton.cdiv(t, launch.constexprs["BLOCK_T"])
            assert launch.grid[0] == blocks <= 2 and launch.grid[1] > 1, (n, t, name)
    launches = _launches(n, 8192, 4096)
    assert launches["mhc_dx_kernel"].constexprs["BLOCK_T"] >= 64
    assert launches["mhc_xphi_kernel"].constexprs["BLOCK_T"] == (16 if n == 16 else 128)


def test_the_forward_sums_the_splits_it_was_given():
    launches = _launches(4, 8, 4096)
    splits = launches["mhc_xphi_kernel"].grid[1]
    fwd = launches["mhc_maps_fwd_kernel"]
    assert fwd.args[0].shape == (8, splits, 24) and fwd.args[13] == splits


def test_performance_doc_states_the_model_table():
    assert traffic.traffic_table() in DOC.read_text()
