"""Ahead-of-time compile check of the Triton kernels for sm_80, sm_86 and sm_90 (no GPU needed).

Each custom op builds its launches with a plan function (ops/triton/ops.py); the check
compiles exactly those launches (ops/triton/aot.py) with the ptxas shipped in the triton
wheel and asserts: every kernel compiles, spills nothing, uses at most 255 registers and no
more shared memory than the target gives a block, fits on an SM, and uses TF32 deliberately.

The full matrix (3 targets x streams fp32/bf16/fp16 x parameters same/fp32 x eps 0/0.01 x
n = 2 .. 16, mHC's successors' launches at every n they are defined at) runs with
`mhc bench --aot`; the test compiles a representative subset (SUBSET, 217 launches, 105 of
them the successors'): every launch on every target (sm_86 fp32 n = 16, sm_80 fp32 n = 8,
sm_90 bf16 n = 4, sm_86 bf16 n = 5), and the cases with the most shared memory on every
target: n = 16 (n = 12 pads to the same tiles) with fp32 phi beside bf16 streams (autocast)
and fp16 with eps > 0, plus fp16 streams with fp32 phi and eps > 0 at n = 12, and the cases
where the full matrix once found spills (bf16 streams with fp32 phi at n = 5 on sm_80, fp32
at n = 3 and, in KromHC's tiles, at n = 8 on sm_90).
Compiled results are cached in a temporary folder (TORCH_MHC_AOT_CACHE), so a rerun is
quick.
"""

import os
import shutil

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


# (cc, streams, parameters, eps, n); see the module docstring.
SUBSET = [
    (86, "fp32", "same", 0.0, 16), (80, "fp32", "same", 0.0, 8), (90, "bf16", "same", 0.0, 4),
    (86, "bf16", "same", 0.0, 5),
    *[(cc, "bf16", "fp32", 0.0, 16) for cc in (80, 86, 90)],
    *[(cc, "fp16", "same", 1e-2, 16) for cc in (80, 86, 90)],
    (80, "fp16", "fp32", 1e-2, 12),
    # where the full matrix found spills in the forward matmul (xphi) at 64 tokens: fp32 phi
    # beside bf16 streams at n = 5 on sm_80 (692 bytes; mHC-lite's tiles at 16 tokens too),
    # fp32 streams at n = 3 on sm_90, and KromHC's tiles with fp32 streams at n = 8 on sm_90
    (80, "bf16", "fp32", 0.0, 5), (90, "fp32", "same", 0.0, 3), (90, "fp32", "same", 0.0, 8),
]


@needs_compiler
@pytest.mark.slow
def test_every_launch_fits_sm80_sm86_and_sm90():
    """... and the streaming kernels wait at no block-wide barrier (bar.sync) per channel block:
    reducing tiles across warps inside its loop made the merge's backward run at 2.7% of a
    copy's bandwidth on an H200 (benchmarks/README.md, the GPU check of 2026-12-04)."""
    rows = triton_aot.run_matrix(work=SUBSET, jobs=2)
    print(triton_aot.markdown(rows))  # the table: with a failure's report, or under -s
    assert triton_aot.failures(rows) == []
    for cc in (80, 86, 90):  # every kernel on every target
        assert {r["kernel"] for r in rows if r["cc"] == cc} == set(_kernel_names()), cc
    for r in rows:
        assert r["error"] is None, r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert 0 < r["regs"] <= 255, r
        assert r["shared"] <= r["shared_limit"] == tri_ops().SMEM_PER_BLOCK[r["cc"]], r
        assert 0 < r["occupancy"] <= 1, r
        if r["dtype"] == "fp32":  # exact fp32 dots: no tensor-core TF32
            assert r["mma_tf32"] == 0, r
        elif r["kernel"] in ("mhc_maps_bwd_kernel", "variant_maps_bwd_kernel"):
            # dz rounded (cvt.rna) for the tf32 dots
            assert r["cvt_rna_tf32"] > 0, r
        elif r["kernel"] in ("mhc_xphi_kernel", "mhc_dx_kernel", "mhc_dphi_kernel"):
            assert r["mma_tf32"] > 0, r
        if r["kernel"] == "pre_fwd_kernel":  # a sum over streams in registers
            assert r["barriers"] == 0, r
        if r["kernel"] == "merge_dh_kernel":  # sums over channels reduced once, after its loop
            assert r["loop_barriers"] == 0, r
    # The plans were given each target's limit: fp32 phi beside bf16 streams at n = 16 needs
    # more than sm_86 gives at the tiles sm_90 takes.
    big = {(r["cc"], r["kernel"]): r for r in rows
           if r["params"] == "fp32" and r["n"] == 16 and ":" not in r["op"]}  # mHC's launches
    assert big[(90, "mhc_dx_kernel")]["shared"] > tri_ops().SMEM_PER_BLOCK[86]
    assert big[(86, "mhc_dx_kernel")]["constexprs"]["BLOCK_K"] < 32


def test_the_full_matrix_covers_every_target_dtype_parameter_eps_and_n():
    work = triton_aot.cases()
    assert {w[0] for w in work} == {80, 86, 90}
    assert {(w[1], w[2]) for w in work} == {("fp32", "same"), ("bf16", "same"), ("fp16", "same"),
                                            ("bf16", "fp32"), ("fp16", "fp32")}
    assert {w[3] for w in work} == {0.0, 1e-2} and {w[4] for w in work} == {2, 3, 4, 5, 8, 12, 16}
    assert len(work) == 3 * 5 * 2 * 7


def tri_ops():
    from torch_mhc.ops.triton import ops as tri

    return tri


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
                        for op, launch in triton_aot.op_launches(n, dtype, 64, 48, 3)
                        if ":" not in op)  # mHC's (the successors' are keyed op:kind)
        maps = launches["mhc_maps_fwd_kernel"]
        cfg = tri.kernel_config("maps_fwd", n, dtype)
        assert maps.num_warps == cfg["num_warps"]
        assert maps.constexprs["BLOCK_T"] == cfg["BLOCK_T"]
        assert maps.constexprs["PW"] == max(16, triton.next_power_of_2(2 * n))
        assert maps.grid == (triton.cdiv(64, cfg["BLOCK_T"]),)
        xphi = launches["mhc_xphi_kernel"]
        cfg = tri.kernel_config("xphi", n, dtype)
        block_t = tri.token_block(64, cfg["BLOCK_T"])
        assert xphi.num_warps == cfg["num_warps"] and xphi.constexprs["BLOCK_T"] == block_t
        splits, _ = tri.k_splits(n * 48, triton.cdiv(64, block_t), cfg["BLOCK_K"])
        assert xphi.grid == (triton.cdiv(64, block_t), splits)
        assert xphi.args[0].dtype == dtype and xphi.args[0].device.type == "meta"


def test_occupancy_from_registers_shared_memory_and_warps():
    # 255 registers: 8192 per warp, 8 warps fit in 64K, two 4-warp blocks: 8 of 64 warps.
    assert triton_aot.occupancy(255, 0, 4, 80) == 8 / 64
    # 64 registers: 32 warps by registers.
    assert triton_aot.occupancy(64, 0, 4, 90) == 32 / 64
    # 100 KiB of shared memory: one block on sm_80 (164 KiB), two on sm_90 (228 KiB).
    assert triton_aot.occupancy(32, 100 * 1024, 4, 80) == 4 / 64
    assert triton_aot.occupancy(32, 100 * 1024, 4, 90) == 8 / 64
    # sm_86: 100 KiB an SM, 48 warps.
    assert triton_aot.occupancy(32, 40 * 1024, 4, 86) == 8 / 48
    # No block fits: an error naming why, never an occupancy of 0.
    with pytest.raises(ValueError, match="no block of 8 warps fits on an SM of sm_86: 100 "
                                         "registers a thread, 169984 bytes"):
        triton_aot.occupancy(100, 169984, 8, 86)


def test_tile_sizes_follow_both_dtypes_and_the_shared_memory_of_the_target():
    """fp32 phi beside bf16 streams (autocast) at n = 16: the tiles that fit sm_90 overflow
    sm_80 and sm_86; the plan lowers BLOCK_K there, and its estimate stays under each limit."""
    import torch

    tri = tri_ops()
    bf16, f32 = torch.bfloat16, torch.float32
    for kernel in ("xphi", "dx", "dphi"):
        for cc, limit in tri.SMEM_PER_BLOCK.items():
            for pd in (bf16, f32):
                cfg = tri.kernel_config(kernel, 16, bf16, pd, limit)
                est = tri.maps_smem(kernel, 16, cfg["BLOCK_T"], cfg["BLOCK_K"],
                                    cfg["num_stages"], 2, pd.itemsize)
                assert est <= limit, (kernel, cc, pd, cfg, est)
    assert tri.kernel_config("dx", 16, bf16, bf16, tri.SMEM_PER_BLOCK[90])["BLOCK_K"] == 64
    assert tri.kernel_config("dx", 16, bf16, f32, tri.SMEM_PER_BLOCK[90])["BLOCK_K"] == 32
    assert tri.kernel_config("dx", 16, bf16, f32, tri.SMEM_PER_BLOCK[86])["BLOCK_K"] == 16
    assert tri.kernel_config("dx", 16, bf16, bf16, tri.SMEM_PER_BLOCK[86])["BLOCK_K"] == 32
    # The plans pass phi's dtype and the limit through.
    launches = dict((launch.name, launch) for _, launch in triton_aot.op_launches(
        16, bf16, 64, 48, 3, param_dtype=f32, smem=tri.SMEM_PER_BLOCK[86],
        ops=("mhc_maps_fwd", "mhc_maps_bwd")))
    assert launches["mhc_dx_kernel"].constexprs["BLOCK_K"] == 16
    assert launches["mhc_xphi_kernel"].args[1].dtype == f32


def test_failures_name_spills_registers_shared_memory_tf32_and_errors():
    base = dict(kernel="k", cc=80, dtype="fp32", params="same", eps=0.0, n=4, regs=100,
                spill_stores=0, spill_loads=0, shared=0, shared_limit=166912, num_warps=4,
                occupancy=0.5, mma_tf32=0, cvt_rna_tf32=0, error=None)
    rows = [base, {**base, "spill_stores": 8}, {**base, "regs": 256},
            {**base, "error": "PTXASError: boom"}, {**base, "shared": 169984},
            {**base, "occupancy": None, "occupancy_error": "no block fits"},
            {**base, "mma_tf32": 4},
            {**base, "dtype": "bf16", "kernel": "mhc_maps_bwd_kernel", "mma_tf32": 4},
            {**base, "dtype": "bf16", "kernel": "mhc_maps_bwd_kernel", "mma_tf32": 4,
             "cvt_rna_tf32": 2}]
    bad = triton_aot.failures(rows)
    assert len(bad) == 7
    assert "spills 8" in bad[0] and "256 registers" in bad[1] and "boom" in bad[2]
    assert "169984 bytes of shared memory, over the 166912" in bad[3]
    assert "no block fits" in bad[4] and "tf32 mma in an fp32 launch" in bad[5]
    assert "unrounded" in bad[6]
    table = triton_aot.markdown(rows)
    assert table.count("\n") == len(rows) + 1
    assert "| k | sm_80 | fp32 | same | 0 | 4 | 100 | 0 |" in table


def test_loop_barriers_counts_bar_sync_between_a_label_and_its_backward_branch():
    ptx = "\n".join([
        "bar.sync 0;",            # before any loop
        "$L__BB0_2:",             # loop header
        "  ld.global.b32 %r1, [%rd1];",
        "  bar.sync 0;",
        "  bar.sync 0;",
        "  @%p1 bra $L__BB0_2;",  # backwards: closes the loop
        "bar.sync 0;",
        "  @%p2 bra $L__BB0_5;",  # forwards: no loop
        "$L__BB0_5:",
        "bar.sync 0;",
    ])
    assert triton_aot.loop_barriers(ptx) == 2
    assert triton_aot.loop_barriers(ptx.replace("bra $L__BB0_2", "bra $L__BB0_5")) == 0


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_grids_stay_within_cudas_limits_for_millions_of_tokens(n):
    """A grid's first axis takes up to 2^31 - 1 blocks, the others 65535: tokens belong on
    the first (the merge's backward once put its token blocks on the second, and failed to
    launch past 65535 tokens at n = 8 on an H200)."""
    import torch

    for op, launch in triton_aot.op_launches(n, torch.bfloat16, tokens=2**21, channels=256):
        assert launch.grid[0] < 2**31, (op, launch.name, launch.grid)
        assert all(g <= 65535 for g in launch.grid[1:]), (op, launch.name, launch.grid)
