"""The GPU check's report: JSON and markdown, each written to a temporary file and renamed."""

from __future__ import annotations

import json
import os
from collections import defaultdict

from torch_mhc.runtime.files import atomic_write
from torch_mhc.tools.bench import decode_call
from torch_mhc.tools.bench.gpu_check.config import SECTIONS

CHECK_COLS = ["case", "op", "dtype", "params", "n", "shape", "max_rel_err", "worst",
              "worst_over_tol", "deterministic", "pass", "note"]
COLS = {
    "correctness": CHECK_COLS,
    "correctness_rest": CHECK_COLS,
    "large": ["case", "op", "dtype", "n", "shape", "tokens", "past_2_31", "max_rel_err", "worst",
              "worst_over_tol", "finite_everywhere", "pass", "note"],
    "nan_fill": CHECK_COLS,
    "params": CHECK_COLS,
    "compile": ["case", "backend", "dtype", "n", "shape", "max_rel_err", "worst",
                "worst_over_tol", "bitwise_equal", "pass", "note"],
    "contexts": CHECK_COLS,
    "eps": CHECK_COLS,
    "far_logits": ["case", "dtype", "n", "shape", "alpha_res", "log_domain_fraction",
                   "max_rel_err", "worst", "worst_over_tol", "deterministic", "pass", "note"],
    "inductor": CHECK_COLS,
    "kernels": ["op", "kernel", "tokens", "channels", "method", "ms", "ms_l2_warm", "bytes",
                "gb_per_s", "copy_ms", "fraction_of_copy", "error"],
    "sinkhorn": ["impl", "n", "tokens", "method", "fwd_ms", "bwd_ms", "bwd_over_fwd", "error"],
}
METHODS = {
    "kernels": "ms: L2 flushed before each launch (a write of {flush_bytes} bytes), amortised "
               "over {launches_per_figure} launches; ms_l2_warm: launches back to back; method "
               "per row (cuda_graph: graph replays with the flush-only graph subtracted; events: "
               "one event pair per sequence; wall: host clock per launch, CPU).",
    "sinkhorn": "ms per call, several calls between one event pair (L2 warm).",
}


def write_report(report: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    atomic_write(os.path.join(out_dir, "gpu_check.json"),
                 (json.dumps(report, indent=1) + "\n").encode())
    atomic_write(os.path.join(out_dir, "gpu_check.md"), markdown(report).encode())


def _fmt(v, spec=".3g"):
    return "" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def _note(row: dict) -> str | None:
    """What the row's last column says: why it was skipped, its error."""
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    return row.get("error")


def _table(rows: list[dict], cols: list[str]) -> list[str]:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        r = {**r, "note": _note(r)}
        lines.append("| " + " | ".join(_fmt(r.get(c)).replace("|", "/") for c in cols) + " |")
    return lines


def _section_lines(name: str, res: dict) -> list[str]:
    lines = []
    if name in METHODS:
        lines.append(METHODS[name].format_map(defaultdict(lambda: "?", res)))
    if name in COLS:
        if "all_pass" in res:
            skipped = sum("skipped" in r for r in res["rows"])
            lines.append(f"all_pass: {res['all_pass']} ({len(res['rows'])} rows, {skipped} "
                         "skipped)")
        lines += _table(res["rows"], COLS[name])
    elif name == "step":
        rows = [{"variant": k, **v} for k, v in res["entries"].items()]
        lines.append(f"method: {res.get('method')}")
        lines += _table(rows, ["variant", "median_ms", "ratio", "peak_memory_gib", "error"])
    elif name == "decode":
        rows = [{"batch": r["batch"], "variant": k, **v} for r in res["results"]
                for k, v in r["entries"].items()]
        lines.append(f"method: {res.get('method')}")
        lines += _table(rows, ["batch", "variant", "tokens_per_s", "tokens_per_s_ratio",
                               "decode_tokens_per_s_ratio"])
        if "prepared_equal" in res:
            lines += ["", "The prepared decoding path against the ops' path (same bits "
                      "expected):"]
            lines += _table(res["prepared_equal"],
                            ["kind", "batch", "prepared", "equal", "max_abs_diff", "error"])
        if "call" in res:
            lines += ["", "One mHC connection's call on one token without autograd, per op "
                      "implementation (host time per call by op, device time by kernel):",
                      decode_call.markdown(res["call"])]
    return lines


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# gpu_check {meta['date']}", "", f"Device: {meta['device_name']}; torch "
             f"{meta['torch']}, triton {meta['triton']}; budget {meta['budget_s']} s; "
             f"{'dry run (tiny shapes)' if meta['dry_run'] else 'full run'}.", "",
             "Tolerances: |a - e| <= tol * max|e| per output and gradient, against "
             "functional.maps in fp32 from the same rounded inputs (tests/ops/test_triton.py); "
             "worst names the output nearest its tolerance.", ""]
    for name in SECTIONS:
        sec = report["sections"].get(name)
        lines.append(f"## {name}")
        if sec is None:
            lines += ["not run", ""]
            continue
        if "error" in sec or "skipped" in sec:
            lines += [f"{sec.get('skipped') or sec.get('error')}", ""]
            continue
        lines.append(f"({sec['seconds']:.1f} s)")
        lines += _section_lines(name, sec["result"])
        lines.append("")
    return "\n".join(lines)


__all__ = ["markdown", "write_report"]
