"""Ahead-of-time compile check of the Triton kernels for sm_80 and sm_90 (no GPU needed).

Each custom op builds its launches with a plan function (ops/triton/ops.py); the check
compiles exactly those launches (ops/triton/aot.py) with the ptxas shipped in the triton
wheel and asserts: every kernel compiles, spills nothing and uses at most 255 registers.
The CI matrix is fp32 and bf16 at n = 2, 4, 8 for both targets; `mhc bench --aot` (or
`mhc bench --aot`) runs the full one (fp16 too, n up to 16). Compiled
results are cached in a temporary folder (TORCH_MHC_AOT_CACHE), so a rerun is quick.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from torch_mhc.ops.triton import aot as triton_aot  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _ptxas() -> bool:
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return os.path.exists(bundled) or shutil.which("ptxas") is not None


def _version() -> tuple[int, ...]:
    return tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())


# ops/triton/aot.py drives triton's compiler internals (argument binder, ptxas log knob) as
# triton 3.9 has them.
needs_compiler = pytest.mark.skipif(
    INTERPRETED or not _ptxas() or _version() < (3, 9),
    reason="needs compiled (not interpreted) kernels, a ptxas and triton >= 3.9",
)


@needs_compiler
@pytest.mark.slow
def test_every_kernel_compiles_without_spills_for_sm80_and_sm90(tmp_path):
    out = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    cmd = [sys.executable, "-m", "torch_mhc", "bench", "--aot", "--cc", "80,90",
           "--dtypes", "fp32,bf16", "--n", "2,4,8", "--jobs", "2", "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout)  # the table (pytest -s shows it)
    rows = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Every kernel of ops/triton/kernels.py for every target, dtype and n.
    kernels = {r["kernel"] for r in rows}
    assert kernels == set(_kernel_names()), kernels
    assert len(rows) == len(kernels) * 2 * 2 * 3
    for r in rows:
        assert r["error"] is None, r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert 0 < r["regs"] <= 255, r
        assert 0 < r["occupancy"] <= 1, r


def _kernel_names() -> list[str]:
    from torch_mhc.ops.triton import kernels as k

    return [name for name in dir(k) if name.endswith("_kernel")]


def test_plans_cover_every_kernel():
    """The check compiles what the ops launch: every kernel appears in some op's plan."""
    import torch

    launched = {launch.name for _, launch in triton_aot.op_launches(4, torch.bfloat16, 64, 48, 3)}
    assert launched == set(_kernel_names())


def test_plans_follow_the_launch_configuration():
    """Launch parameters come from kernel_config: per n and dtype, as the ops pass them."""
    import torch

    from torch_mhc.ops.triton import ops as tri

    for n, dtype in ((2, torch.bfloat16), (8, torch.float32)):
        launches = dict((launch.name, launch)
                        for _, launch in triton_aot.op_launches(n, dtype, 64, 48, 3))
        maps = launches["mhc_maps_fwd_kernel"]
        cfg = tri.kernel_config("maps_fwd", n, dtype)
        assert maps.num_warps == cfg["num_warps"]
        assert maps.constexprs["BLOCK_T"] == cfg["BLOCK_T"]
        assert maps.constexprs["PW"] == max(16, triton.next_power_of_2(2 * n))
        assert maps.grid == (triton.cdiv(64, cfg["BLOCK_T"]),)
        assert maps.args[0].dtype == dtype and maps.args[0].device.type == "meta"


def test_occupancy_from_registers_shared_memory_and_warps():
    # 255 registers: 8192 per warp, 8 warps fit in 64K, two 4-warp blocks: 8 of 64 warps.
    assert triton_aot.occupancy(255, 0, 4, 80) == 8 / 64
    # 64 registers: 32 warps by registers.
    assert triton_aot.occupancy(64, 0, 4, 90) == 32 / 64
    # 100 KiB of shared memory: one block on sm_80 (164 KiB), two on sm_90 (228 KiB).
    assert triton_aot.occupancy(32, 100 * 1024, 4, 80) == 4 / 64
    assert triton_aot.occupancy(32, 100 * 1024, 4, 90) == 8 / 64


def test_failures_name_spills_registers_and_errors():
    base = dict(kernel="k", cc=80, dtype="fp32", n=4, regs=100, spill_stores=0, spill_loads=0,
                shared=0, num_warps=4, occupancy=0.5, error=None)
    rows = [base, {**base, "spill_stores": 8}, {**base, "regs": 256},
            {**base, "error": "PTXASError: boom"}]
    bad = triton_aot.failures(rows)
    assert len(bad) == 3
    assert "spills 8" in bad[0] and "256 registers" in bad[1] and "boom" in bad[2]
    table = triton_aot.markdown(rows)
    assert table.count("\n") == len(rows) + 1 and "| k | sm_80 | fp32 | 4 | 100 | 0 |" in table
