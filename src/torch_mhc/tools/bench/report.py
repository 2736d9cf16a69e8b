"""The markdown of a `mhc bench` report: one table per benchmark (works on a report loaded from
its JSON)."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

from torch_mhc.tools.errors import UsageError

__all__ = ["check_json_path", "load_average", "markdown", "run_meta", "script_report",
           "write_json_atomic"]


def load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def cpu_name() -> str | None:
    """The CPU's model name (Linux: /proc/cpuinfo), else what platform knows, else None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def run_meta() -> dict:
    """Where and when a measurement runs: date, versions, machine, cores, torch's threads and
    the load average at its start."""
    import torch

    from torch_mhc import __version__

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_mhc": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_average_start": load_average(),
    }


def check_json_path(path: str) -> None:
    """--json names a file that can be written, checked before minutes of benchmarks."""
    target = Path(os.path.abspath(os.path.expanduser(path)))
    if target.is_dir():
        raise UsageError(f"--json {path} is a folder, expected a file path")
    if not target.parent.is_dir():
        raise UsageError(f"--json {path}: its folder {target.parent} does not exist (or is "
                          "a file), expected an existing folder")
    if not os.access(target.parent, os.W_OK):
        raise UsageError(f"--json {path}: the folder {target.parent} is not writable")


def write_json_atomic(path: str, report: dict) -> None:
    """Write to a temporary file beside `path`, then rename over it (never half a file)."""
    from torch_mhc.runtime.files import atomic_write

    atomic_write(os.path.abspath(os.path.expanduser(path)),
                 (json.dumps(report, indent=2) + "\n").encode())


def script_report(config: dict, results: dict, json_path: str | None = None,
                  key: str = "results") -> str:
    """A benchmark script's JSON: its config with run_meta's date, versions, machine, CPU,
    cores and threads and the load average at the end added, and its results under `key`;
    written to json_path too (atomically) when given."""
    meta = run_meta()
    meta["load_average_end"] = meta.pop("load_average_start")  # called when the run is done
    report = {"config": {**config, **meta}, key: results}
    if json_path:
        write_json_atomic(json_path, report)
    return json.dumps(report, indent=2)


def _md_steps(result: dict, title: str) -> list[str]:
    cfg = result["config"]
    lines = [
        f"### {title}",
        "",
        f"{cfg['layers']} blocks, batch {cfg['batch']} x {cfg['seq']} tokens, {cfg['dtype']}, "
        f"n = {cfg['streams']}, ops `{cfg['impl']}`; timed: {cfg['timed']}; "
        f"{cfg['clock']} clock, median of the rounds, min-max as the spread. Paired: the "
        "median of the per-round ratios (each round times every variant once), with its "
        "distribution-free confidence interval and that interval's coverage.",
        "",
        "| d | variant | median ms | min-max ms | x residual | per-round ratio range | paired "
        "ratio (interval, coverage) | rounds |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for res in result["results"]:
        for v, e in res["entries"].items():
            paired = _paired(e.get("ratio_paired"), e.get("ratio_interval"), v == "residual")
            lines.append(
                f"| {res['dim']} | {v} | {e['median_ms']:.0f} | {e['min_ms']:.0f}-"
                f"{e['max_ms']:.0f} | {e['ratio']:.3f} | {e['ratio_min']:.3f}-"
                f"{e['ratio_max']:.3f} | {paired} | {res['repeats']} |"
            )
    return lines


def _paired(ratio: float | None, interval: list | None, baseline: bool) -> str:
    """The paired ratio as 1.089 (0.985-1.122, 96%): the interval and its coverage in
    brackets; the baseline's plain 1.000, and "-" in a report written before the paired
    figures."""
    if ratio is None:
        return "-"
    if interval is None or baseline:
        return f"{ratio:.3f}"
    low, high, coverage = interval
    return f"{ratio:.3f} ({low:.3f}-{high:.3f}, {coverage:.0%})"


def _md_saved(result: dict) -> list[str]:
    cfg = result["config"]
    lines = [
        "### saved: bytes saved for backward per token per connection",
        "",
        f"LM at d = {cfg['dim']}, {cfg['layers']} blocks ({cfg['connections']} connections), "
        f"n = {cfg['streams']}, {cfg['dtype']}, batch {cfg['batch']} x {cfg['reported_seq']} "
        f"tokens; recomputation interval L_r = {cfg['recompute_interval']} (optimal). "
        f"Per-token figures at T = {', '.join(map(str, cfg['seqs']))} differ by at most "
        f"{100 * result['per_token_relative_spread_across_seqs']:.2g}%. Counted: what is held "
        "from forward to backward; not counted: the replay of one recompute group in backward, "
        "which briefly holds up to L_r connections' intermediates (the optimal L_r balances "
        "the two).",
        "",
        "| variant | bytes / token / connection | x residual | extra over residual, in C "
        "elements |",
        "|---|---:|---:|---:|",
    ]
    for v, e in result["entries"].items():
        lines.append(f"| {v} | {e['bytes_per_token_per_connection']:.0f} | {e['ratio']:.3f} | "
                     f"{e['extra_over_residual_in_C']:.2f} |")
    lines += ["", "| mHC + recompute, L_r | bytes / token / connection | x residual |",
              "|---:|---:|---:|"]
    for k, e in result["mhc_recompute_by_interval"].items():
        star = " (optimal)" if int(k) == cfg["recompute_interval"] else ""
        lines.append(f"| {k}{star} | {e['bytes_per_token_per_connection']:.0f} | "
                     f"{e['ratio']:.3f} |")
    return lines


def _md_sinkhorn(result: dict) -> list[str]:
    cfg = result["config"]
    lines = [
        "### sinkhorn: forward + backward",
        "",
        f"{cfg['iters']} iterations, fp32, random upstream gradient; {cfg['clock']} clock, "
        f"median of {cfg['repeats']} rounds, min-max as the spread; saved = bytes saved for "
        "backward (the input logits included where a function saves them).",
        "",
        "| shape | implementation | median ms | min-max ms | x unrolled | saved bytes | "
        "saved x unrolled | max abs diff |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for res in result["results"]:
        shape = "x".join(map(str, res["shape"]))
        for name, e in res["entries"].items():
            lines.append(
                f"| {shape} | {name} | {e['median_ms']:.2f} | {e['min_ms']:.2f}-"
                f"{e['max_ms']:.2f} | {e['ratio']:.3f} | {e['saved_bytes']} | "
                f"{e['saved_ratio']:.3f} | {e['max_abs_diff']:.1e} |"
            )
    return lines


def _md_decode(result: dict) -> list[str]:
    cfg = result["config"]
    lines = [
        "### decode: KV-cached greedy generation",
        "",
        f"d = {cfg['dim']}, {cfg['layers']} blocks, n = {cfg['streams']}, {cfg['dtype']}, "
        f"ops `{cfg['impl']}`, {cfg['prompt']} prompt + {cfg['new_tokens']} new tokens; "
        f"{cfg['clock']} clock, median of {cfg['repeats']} rounds"
        + (f" on each of {cfg['builds']} builds of the models (rotated order, pooled)"
           if cfg.get("builds", 1) > 1 else "")
        + ". Decode step: the median of the one-token steps after the prefill, every model's "
        "steps interleaved one by one (decode tokens/s = batch / step); paired: the median "
        "of the step-by-step ratios, with its distribution-free confidence interval and that "
        "interval's coverage. The JSON also has the decode part of the whole call (generate - "
        "prefill).",
        "",
        "| batch | variant | generate ms | prefill ms | tokens/s | x residual | decode step ms "
        "| decode tokens/s | x residual | paired (interval, coverage) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    for res in result["results"]:
        for v, e in res["entries"].items():
            paired = _paired(e.get("step_tokens_per_s_ratio_paired"),
                             e.get("step_tokens_per_s_ratio_interval"), v == "residual")
            lines.append(
                f"| {res['batch']} | {v} | {e['median_ms']:.0f} | {e['prefill_median_ms']:.0f} "
                f"| {e['tokens_per_s']:.1f} | {e['tokens_per_s_ratio']:.3f} | "
                f"{e['step_median_ms']:.2f} | {e['step_tokens_per_s']:.1f} | "
                f"{e['step_tokens_per_s_ratio']:.3f} | {paired} |"
            )
    return lines


def markdown(report: dict) -> str:
    """One markdown table per benchmark in a bench_main report."""
    meta, b = report["meta"], report["benchmarks"]
    cpu = f"{meta['cpu']} ({meta.get('cpu_count')} cores), " if meta.get("cpu") else ""
    lines = [
        f"torch {meta['torch']}, {cpu}{meta['threads']} thread(s), {meta['clock']} clock, "
        f"{meta['date']}; load average {meta['load_average_start']} at the start, "
        f"{meta['load_average_end']} at the end.",
    ]
    if "step" in b:
        lines += ["", *_md_steps(b["step"], "step: training step, residual vs HC vs mHC")]
    if "hyper_connections" in b:
        hc = b["hyper_connections"]
        title = "hyper_connections: lucidrains' mHC around the same blocks"
        if "skipped" in hc:
            lines += ["", f"### {title}", "", f"Skipped: {hc['skipped']}"]
        else:
            lines += ["", *_md_steps(hc, f"{title} (hyper-connections "
                                         f"{hc['config']['hyper_connections_version']})")]
    if "saved" in b:
        lines += ["", *_md_saved(b["saved"])]
    if "sinkhorn" in b:
        lines += ["", *_md_sinkhorn(b["sinkhorn"])]
    if "decode" in b:
        lines += ["", *_md_decode(b["decode"])]
    return "\n".join(lines)
