"""The tables `mhc cost` prints: a markdown rendering of a cost-model report."""

from __future__ import annotations

from torch_mhc.tools.cost.model import KINDS

__all__ = ["format_table"]


def _fmt_int(x) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _fmt_bytes(x) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size:
            return f"{x / size:,.2f} {unit}"
    return f"{_fmt_int(x)} B"


def _fmt_pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells):
        return "| " + " | ".join(str(v).rjust(w) for v, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


_NAMES = {"residual": "residual", "hc": "HC", "mhc": "mHC"}


def format_table(report: dict) -> str:
    """A markdown rendering of an estimate() report (works on a report loaded from JSON)."""
    cfg = report["config"]
    access, params, flops = report["memory_access"], report["params"], report["flops"]
    act, pipe, kv = report["activations"], report["pipeline"], report["kv_cache"]
    out = [
        f"# mHC cost model: {cfg['layers']} blocks ({cfg['connections']} connections), "
        f"C={cfg['hidden']}, n={cfg['streams']}, T={cfg['tokens']}, batch={cfg['batch']}, "
        f"{cfg['dtype']}, sinkhorn_iters={cfg['sinkhorn_iters']}",
        "",
        "## Memory access per token, one connection, forward (paper Table 2)",
        "",
        _table(
            ["connection", "read (elem)", "write (elem)", "total (bytes)", "x residual",
             "model bytes/token"],
            [[_NAMES[k], _fmt_int(access[k]["read"]), _fmt_int(access[k]["write"]),
              _fmt_int(access[k]["total_bytes"]), f"{access['ratio_to_residual'][k]:.2f}",
              _fmt_bytes(access["model_bytes_per_token"][k])] for k in KINDS],
        ),
        "",
        "## FLOPs per token (forward) and parameters",
        "",
        _table(
            ["connection", "FLOPs/conn", "model FLOPs", "overhead", "params/conn",
             "model params", "params vs blocks"],
            [[_NAMES[k], _fmt_int(flops["per_connection"][k]["total"]),
              _fmt_int(flops["model_forward"][k]), _fmt_pct(flops["overhead_forward"][k]),
              _fmt_int(params["per_connection"][k]["total"]), _fmt_int(params["model"][k]),
              _fmt_pct(params["relative_to_blocks"][k])] for k in KINDS],
        ),
        "",
        f"block forward FLOPs/token: {_fmt_int(flops['block']['total'])} "
        f"(attention projections {_fmt_int(flops['block']['breakdown']['attention_projections'])},"
        f" scores {_fmt_int(flops['block']['breakdown']['attention_scores'])}, "
        f"MLP {_fmt_int(flops['block']['breakdown']['mlp'])})",
        f"mHC training FLOP overhead with selective recomputation: "
        f"{_fmt_pct(flops['overhead_training_mhc_recompute'])}",
    ]
    if cfg["tensor_parallel"] > 1:
        out.append(
            f"mHC forward FLOP overhead per device, tensor_parallel={cfg['tensor_parallel']} "
            f"(connection replicated): {_fmt_pct(flops['overhead_forward_per_device']['mhc'])}"
        )
    stage_act = act["per_stage_bytes_per_token"]
    mb_act = act["per_stage_bytes_per_micro_batch"]
    out += [
        "",
        f"## Activations kept for backward, one pipeline stage ({act['stage_connections']} "
        f"connections)",
        "",
        _table(
            ["connection", "bytes/token", "per micro-batch"],
            [["residual, no recompute", _fmt_int(stage_act["residual"]),
              _fmt_bytes(mb_act["residual"])],
             ["mHC, no recompute", _fmt_int(stage_act["mhc"]), _fmt_bytes(mb_act["mhc"])],
             [f"mHC, recompute L_r={act['recompute_interval']}",
              _fmt_int(stage_act["mhc_recompute"]), _fmt_bytes(mb_act["mhc_recompute"])]],
        ),
        "",
        f"optimal L_r = {act['recompute_interval_optimal']}; recomputation saves "
        f"{100 * act['mhc_recompute_saving']:.1f}% of mHC's stored activations",
        "",
        "## Communication and KV cache",
        "",
        _pipeline_line(cfg, pipe),
        f"KV cache ({cfg['tokens']} tokens, batch {cfg['batch']}, kv width {cfg['kv_dim']}): "
        f"{_fmt_bytes(kv['bytes'])} (same for every connection kind)",
    ]
    return "\n".join(out)


def _pipeline_line(cfg: dict, pipe: dict) -> str:
    if pipe["boundaries"] == 0:
        return "pipeline: 1 stage, no stage boundaries, no pipeline traffic"
    return (
        f"pipeline: {cfg['pipeline_stages']} stages, {pipe['boundaries']} boundaries, "
        f"micro-batch of {pipe['micro_batch_size']} sequences: "
        f"{_fmt_bytes(pipe['forward_bytes_per_boundary_per_micro_batch'])} forward + "
        f"{_fmt_bytes(pipe['backward_bytes_per_boundary_per_micro_batch'])} backward per "
        f"boundary and micro-batch (residual "
        f"{_fmt_bytes(pipe['residual_forward_bytes_per_boundary_per_micro_batch'])} each way); "
        f"{_fmt_bytes(pipe['bytes_per_step'])} per step (residual "
        f"{_fmt_bytes(pipe['residual_bytes_per_step'])})"
    )
