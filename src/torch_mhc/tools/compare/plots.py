"""Figures of a comparison (`mhc compare`): PNG bytes from matplotlib's Agg renderer.

Each function takes the per-variant results (TrainResult.to_dict() or the report entries that
carry the same histories) and returns the PNG as bytes; the caller writes the file
atomically. Figures are built with matplotlib.figure.Figure directly, never pyplot, so no
global state and no interactive backend is touched (safe in tests and on headless machines).
"""

from __future__ import annotations

import io
import math

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter, MaxNLocator

__all__ = ["COLORS", "composite_gain_png", "figure_png", "gain_over_training_png",
           "grad_norm_png", "health_png", "loss_curves_png", "loss_lines", "plain_log_labels",
           "zoom_to_second_half"]

COLORS = {"residual": "#4d4d4d", "hc": "#d62728", "mhc": "#1f77b4", "mhc-lite": "#2ca02c",
          "kromhc": "#9467bd", "mhc-static-res": "#ff7f0e"}
LABELS = {"residual": "residual", "hc": "HC", "mhc": "mHC", "mhc-lite": "mHC-lite",
          "kromhc": "KromHC", "mhc-static-res": "mHC static H_res"}


def figure_png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)  # render with Agg whatever pyplot's backend is
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def _tick_text(x: float) -> str:
    """0.6, 2, 1000 as they are; outside 0.001 .. 9999 a power of ten in mathtext (10^-7,
    3 x 10^6), where %g's 1e-07 would stand beside 100000 on an axis spanning many decades."""
    if x == 0 or 1e-3 <= abs(x) < 1e4:
        return f"{x:g}"
    k = math.floor(math.log10(abs(x)) + 1e-9)
    m = float(f"{x / 10 ** k:.3g}")
    if abs(m) >= 10:  # 9.9996 rounded up
        m, k = m / 10, k + 1
    return f"$10^{{{k}}}$" if m == 1 else f"${m:g}\\times10^{{{k}}}$"


class _PlainLogFormatter(LogFormatter):
    """LogFormatter's choice of which ticks to label, each written as _tick_text says: its
    own numbers read 6e-01 below one."""

    def __call__(self, x, pos=None):
        return _tick_text(x) if super().__call__(x, pos) else ""


def _plain_log_axis(ax) -> None:
    """Log y axis labelled 0.5, 1, 2, 1000 ... rather than 10^x (the gains often span less
    than a decade, where matplotlib's default labels read 1.1 x 10^0)."""
    ax.set_yscale("log")
    plain_log_labels(ax.yaxis)


def plain_log_labels(axis) -> None:
    """Label a log-scaled Axis (ax.yaxis, a colour bar's) as _plain_log_axis does."""
    axis.set_major_formatter(_PlainLogFormatter(labelOnlyBase=False))
    # minor ticks labelled only when the axis spans few decades (all of them below half one)
    axis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def _running_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last `window` values at each position (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _mean_of(window: int) -> str:
    """The legend's words for a running mean over `window` steps (the seeds are the
    title's)."""
    return f" ({window}-step running mean)" if window > 1 else ""


def loss_curves_png(runs: dict[str, dict]) -> bytes:
    """Training loss (faint: per step; solid: running mean) and validation loss, per variant:
    the whole run on the left, its second half zoomed on the right (where the kinds differ).

    A run with "seed_runs" (more than one seed, each with its loss_history and val_history)
    is drawn as the mean over seeds with a band from the lowest to the highest seed.
    """
    fig = Figure(figsize=(12, 4.5))
    whole, tail = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    seeds = max(len(run.get("seed_runs") or [run]) for run in runs.values()) if runs else 1
    for ax in (whole, tail):
        for kind, run in runs.items():
            loss_lines(ax, kind, run)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats per byte)")
        ax.grid(alpha=0.3)
    whole.set_title("Loss" + (f" (mean of {seeds} seeds; bands: lowest to highest seed)"
                              if seeds > 1 else ""))
    whole.legend(fontsize=8)
    zoom_to_second_half(tail)
    tail.set_title("Second half of training")
    return figure_png(fig)


def loss_lines(ax, kind: str, run: dict) -> None:
    per_seed = run.get("seed_runs") or [run]
    if len(per_seed) > 1:
        _seed_band(ax, kind, per_seed)
        return
    losses = run["loss_history"]
    color = COLORS.get(kind)
    if losses:
        steps = list(range(1, len(losses) + 1))
        window = max(1, len(losses) // 50)
        ax.plot(steps, losses, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(steps, _running_mean(losses, window), color=color, linewidth=1.5,
                label=f"{LABELS.get(kind, kind)} train{_mean_of(window)}")
    val = run.get("val_history") or []
    if val:
        ax.plot([v["step"] for v in val], [v["val_loss"] for v in val], color=color,
                linestyle="--", marker="o", markersize=3, label=f"{LABELS.get(kind, kind)} val")


def zoom_to_second_half(ax) -> None:
    """Limit ax to the second half of its steps, and y to the range there of the solid lines
    and of the seeds' bands (not of the faint per-step lines)."""
    lines = [line for line in ax.get_lines() if line.get_alpha() is None]  # not the faint ones
    last = max((max(line.get_xdata(), default=0) for line in lines), default=0)
    if last <= 1:
        return
    start = last / 2
    ys = [y for line in lines for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True)
          if x >= start]
    ys += [y for band in ax.collections for path in band.get_paths()
           for x, y in path.vertices if x >= start and math.isfinite(y)]
    ax.set_xlim(start, last)
    if ys:
        pad = 0.05 * (max(ys) - min(ys)) or 0.01
        ax.set_ylim(min(ys) - pad, max(ys) + pad)


def _seed_band(ax, kind: str, per_seed: list[dict]) -> None:
    """Mean over seeds of the running-mean training loss and of the validation loss, each
    with a band from the lowest to the highest seed."""
    color, label = COLORS.get(kind), LABELS.get(kind, kind)
    length = min(len(r["loss_history"]) for r in per_seed)
    if length:
        window = max(1, length // 50)
        curves = [_running_mean(r["loss_history"][:length], window) for r in per_seed]
        at_step = list(zip(*curves, strict=True))  # [step][seed]
        steps = list(range(1, length + 1))
        ax.fill_between(steps, [min(c) for c in at_step], [max(c) for c in at_step],
                        color=color, alpha=0.2, linewidth=0)
        ax.plot(steps, [sum(c) / len(c) for c in at_step], color=color, linewidth=1.5,
                label=f"{label} train{_mean_of(window)}")
    vals = [r.get("val_history") or [] for r in per_seed]
    points = min(len(v) for v in vals)
    if points:
        steps = [v["step"] for v in vals[0][:points]]
        cols = [[v[i]["val_loss"] for v in vals] for i in range(points)]
        ax.fill_between(steps, [min(c) for c in cols], [max(c) for c in cols], color=color,
                        alpha=0.12, linewidth=0, hatch="//")
        ax.plot(steps, [sum(c) / len(c) for c in cols], color=color, linestyle="--",
                marker="o", markersize=3, label=f"{label} val")


def grad_norm_png(runs: dict[str, dict]) -> bytes:
    """Global gradient norm (before clipping) per step, log scale."""
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    for kind, run in runs.items():
        norms = [g for g in run["grad_norm_history"] if math.isfinite(g) and g > 0]
        if not norms:
            continue
        window = max(1, len(norms) // 50)
        color = COLORS.get(kind)
        steps = list(range(1, len(norms) + 1))
        ax.plot(steps, norms, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(steps, _running_mean(norms, window), color=color, linewidth=1.5,
                label=f"{LABELS.get(kind, kind)}{_mean_of(window)}")
    _plain_log_axis(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm (before clipping)")
    ax.set_title("Gradient norm")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return figure_png(fig)


def composite_gain_png(gains: dict[str, dict]) -> bytes:
    """Composite Amax gain versus depth, forward and backward, HC against mHC (log y).

    gains: {kind: a GainReport dict} (the final measurement of each run). Solid: the worst
    token; dashed: the mean over tokens. Depth l is the product H_res_l ... H_res_1.
    """
    fig = Figure(figsize=(10, 4.2))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, direction in zip(axes, ("fwd", "bwd"), strict=True):
        for kind, report in gains.items():
            comp = report[f"composite_{direction}"]
            depth = list(range(1, len(comp) + 1))
            color = COLORS.get(kind)
            ax.plot(depth, [c["max"] for c in comp], color=color, linewidth=1.6,
                    label=f"{LABELS.get(kind, kind)} worst token")
            ax.plot(depth, [c["mean"] for c in comp], color=color, linewidth=1.0,
                    linestyle="--", label=f"{LABELS.get(kind, kind)} mean")
        ax.axhline(1.0, color="black", linewidth=0.6, alpha=0.5)
        _plain_log_axis(ax)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("depth (sublayers composed)")
        name = "forward (max row sum)" if direction == "fwd" else "backward (max column sum)"
        ax.set_title(f"Composite {name}")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("Amax gain magnitude")
    axes[0].legend(fontsize=8)
    fig.suptitle("At the last measurement of each run (the largest over training: "
                 "gain_over_training.png)", fontsize=9)
    return figure_png(fig)


def gain_over_training_png(histories: dict[str, list[dict]]) -> bytes:
    """The largest composite gain (any depth, worst token) at each measurement, log y."""
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    for kind, history in histories.items():
        if not history:
            continue
        color = COLORS.get(kind)
        steps = [h["step"] for h in history]
        ax.plot(steps, [h["max_composite_fwd"] for h in history], color=color, marker="o",
                markersize=3, label=f"{LABELS.get(kind, kind)} forward")
        ax.plot(steps, [h["max_composite_bwd"] for h in history], color=color, marker="s",
                markersize=3, linestyle="--", label=f"{LABELS.get(kind, kind)} backward")
    ax.axhline(1.0, color="black", linewidth=0.6, alpha=0.5)
    _plain_log_axis(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("max composite Amax gain")
    ax.set_title("Composite gain during training")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return figure_png(fig)


def health_png(healths: dict[str, dict]) -> bytes:
    """Connection health against depth, per variant: the streams' mean pairwise cosine
    similarity entering each layer (left) and H_res's Frobenius distance from the identity,
    each layer's (dashed) and the composite's (solid) (right).

    healths: {kind: a HealthReport dict} (the final measurement of each run).
    """
    fig = Figure(figsize=(10, 4.2))
    left, right = fig.subplots(1, 2)
    for kind, report in healths.items():
        color, label = COLORS.get(kind), LABELS.get(kind, kind)
        depth = list(range(1, len(report["stream_cosine"]) + 1))
        left.plot(depth, report["stream_cosine"], color=color, marker="o", markersize=3,
                  label=label)
        right.plot(depth, [c["dist_identity"] for c in report["composite_health"]],
                   color=color, linewidth=1.6, label=f"{label} composite")
        right.plot(depth, [c["dist_identity"] for c in report["layer_health"]], color=color,
                   linewidth=1.0, linestyle="--", label=f"{label} layer")
    lowest = min((c for r in healths.values() for c in r["stream_cosine"] if c == c), default=0)
    left.set_ylim(min(0.0, lowest) - 0.02, 1.02)  # cosines lie in [-1, 1]; 1 = copies
    left.set_title("Stream similarity entering each layer")
    left.set_ylabel("mean pairwise cosine of the n streams")
    right.set_title("H_res distance from the identity")
    right.set_ylabel("||H - I||_F, mean over tokens")
    for ax in (left, right):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("depth (sublayer)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return figure_png(fig)
