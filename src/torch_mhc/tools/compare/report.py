"""What `mhc compare` writes: report.json, report.md (format_markdown, with the variants'
summary_table that `mhc compare` also prints) and the figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

from torch_mhc.lm.train import TrainResult
from torch_mhc.runtime.files import atomic_write
from torch_mhc.tools.compare import plots
from torch_mhc.tools.compare import seeds as compare_stats

__all__ = ["format_markdown", "summary_table", "write_report"]


def write_report(out: Path, report: dict, results: dict[str, list[TrainResult]]) -> list[str]:
    """report.json, report.md and the figures, each written atomically (gains and health:
    the first seed's runs); returns the names of the figures written."""
    out.mkdir(parents=True, exist_ok=True)
    # Plots first, the report last: a report.json on disk means its figures are there too.
    runs = {v["kind"]: v for v in report["variants"]}
    figures = {"loss_curves.png": plots.loss_curves_png(runs),
               "grad_norm.png": plots.grad_norm_png(runs)}
    first = {k: rs[0] for k, rs in results.items()}
    gains = {k: r.final_gains for k, r in first.items() if r.final_gains}
    if gains:
        figures["composite_gain.png"] = plots.composite_gain_png(gains)
        figures["gain_over_training.png"] = plots.gain_over_training_png(
            {k: r.gain_history for k, r in first.items() if r.gain_history})
        healths = {k: g for k, g in gains.items() if "composite_health" in g}
        if healths:
            figures["health.png"] = plots.health_png(healths)
    for name, png in figures.items():
        atomic_write(out / name, png)
    atomic_write(out / "report.md", format_markdown(report).encode("utf-8"))
    # NaN/Inf (a stopped run's losses) as null: strict JSON, which every reader can parse
    atomic_write(out / "report.json",
                 (json.dumps(_json_safe(report), indent=1, allow_nan=False) + "\n").encode())
    return list(figures)


def _json_safe(x):
    """x with every non-finite float replaced by None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def _fmt(x, spec: str = ".4f", none: str = "n/a") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def _fmt_gain(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.2f}" if x < 1e3 else f"{x:.3g}"


def summary_table(report: dict) -> str:
    """The markdown table of the variants (also printed by `mhc compare`)."""
    head = ("| variant | streams | params | connection params | val loss (nats) | val bpb | "
            "train loss | tokens/s | tokens/s (median step) | step time (ms) | vs residual | "
            "peak mem (MiB) | max composite gain fwd | bwd |")
    rows = [head, "|" + "---|" * 14]
    for v in report["variants"]:
        name = v["kind"] + (" (stopped)" if v["diverged"] else "")
        ratio = _fmt(v["step_time_ratio"], ".2f")  # n/a without a residual run
        ratio += "x" if ratio != "n/a" else ""
        rows.append(
            f"| {name} | {v['streams']} | {v['params']:,} | {v['connection_params']:,} | "
            f"{_fmt(v['val_loss'])} | {_fmt(v['val_bpb'])} | {_fmt(v['final_train_loss'])} | "
            f"{_fmt(v['tokens_per_s'], ',.0f')} | {_fmt(v['tokens_per_s_median_step'], ',.0f')} | "
            f"{_fmt(v['step_time_median_s'] * 1e3, '.1f')} | "
            f"{ratio} | {v['peak_mem_bytes'] / 2**20:.1f} | "
            f"{_fmt_gain(v['max_composite_gain_fwd'])} | {_fmt_gain(v['max_composite_gain_bwd'])} |"
        )
    return "\n".join(rows)


def format_markdown(report: dict) -> str:
    """report.md: the table, what each column measures, the budgets and the configuration."""
    cfg = report["config"]
    variants = report["variants"]
    lines = [
        f"# mhc compare: {' vs '.join(v['kind'] for v in variants)} (preset {report['preset']}"
        + (f", {report['seeds']} seeds)" if report.get("seeds", 1) > 1 else ")"),
        "",
        summary_table(report),
        "",
        f"Wall time of the whole comparison: {report['wall_time_s']:.1f} s. "
        f"Corpus: {report['corpus']} ({report['train_bytes']:,} training bytes, "
        f"{report['val_bytes']:,} validation bytes).",
        "",
        "Columns: validation loss is the mean cross-entropy over the same fixed validation "
        "windows for every variant, in nats and in bits per byte (one token is one byte); "
        "train loss is the mean over the last 20 steps. Tokens/s, its value at the median "
        "step time, and the step time count training steps only (no evaluation, gain "
        "measurement or checkpoint); on a machine shared with other work the median is the "
        "steadier figure, and 'vs residual' is the ratio of medians. Peak memory: "
        f"{variants[0]['peak_mem_kind']}. The composite gain is the Amax gain magnitude of "
        "H_res_l ... H_res_1 (forward: largest absolute row sum; backward: largest absolute "
        "column sum), worst token, deepest product, worst measurement during training, "
        f"measured every {cfg['gain_every']} steps on a fixed validation batch; the plain "
        "residual has no H_res (n/a)."
        + (f" With {report['seeds']} seeds the validation and train losses are means over "
           "seeds and everything else is the first seed's run." if report.get("seeds", 1) > 1
           else ""),
        "",
        *_seeds_and_health_md(report),
        "## Parameter budgets",
        "",
    ]
    ref = next((v for v in variants if v["kind"] == "residual"), None)
    for v in variants:
        extra = ""
        if ref is not None and v is not ref:
            extra = (f": {v['extra_params_vs_residual']:+,} parameters vs the residual model "
                     f"({100 * v['extra_params_vs_residual'] / ref['params']:+.2f}%)")
        lines.append(f"- {v['kind']}: {v['params']:,} parameters, of which "
                     f"{v['connection_params']:,} in the connections{extra}.")
    lines += [
        "",
        "All variants share the blocks (embedding, attention, MLP, norms) at the same width "
        "and depth and start from the same block weights; HC and mHC add only their "
        "connection parameters, so the budgets are not equalised.",
        "",
    ]
    stopped = [v for v in variants if v["diverged"]]
    if stopped:
        lines += ["## Stopped runs", ""]
        lines += [f"- {v['kind']}: {v['diverged']}" for v in stopped]
        lines.append("")
    lines += ["## Configuration", "", "| key | value |", "|---|---|"]
    for key, value in cfg["model"].items():
        lines.append(f"| model.{key} | {value} |")
    for key, value in cfg.items():
        if key != "model":
            lines.append(f"| {key} | {value} |")
    m = report["machine"]
    lines += [
        "",
        f"Machine: {m['platform']}, {m['cpu_count']} CPUs, torch {m['torch']} with "
        f"{m['torch_threads']} threads, Python {m['python']}; device {variants[0]['device']}, "
        f"{variants[0]['amp_dtype']}.",
        "",
        "## Figures",
        "",
        "![loss](loss_curves.png)",
        "",
        "![gradient norm](grad_norm.png)",
        "",
    ]
    if any(v["final_gains"] for v in variants):
        lines += ["![composite gain versus depth](composite_gain.png)", "",
                  "![composite gain during training](gain_over_training.png)", ""]
    if any(v.get("health") for v in variants):
        lines += ["![connection health versus depth](health.png)", ""]
    return "\n".join(lines)


def _seeds_and_health_md(report: dict) -> list[str]:
    """The seed statistics (with the verdicts in words) and the connection-health table."""
    variants, seeds = report["variants"], report.get("seeds", 1)
    if seeds > 1:
        method = (f"Mean ± sample standard deviation over {seeds} seeds; Δ is each kind's "
                  "validation figure minus the residual's on the same seed (same initial "
                  "blocks, same batches), averaged over seeds, with a 95% confidence interval "
                  f"from Student's t with {seeds - 1} degree{'s' if seeds > 2 else ''} of "
                  "freedom; significant when the interval excludes 0.")
    else:
        method = ("One seed: Δ is each kind's validation figure minus the residual's (same "
                  "initial blocks, same batches), with no spread and no confidence interval.")
    lines = ["## Seeds and significance", "",
             compare_stats.seeds_table(variants), "", method,
             "", *compare_stats.significance_lines(variants), ""]
    if any(v.get("health") for v in variants):
        lines += ["## Connection health (final measurement, first seed)", "",
                  compare_stats.health_table(variants), "",
                  "Composite: the product H_res_L ... H_res_1 over all sublayers. Column sums "
                  "(rows are exact for every kind with a doubly stochastic H_res; a column sum "
                  "far from 1 starves or floods a stream's gradient), the Frobenius distance "
                  "of the composite from the identity and from the uniform matrix J/n (0: "
                  "every stream the mean of all, the streams' collapse), the mean pairwise "
                  "cosine of the streams entering the last sublayer (1: copies), the largest "
                  "range (max - min per token) of the logits H_res exponentiates (mHC: "
                  "Sinkhorn's; mHC-lite: the permutation softmax's) and the share of them whose "
                  "exp underflows to 0 in float32, and the mean read and write weights "
                  "H_pre and H_post. Per-layer figures are in report.json and in every run's "
                  "metrics.jsonl.", ""]
    return lines
