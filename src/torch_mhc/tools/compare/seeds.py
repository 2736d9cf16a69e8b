"""The statistics and health parts of `mhc compare`'s report (torch_mhc.tools.compare.run).

Over seeds: per kind the mean +- sample standard deviation of the final validation loss
(nats) and bits per byte, and each kind's paired difference to the residual, seed by seed,
with a 95% t interval (torch_mhc.tools.compare.stats); a difference is significant when its interval
excludes 0. Health: the final measurement of the first seed, summarised by
diagnostics.flat_health.
"""

from __future__ import annotations

import math

from torch_mhc.runtime.diagnostics import flat_health
from torch_mhc.tools.compare.stats import mean_sd, paired_difference

__all__ = ["HEALTH_COLUMNS", "health_summary", "health_table", "seed_summary",
           "seeds_table", "significance_lines"]

METRICS = ("val_loss", "val_bpb")


def _finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def seed_summary(per_seed: dict[str, list[dict]]) -> dict[str, dict]:
    """per_seed[kind]: [{"seed", "val_loss", "val_bpb"}, ...], the same seeds in the same order
    for every kind. Returns {kind: {"seeds", "<metric>_per_seed", "<metric>_mean", "<metric>_sd",
    "vs_residual": {metric: paired_difference dict} or None}}; a kind with a non-finite value
    (a stopped run) gets None for its statistics."""
    base = per_seed.get("residual")
    out = {}
    for kind, runs in per_seed.items():
        entry: dict = {"seeds": [r["seed"] for r in runs], "vs_residual": None}
        for m in METRICS:
            values = [r[m] for r in runs]
            entry[f"{m}_per_seed"] = values
            ok = all(_finite(v) for v in values)
            mean, sd = mean_sd(values) if ok else (None, None)
            entry[f"{m}_mean"] = mean
            entry[f"{m}_sd"] = None if sd is None or math.isnan(sd) else sd
        if base is not None and kind != "residual":
            diffs = {}
            for m in METRICS:
                a, b = [r[m] for r in runs], [r[m] for r in base]
                ok = all(_finite(v) for v in a + b)
                diffs[m] = paired_difference(a, b) if ok else None
            entry["vs_residual"] = diffs
        out[kind] = entry
    return out


def _pm(mean, sd, spec: str = ".4f") -> str:
    if mean is None:
        return "n/a"
    return format(mean, spec) + ("" if sd is None else f" ± {sd:{spec}}")


def _signed(x: float) -> str:
    """+0.0123; a nonzero value that 4 decimals would show as 0 in scientific notation (an
    interval ending at +2.1e-05 must not read as ending at 0)."""
    return f"{x:+.4f}" if x == 0 or abs(x) >= 5e-5 else f"{x:+.1e}"


def _diff(d: dict | None) -> str:
    if d is None:
        return "n/a"
    if d["ci_low"] is None:
        return _signed(d["mean"])
    return f"{_signed(d['mean'])} [{_signed(d['ci_low'])}, {_signed(d['ci_high'])}]"


def _verdict(d: dict | None) -> str:
    if d is None:
        return "n/a"
    if d["significant"] is None:
        return "one seed: untested"
    return "yes" if d["significant"] else "no"


def seeds_table(variants: list[dict]) -> str:
    """Markdown: per kind the mean +- sd over seeds and the paired difference to residual."""
    rows = ["| variant | seeds | val loss (nats) | val bpb | Δ loss vs residual [95% CI] | "
            "Δ bpb vs residual [95% CI] | significant |", "|" + "---|" * 7]
    for v in variants:
        vs = v.get("vs_residual") or {}
        rows.append(
            f"| {v['kind']} | {len(v['seeds'])} | {_pm(v['val_loss_mean'], v['val_loss_sd'])} | "
            f"{_pm(v['val_bpb_mean'], v['val_bpb_sd'])} | "
            f"{_diff(vs.get('val_loss')) if v['kind'] != 'residual' else '(baseline)'} | "
            f"{_diff(vs.get('val_bpb')) if v['kind'] != 'residual' else '(baseline)'} | "
            f"{_verdict(vs.get('val_loss')) if v['kind'] != 'residual' else ''} |")
    return "\n".join(rows)


def significance_lines(variants: list[dict]) -> list[str]:
    """One sentence per kind on its difference in validation loss to the residual."""
    lines = []
    for v in variants:
        if v["kind"] == "residual":
            continue
        d = (v.get("vs_residual") or {}).get("val_loss")
        if d is None:
            lines.append(f"- {v['kind']}: no paired difference (no residual run, or a stopped "
                         "run without a finite validation loss).")
            continue
        word = "lower" if d["mean"] < 0 else "higher"
        if d["significant"] is None:
            lines.append(f"- {v['kind']}: {abs(d['mean']):.4f} nats {word} than the residual on "
                         "one seed; one seed gives no interval, so this cannot be told apart "
                         "from seed-to-seed noise (use --seeds 3 or more).")
        elif d["significant"]:
            lines.append(f"- {v['kind']}: {abs(d['mean']):.4f} nats {word} than the residual, "
                         f"significant at 95% over {d['n']} paired seeds (interval "
                         f"{_signed(d['ci_low'])} to {_signed(d['ci_high'])} excludes 0).")
        else:
            lines.append(f"- {v['kind']}: {abs(d['mean']):.4f} nats {word} than the residual, "
                         f"not significant over {d['n']} paired seeds (interval "
                         f"{_signed(d['ci_low'])} to {_signed(d['ci_high'])} includes 0).")
    return lines


HEALTH_COLUMNS = (
    ("min_composite_colsum", "min composite column sum", ".3f"),
    ("max_composite_colsum", "max composite column sum", ".3f"),
    ("max_abs_log_colsum", "max abs log column sum", ".3g"),
    ("composite_dist_identity", "composite dist. from I", ".3f"),
    ("composite_dist_uniform", "composite dist. from J/n", ".3f"),
    ("last_stream_cosine", "stream cosine (last layer)", ".3f"),
    ("max_logit_range", "max logit range", ".3g"),
    ("max_exp_underflow", "exp underflow share", ".2g"),
    ("mean_gate_pre", "mean H_pre", ".3f"),
    ("mean_gate_post", "mean H_post", ".3f"),
)


def health_summary(health: dict | None) -> dict | None:
    """The HEALTH_COLUMNS figures of one HealthReport dict (None: none measured)."""
    if not health or "composite_health" not in health:
        return None
    flat = flat_health(health)
    return {key: flat.get(key) for key, _, _ in HEALTH_COLUMNS}


def health_table(variants: list[dict]) -> str:
    """Markdown: the final connection health of each kind that has an H_res."""
    rows = ["| variant | " + " | ".join(title for _, title, _ in HEALTH_COLUMNS) + " |",
            "|" + "---|" * (len(HEALTH_COLUMNS) + 1)]
    for v in variants:
        h = v.get("health")
        if not h:
            continue
        cells = ["n/a" if h.get(k) is None else format(h[k], spec) for k, _, spec in HEALTH_COLUMNS]
        rows.append(f"| {v['kind']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
