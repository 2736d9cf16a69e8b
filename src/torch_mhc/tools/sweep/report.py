"""What `mhc sweep` writes beside sweep.json: report.md (per kind, where it breaks and its best
validation loss) and two heatmaps, heatmap_loss.png and heatmap_gain.png (one panel per kind,
depth x peak learning rate). With several seeds a square shows the mean validation loss of
the seeds that finished, the largest gain of any seed, and is marked when any seed diverged."""

from __future__ import annotations

import math

from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure

from torch_mhc.runtime.files import atomic_write
from torch_mhc.tools.compare.plots import LABELS, figure_png, plain_log_labels

__all__ = ["FIGURES", "aggregate", "best", "breaks_at", "breaks_text", "format_markdown",
           "heatmap_png", "write_report"]

FIGURES = ("heatmap_loss.png", "heatmap_gain.png")


def aggregate(records: list[dict]) -> dict[str, dict[tuple[int, float], dict]]:
    """{kind: {(depth, lr): {"runs", "diverged", "val_loss" (mean of the finished seeds or
    None), "max_gain" (largest over seeds or None)}}}."""
    table: dict[str, dict[tuple[int, float], dict]] = {}
    for r in records:
        square = table.setdefault(r["kind"], {}).setdefault(
            (r["n_layers"], r["lr"]), {"runs": 0, "diverged": 0, "losses": [], "gains": []})
        square["runs"] += 1
        square["diverged"] += bool(r["diverged"])
        if r["val_loss"] is not None:
            square["losses"].append(r["val_loss"])
        if r["max_gain"] is not None:
            square["gains"].append(r["max_gain"])
    for squares in table.values():
        for square in squares.values():
            losses, gains = square.pop("losses"), square.pop("gains")
            square["val_loss"] = sum(losses) / len(losses) if losses else None
            square["max_gain"] = max(gains) if gains else None
    return table


def _axes(squares: dict[tuple[int, float], dict]) -> tuple[list[int], list[float]]:
    return sorted({d for d, _ in squares}), sorted({lr for _, lr in squares})


def breaks_at(squares: dict[tuple[int, float], dict]) -> dict[int, float | None]:
    """Per depth, the smallest lr at which a run diverged (None: none did)."""
    depths, lrs = _axes(squares)
    return {d: next((lr for lr in lrs if squares.get((d, lr), {}).get("diverged")), None)
            for d in depths}


def breaks_text(squares: dict[tuple[int, float], dict], sep: str = "; ") -> str:
    """breaks_at in words: "L4: 0.03; L8: none up to 0.1" (the largest lr run there)."""
    parts = []
    for d, lr in breaks_at(squares).items():
        top = max(x for depth, x in squares if depth == d)
        parts.append(f"L{d}: {lr:g}" if lr is not None else f"L{d}: none up to {top:g}")
    return sep.join(parts)


def best(squares: dict[tuple[int, float], dict]) -> tuple[float, int, float] | None:
    """(val loss, depth, lr) of the lowest loss among squares where no seed diverged."""
    found = [(s["val_loss"], d, lr) for (d, lr), s in squares.items()
             if not s["diverged"] and s["val_loss"] is not None]
    return min(found) if found else None


def _square_text(s: dict | None) -> str:
    if s is None:
        return "-"
    if s["diverged"]:
        part = f" ({s['diverged']}/{s['runs']} seeds)" if s["runs"] > 1 else ""
        loss = f", {s['val_loss']:.4f}" if s["val_loss"] is not None else ""
        return f"**diverged**{part}{loss}"
    return f"{s['val_loss']:.4f}"


def format_markdown(records: list[dict], config: dict, label: str) -> str:
    """report.md: the summary per kind, then each kind's depth x lr table of val losses."""
    table = aggregate(records)
    seeds = sorted({r["seed"] for r in records})
    lines = [f"# mhc sweep (preset {label}): {len(records)} cells", "",
             "Each cell trains the reference LM for the same steps; a cell *diverged* when the "
             "spike policy stopped it (a non-finite loss or gradient, or a loss above "
             f"{config.get('spike_factor')} x its running mean) or its loss was not finite. "
             f"Validation loss in nats per byte, seed{'s' if len(seeds) > 1 else ''} "
             f"{', '.join(map(str, seeds))}"
             + (" (mean over the seeds that finished)" if len(seeds) > 1 else "") + ".", "",
             "## Where each kind breaks", "",
             "| kind | smallest lr that diverged, per depth | best val loss (depth, lr) | "
             "max composite gain |", "|---|---|---|---|"]
    for kind, squares in table.items():
        limits = breaks_text(squares)
        top = best(squares)
        gains = [s["max_gain"] for s in squares.values() if s["max_gain"] is not None]
        best_text = f"{top[0]:.4f} (L{top[1]}, lr {top[2]:g})" if top else "none finished"
        gain_text = f"{max(gains):.3g}" if gains else "n/a"
        lines.append(f"| {kind} | {limits} | {best_text} | {gain_text} |")
    for kind, squares in table.items():
        depths, lrs = _axes(squares)
        lines += ["", f"## {kind}", "", "| depth \\ lr | " + " | ".join(f"{lr:g}" for lr in lrs)
                  + " |", "|---|" + "---|" * len(lrs)]
        for d in depths:
            lines.append(f"| {d} | " + " | ".join(_square_text(squares.get((d, lr)))
                                                  for lr in lrs) + " |")
    lines += ["", "## Configuration (every cell; each sets its kind, depth, lr, seed, and "
              "min_lr = lr / 10)", "", "| key | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in config.items()]
    lines += ["", "![validation loss](heatmap_loss.png)", "",
              "![max composite gain](heatmap_gain.png)", ""]
    return "\n".join(lines)


def heatmap_png(table: dict[str, dict[tuple[int, float], dict]], value: str,
                title: str, log: bool = False) -> bytes:
    """One panel per kind of table, depth (rows) x lr (columns), coloured by each square's
    `value`; a diverged square is marked x, one without a value is left blank. The colour
    scale is shared by the panels (log: a log scale)."""
    kinds = list(table)
    values = [s[value] for squares in table.values() for s in squares.values()
              if s[value] is not None and (s[value] > 0 or not log)]
    # constrained layout: the figure's title above the panels' own, not on them
    fig = Figure(figsize=(3.6 * max(1, len(kinds)) + 1, 3.9), layout="constrained")
    if not values:
        ax = fig.add_subplot()
        ax.axis("off")
        ax.text(0.5, 0.5, f"{title}: no values (no kind with H_res, or nothing finished)",
                ha="center", va="center")
        return figure_png(fig)
    lo, hi = min(values), max(values)
    norm = LogNorm(lo, hi if hi > lo else lo * 1.01) if log else Normalize(lo, hi if hi > lo
                                                                           else lo + 1e-9)
    axes = fig.subplots(1, len(kinds), squeeze=False)[0]
    for ax, kind in zip(axes, kinds, strict=True):
        image = _panel(ax, table[kind], value, norm)
        ax.set_title(LABELS.get(kind, kind))
    axes[0].set_ylabel("depth (blocks)")
    bar = fig.colorbar(image, ax=list(axes), label=title, shrink=0.9)
    if log:  # 2, 3, 6 rather than 2 x 10^0
        plain_log_labels(bar.ax.yaxis)
    fig.suptitle(f"{title} (x: diverged)")
    return figure_png(fig)


def _panel(ax, squares: dict[tuple[int, float], dict], value: str, norm):
    depths, lrs = _axes(squares)
    grid = [[math.nan] * len(lrs) for _ in depths]
    for (d, lr), s in squares.items():
        if s[value] is not None:
            grid[depths.index(d)][lrs.index(lr)] = s[value]
    image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis", norm=norm)
    for (d, lr), s in squares.items():
        i, j = depths.index(d), lrs.index(lr)
        if s["diverged"]:
            ax.text(j, i, "x", ha="center", va="center", color="red", fontsize=16,
                    fontweight="bold")
        elif s[value] is not None:
            light = norm(s[value]) > 0.6  # viridis is light at its top end
            ax.text(j, i, f"{s[value]:.3g}", ha="center", va="center",
                    color="black" if light else "white", fontsize=7)
    ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs], rotation=45)
    ax.set_yticks(range(len(depths)), [str(d) for d in depths])
    ax.set_xlabel("peak learning rate")
    return image


def write_report(out, records: list[dict], config: dict, label: str) -> None:
    """The heatmaps, then report.md, each written atomically."""
    table = aggregate(records)
    with_gain = {k: v for k, v in table.items() if k != "residual"}
    atomic_write(out / "heatmap_loss.png",
                 heatmap_png(table, "val_loss", "final validation loss (nats)"))
    atomic_write(out / "heatmap_gain.png",
                 heatmap_png(with_gain, "max_gain", "max composite Amax gain", log=True))
    atomic_write(out / "report.md", format_markdown(records, config, label).encode("utf-8"))
