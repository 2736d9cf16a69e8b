"""What `mhc upcycle` writes: upcycle.json (rows per kind and seed, paired differences to the
residual continuation), report.md and loss_curves.png, each atomically, the figure first and
upcycle.json last (an upcycle.json on disk means the rest is there too).

The paired statistics are those of `mhc compare --seeds` (torch_mhc.tools.compare.seeds):
per seed the kind's final validation loss minus the residual continuation's, their mean and
a Student t 95% interval; `ci95` is its half-width (null with one seed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from torch_mhc.lm.config import TrainConfig
from torch_mhc.runtime.files import atomic_write
from torch_mhc.tools.compare import plots
from torch_mhc.tools.compare.seeds import seed_summary, significance_lines
from torch_mhc.tools.compare.stats import mean_sd

__all__ = ["ROW_KEYS", "dumps_json", "format_markdown", "json_safe", "paired", "write_outputs"]

# the keys of a row in upcycle.json (the histories stay in each run folder's result.json)
ROW_KEYS = ("kind", "seed", "streams", "start_val_loss", "val_loss", "val_bpb", "max_gain",
            "step_ms", "steps", "diverged")


def json_safe(x):
    """x with every non-finite float replaced by None (strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


def dumps_json(value) -> bytes:
    return (json.dumps(json_safe(value), indent=1, allow_nan=False) + "\n").encode()


def _by_kind(rows: list[dict]) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for row in rows:
        kinds.setdefault(row["kind"], []).append(row)
    return kinds


def paired(rows: list[dict]) -> tuple[list[dict], dict]:
    """The paired differences to the residual, one entry per other kind, and the summary of
    compare.seeds.seed_summary they come from."""
    summary = seed_summary({kind: [{"seed": r["seed"], "val_loss": _nan(r["val_loss"]),
                                    "val_bpb": _nan(r["val_bpb"])} for r in runs]
                            for kind, runs in _by_kind(rows).items()})
    entries = []
    for kind, entry in summary.items():
        if kind == "residual":
            continue
        d = (entry.get("vs_residual") or {}).get("val_loss")
        half = (d["ci_high"] - d["ci_low"]) / 2 if d and d["ci_low"] is not None else None
        entries.append({"kind": kind, "delta_mean": d["mean"] if d else None, "ci95": half,
                        "ci_low": d["ci_low"] if d else None,
                        "ci_high": d["ci_high"] if d else None,
                        "n": d["n"] if d else len(entry["seeds"]),
                        "significant": d["significant"] if d else None})
    return entries, summary


def _nan(x) -> float:
    return math.nan if x is None else x


def write_outputs(out: Path, src, base: TrainConfig, streams: int, rows: list[dict],
                  reference: float) -> dict:
    """loss_curves.png, report.md, upcycle.json; returns what upcycle.json holds."""
    pairs, summary = paired(rows)
    report = {
        "source": str(src.folder), "source_checkpoint": str(src.checkpoint),
        "source_steps": src.state["step"], "source_val_loss": src.val_loss,
        "residual_start_val_loss": reference, "streams": streams, "steps": base.steps,
        "seeds": sorted({r["seed"] for r in rows}),
        "schedule": {"kind": base.schedule, "lr": base.lr, "min_lr": base.min_lr,
                     "warmup": base.warmup, "steps": base.steps},
        "rows": [{k: r[k] for k in ROW_KEYS} for r in rows],
        "paired": pairs,
    }
    atomic_write(out / "loss_curves.png", plots.loss_curves_png(_curves(rows)))
    variants = [{"kind": k, "vs_residual": e.get("vs_residual")} for k, e in summary.items()]
    atomic_write(out / "report.md",
                 format_markdown(report, significance_lines(variants)).encode("utf-8"))
    atomic_write(out / "upcycle.json", dumps_json(report))
    return json_safe(report)


def _curves(rows: list[dict]) -> dict[str, dict]:
    """Per kind the histories for plots.loss_curves_png, the validation loss at the
    conversion (step 0) first; several seeds as "seed_runs" (mean and band)."""
    runs = {}
    for kind, kind_rows in _by_kind(rows).items():
        per_seed = [{"loss_history": r["loss_history"],
                     "val_history": [{"step": 0, "val_loss": r["start_val_loss"]},
                                     *r["val_history"]]} for r in kind_rows]
        runs[kind] = {**per_seed[0], "seed_runs": per_seed if len(per_seed) > 1 else None}
    return runs


def _fmt(x, spec: str = ".4f") -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    text = format(x, spec)
    # a tiny negative rounds to -0.0000: no sign of a difference that rounds away
    return text.replace("-", "+" if "+" in spec else "", 1) if float(text) == 0 else text


def _pm(values: list) -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "n/a"
    mean, sd = mean_sd(values)
    return f"{mean:.4f}" + ("" if math.isnan(sd) else f" ± {sd:.4f}")


def format_markdown(report: dict, sentences: list[str]) -> str:
    """The rows summarised per kind, the paired differences and one sentence per kind."""
    s = report["schedule"]
    warmup = f"{s['warmup']} warmup step" + ("" if s["warmup"] == 1 else "s")
    seeds = ("seeds " if len(report["seeds"]) > 1 else "seed ") + ", ".join(
        map(str, report["seeds"]))
    lines = [
        "# mhc upcycle", "",
        f"Source: `{report['source']}` (residual, {report['source_steps']} steps, final val "
        f"loss {_fmt(report['source_val_loss'])} nats; {_fmt(report['residual_start_val_loss'])}"
        " on the continuation's validation windows).",
        f"Continuation: {report['steps']} steps per run, {s['kind']} schedule at lr {s['lr']:g} "
        f"(min {s['min_lr']:g}) after {warmup}, fresh AdamW state; {report['streams']} "
        f"streams; {seeds}, the same "
        "batches for every kind of a seed.", "",
        "| kind | seeds | start val loss | final val loss (mean ± sd) | max composite gain | "
        "step (ms, median) |", "|---|---|---|---|---|---|"]
    for kind, rows in _by_kind(report["rows"]).items():
        gains = [r["max_gain"] for r in rows if r["max_gain"] is not None]
        times = sorted(r["step_ms"] for r in rows if r["step_ms"] is not None)
        lines.append(f"| {kind} | {len(rows)} | {_pm([r['start_val_loss'] for r in rows])} | "
                     f"{_pm([r['val_loss'] for r in rows])} | "
                     f"{_fmt(max(gains), '.3g') if gains else 'n/a'} | "
                     f"{_fmt(times[len(times) // 2], '.1f') if times else 'n/a'} |")
    lines += ["", "Final validation loss minus the residual continuation's, paired by seed "
              "(95% Student t interval):", "",
              "| kind | Δ val loss (nats) | ± 95% CI | interval | n |", "|---|---|---|---|---|"]
    for p in report["paired"]:
        interval = (f"[{p['ci_low']:+.4f}, {p['ci_high']:+.4f}]" if p["ci_low"] is not None
                    else "n/a")
        lines.append(f"| {p['kind']} | {_fmt(p['delta_mean'], '+.4f')} | {_fmt(p['ci95'])} | "
                     f"{interval} | {p['n']} |")
    lines += ["", *sentences, "",
              "Files: upcycle.json (these rows), loss_curves.png (losses after the conversion, "
              "mean over seeds with a band from the lowest to the highest seed), "
              "<kind>/seed<S>/ (each run: checkpoint, metrics.jsonl, start.json, result.json).",
              ""]
    return "\n".join(lines)
