"""Tests of the analytic cost model against figures computed here by hand."""

from __future__ import annotations

import json
import math

import pytest

from torch_mhc.tools.cost import model as cost
from torch_mhc.tools.cost.format import format_table
from torch_mhc.tools.cost.model import CostConfig


def cost_main(argv: list[str]) -> int:
    """`mhc cost ARGV`."""
    from torch_mhc.tools.cli import main

    return main(["cost", *argv])

GIB = 2**30
SIZES = [(n, c) for n in (1, 2, 4, 8) for c in (64, 2560)]


# ---------------------------------------------------------------- memory access (Table 2)


@pytest.mark.parametrize("n, c", SIZES)
def test_memory_access_matches_paper_table_2(n, c):
    coeffs = n * n + 2 * n
    residual = cost.memory_access("residual", n, c)
    assert (residual["read"], residual["write"]) == (2 * c, c)

    hc = cost.memory_access("hc", n, c)
    assert hc["read"] == (5 * n + 1) * c + coeffs
    assert hc["write"] == (3 * n + 1) * c + coeffs
    assert hc["total"] == (8 * n + 2) * c + 2 * coeffs

    mhc = cost.memory_access("mhc", n, c)
    assert mhc["read"] == (3 * n + 1) * c + coeffs
    assert mhc["write"] == (n + 1) * c + coeffs
    # The fused post-and-merge kernel: (n+1)C streams read, nC written, plus H_res and H_post.
    fused = mhc["kernels"]["post_res_merge"]
    assert fused["read"] - (n * n + n) == (n + 1) * c
    assert fused["write"] == n * c
    # The map kernel reads the streams once and writes the n^2 + 2n coefficients.
    assert mhc["kernels"]["maps"] == {"read": n * c, "write": coeffs}
    assert mhc["kernels"]["pre"] == {"read": n * c + n, "write": c}


@pytest.mark.parametrize("n, c", SIZES)
def test_estimate_bytes_follow_dtype(n, c):
    for dtype, width in (("fp32", 4), ("bf16", 2), ("fp8", 1), ("int4", 0.5)):
        report = cost.estimate(CostConfig(layers=3, hidden=c, streams=n, dtype=dtype))
        mhc = report["memory_access"]["mhc"]
        total = (3 * n + 1) * c + (n + 1) * c + 2 * (n * n + 2 * n)
        assert mhc["total_bytes"] == total * width
        assert report["memory_access"]["model_bytes_per_token"]["mhc"] == 6 * total * width
        assert report["memory_access"]["ratio_to_residual"]["mhc"] == total / (3 * c)


def test_paper_27b_traffic_ratio():
    out = cost.paper_27b_overhead()
    c, n = 2560, 4
    mhc_elems = 18 * c + 2 * (n * n + 2 * n)  # (3n+1)C + (n+1)C + 2(n^2 + 2n)
    assert out["memory_traffic_ratio_to_residual_connection"] == mhc_elems / (3 * c)
    assert out["memory_traffic_extra_bytes_per_token"] == 60 * (mhc_elems - 3 * c) * 2
    assert 0 < out["flop_overhead_forward"] < out["flop_overhead_training_recompute"] < 0.05
    assert out["paper_reported_training_time_overhead"] == 0.067


# ---------------------------------------------------------------- parameters and FLOPs


def test_params_per_connection():
    n, c = 4, 2560
    assert cost.connection_params("residual", n, c)["total"] == 0
    assert cost.connection_params("mhc", n, c)["breakdown"]["phi"] == 4 * 2560 * 24
    assert cost.connection_params("mhc", n, c)["total"] == 245_760 + 4 + 4 + 16 + 3
    assert cost.connection_params("hc", n, c)["total"] == 2560 * 6 + 4 + 4 + 16 + 2
    report = cost.estimate(CostConfig(**cost.PAPER_27B))
    assert report["params"]["model"]["mhc"] == 60 * 245_787


@pytest.mark.parametrize("n, c", SIZES)
def test_flops_per_connection(n, c):
    iters = 7
    m = n * n + 2 * n
    mhc = cost.connection_flops("mhc", n, c, sinkhorn_iters=iters)
    expected = (
        2 * n * c  # RMS over nC
        + 2 * n * c * m  # v @ phi
        + 3 * m  # / r, * alpha, + b
        + 7 * n  # sigmoid, 2 sigmoid
        + 3 * n * n + 4 * iters * n * n  # exp(H - max), then 2 normalisations per iteration
        + 2 * n * c  # pre-aggregation
        + 2 * n * n * c + 2 * n * c  # H_res x + H_post f
    )
    assert mhc["total"] == expected
    hc = cost.connection_flops("hc", n, c)
    assert hc["total"] == 3 * n * c + 2 * n * c * (n + 2) + 3 * n * (n + 2) + (
        2 * n * c + 2 * n * n * c + 2 * n * c
    )
    assert cost.connection_flops("residual", n, c)["total"] == c


def test_block_flops_hand_case_and_overhead():
    cfg = CostConfig(layers=2, hidden=64, streams=2, tokens=16, sinkhorn_iters=1)
    block = cost.block_flops(cfg)["breakdown"]
    assert block == {
        "attention_projections": 8 * 64 * 64,
        "attention_scores": 2 * 64 * 17,
        "mlp": 16 * 64 * 64,
        "norms": 8 * 64,
    }
    block_total = 32768 + 2176 + 65536 + 512
    mhc_conn = cost.connection_flops("mhc", 2, 64, 1)["total"]
    report = cost.estimate(cfg)
    assert report["flops"]["model_forward"]["residual"] == 2 * block_total + 4 * 64
    assert report["flops"]["overhead_forward"]["mhc"] == pytest.approx(
        (2 * block_total + 4 * mhc_conn) / (2 * block_total + 4 * 64) - 1
    )
    assert report["flops"]["overhead_training_mhc_recompute"] == pytest.approx(
        (6 * block_total + 16 * mhc_conn) / (6 * block_total + 12 * 64) - 1
    )


def test_gqa_attention_widths():
    cfg = CostConfig(layers=1, hidden=4096, heads=32, kv_heads=8)  # head_dim = 128
    assert (cfg.attention_dim, cfg.kv_dim) == (4096, 1024)
    assert cost.block_flops(cfg)["breakdown"]["attention_projections"] == (
        4 * 4096 * 4096 + 4 * 4096 * 1024
    )


# ---------------------------------------------------------------- KV cache


def test_kv_cache_known_figures():
    assert cost.kv_cache_bytes(32, 8192, 4096, "bf16") == 4 * GIB
    assert cost.kv_cache_bytes(32, 131072, 4096, "bf16") == 64 * GIB
    assert cost.kv_cache_bytes(32, 8192, 4096, "fp16") == 4 * GIB
    assert cost.kv_cache_bytes(32, 8192, 4096, "fp8") == 2 * GIB
    assert cost.kv_cache_bytes(32, 8192, 4096, "int4") == 1 * GIB
    assert cost.kv_cache_bytes(32, 8192, 4096, "bf16", batch=3) == 12 * GIB
    report = cost.estimate(CostConfig(layers=32, hidden=4096, tokens=131072))
    assert report["kv_cache"]["bytes"] == 64 * GIB
    gqa = CostConfig(layers=32, hidden=4096, tokens=8192, kv_heads=8, head_dim=128)
    assert cost.estimate(gqa)["kv_cache"]["bytes"] == 1 * GIB


# ---------------------------------------------------------------- recomputation


@pytest.mark.parametrize("n, layers", [(4, 60), (4, 30), (1, 3), (8, 100), (2, 1), (4, 15)])
def test_optimal_recompute_interval(n, layers):
    expected = max(1, math.floor(math.sqrt(n * layers / (n + 2)) + 0.5))
    assert cost.optimal_recompute_interval(n, layers) == expected


def test_optimal_recompute_interval_hand_values():
    assert cost.optimal_recompute_interval(4, 60) == 6  # sqrt(40) = 6.32
    assert cost.optimal_recompute_interval(4, 30) == 4  # sqrt(20) = 4.47
    assert cost.optimal_recompute_interval(8, 100) == 9  # sqrt(80) = 8.94
    assert cost.optimal_recompute_interval(1, 1) == 1  # sqrt(1/3) = 0.58


def test_optimal_recompute_interval_rounds_halves_up():
    # n = 6, L = 27: sqrt(162 / 8) = sqrt(20.25) = 4.5 exactly -> 5 (round() would say 4)
    assert cost.optimal_recompute_interval(6, 27) == 5
    # n = 2, L = 2: sqrt(1) = 1; n = 2, L = 25: sqrt(12.5) = 3.54 -> 4; n = 1, L = 15:
    # sqrt(5) = 2.24 -> 2; n = 4, L = 6: sqrt(4) = 2
    assert [cost.optimal_recompute_interval(n, L) for n, L in [(2, 2), (2, 25), (1, 15), (4, 6)]
            ] == [1, 4, 2, 2]
    # every half-way case n L / (n + 2) = (k + 1/2)^2 up to n = 30 rounds up: checked
    # against exact rationals (4 n L = (2k + 1)^2 (n + 2))
    halves = 0
    for n in range(1, 31):
        for L in range(1, 400):
            k = cost.optimal_recompute_interval(n, L)
            q4 = 4 * n * L  # 4 q (n + 2)
            assert (2 * k - 1) ** 2 * (n + 2) <= q4 or k == 1
            assert q4 < (2 * k + 1) ** 2 * (n + 2)
            halves += q4 == (2 * k - 1) ** 2 * (n + 2)
    assert halves > 0  # the loop met half-way cases


def test_recompute_activation_formula_and_report():
    # n C ceil(L / L_r) + (n + 2) C L_r with n = 4, C = 2560, L = 60, L_r = 6.
    assert cost.recompute_activation_elements(4, 2560, 60, 6) == 4 * 2560 * 10 + 6 * 2560 * 6
    assert cost.recompute_activation_elements(4, 2560, 60, 7) == 4 * 2560 * 9 + 6 * 2560 * 7
    cfg = CostConfig(layers=30, hidden=2560, streams=4, pipeline_stages=2, tokens=1024, batch=2)
    act = cost.estimate(cfg)["activations"]
    assert act["stage_connections"] == 30
    assert act["recompute_interval"] == 4
    per_token = (4 * 2560 * 8 + 6 * 2560 * 4) * 2  # ceil(30 / 4) = 8, bf16
    assert act["per_stage_bytes_per_token"]["mhc_recompute"] == per_token
    assert act["per_stage_bytes_per_micro_batch"]["mhc_recompute"] == per_token * 2 * 1024
    assert act["per_stage_bytes_per_token"]["mhc"] == 30 * (6 * 2560 + 24 + 1) * 2
    assert act["per_stage_bytes_per_token"]["residual"] == 30 * 2 * 2560 * 2
    fixed = cost.estimate(CostConfig(layers=30, hidden=2560, recompute_interval=10))
    assert fixed["activations"]["per_stage_bytes_per_token"]["mhc_recompute"] == (
        (4 * 2560 * 6 + 6 * 2560 * 10) * 2
    )


# ---------------------------------------------------------------- pipeline


def test_pipeline_bytes_hand_case():
    cfg = CostConfig(
        layers=4, hidden=1024, streams=4, tokens=2048, batch=8, micro_batches=4,
        pipeline_stages=4,
    )
    pipe = cost.estimate(cfg)["pipeline"]
    one = 2 * 2048 * 4 * 1024 * 2  # micro-batch 2 x T x n x C x 2 bytes = 32 MiB
    assert one == 32 * 2**20
    assert pipe["boundaries"] == 3
    assert pipe["micro_batch_size"] == 2
    assert pipe["forward_bytes_per_boundary_per_micro_batch"] == one
    assert pipe["backward_bytes_per_boundary_per_micro_batch"] == one
    assert pipe["bytes_per_step"] == 2 * 3 * 4 * one  # both ways, 3 boundaries, 4 micro-batches
    assert pipe["residual_forward_bytes_per_boundary_per_micro_batch"] == one // 4
    single = cost.estimate(CostConfig(layers=4, hidden=1024))["pipeline"]
    assert single["boundaries"] == 0 and single["bytes_per_step"] == 0


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"layers": 0, "hidden": 64}, "layers must be >= 1, got 0"),
        ({"layers": 2, "hidden": 64, "streams": 0}, "streams must be >= 1, got 0"),
        ({"layers": 2.5, "hidden": 64}, "layers must be an integer"),
        ({"layers": 2, "hidden": 64, "dtype": "bf17"}, "unknown dtype 'bf17'; expected one of"),
        ({"layers": 2, "hidden": 64, "batch": 3, "micro_batches": 2},
         "batch must be divisible by micro_batches, got batch=3, micro_batches=2"),
        ({"layers": 2, "hidden": 64, "pipeline_stages": 3},
         r"pipeline_stages must divide .* 2\*layers=4, got pipeline_stages=3"),
        ({"layers": 2, "hidden": 64, "recompute_interval": 5},
         r"recompute_interval must be <= .* \(4\), got 5"),
        ({"layers": 2, "hidden": 64, "heads": 5}, "heads must divide hidden"),
        ({"layers": 2, "hidden": 64, "kv_heads": 2}, "kv_heads needs heads or head_dim"),
        ({"layers": 2, "hidden": 64, "heads": 8, "kv_heads": 3}, "kv_heads must divide"),
        ({"layers": 2, "hidden": 64, "ffn_mult": 0}, "ffn_mult must be a positive number"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CostConfig(**kwargs)


def test_function_errors():
    with pytest.raises(ValueError, match="unknown connection kind 'dense'"):
        cost.memory_access("dense", 4, 64)
    with pytest.raises(ValueError, match="layers must be >= 1, got 0"):
        cost.optimal_recompute_interval(4, 0)
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        cost.kv_cache_bytes(1, 1, 1, "int8")


# ---------------------------------------------------------------- command line


def test_cli_json(capsys):
    rc = cost_main(["--layers", "32", "--hidden", "4096", "--tokens", "8192", "--json"])
    captured = capsys.readouterr()
    assert rc == 0 and captured.err == ""
    report = json.loads(captured.out)
    assert report["kv_cache"]["bytes"] == 4 * GIB
    assert report["config"]["streams"] == 4 and report["config"]["connections"] == 64
    assert report["memory_access"]["mhc"]["read"] == 13 * 4096 + 24
    assert report["activations"]["recompute_interval"] == 7  # sqrt(4 * 64 / 6) = 6.53
    assert report == json.loads(json.dumps(cost.estimate(CostConfig(32, 4096, tokens=8192))))


def test_cli_table_and_preset(capsys):
    assert cost_main(["--preset", "paper-27b", "--pipeline-stages", "4"]) == 0
    out = capsys.readouterr().out
    assert "30 blocks (60 connections), C=2560, n=4" in out
    assert "|        mHC |      33,304 |       12,824 |" in out
    assert "4 stages, 3 boundaries" in out
    assert out == format_table(cost.estimate(CostConfig(**cost.PAPER_27B,
                                                        pipeline_stages=4))) + "\n"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--layers", "0", "--hidden", "8"], "layers must be >= 1, got 0"),
        (["--layers", "2", "--hidden", "x"], "--hidden: invalid int value: 'x'"),
        (["--hidden", "8"], "--layers required"),
        (["--layers", "2", "--hidden", "8", "--dtype", "bf17"], "invalid choice: 'bf17'"),
        (["--layers", "2", "--hidden", "8", "--batch", "3", "--micro-batches", "2"],
         "divisible by micro_batches"),
    ],
)
def test_cli_bad_input(capsys, argv, match):
    assert cost_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mhc cost: error: ")
    assert match in lines[0]
