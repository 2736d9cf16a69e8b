"""`mhc upcycle`: continue a finished residual run as other connection kinds, beside a residual
continuation, on the same batches, and report the paired differences.

    mhc upcycle --from runs/res --kinds hc,mhc,mhc-lite --steps 200 --seeds 3 --out runs/up

Every continuation starts from the source run's weights (converted function-preserving for
the kinds other than residual: `source.upcycled_model`) with a fresh AdamW state and trains
`--steps` steps of the source run's batch shape and data. The schedule restarts: linear warmup
over `--warmup` steps (default min(the run's warmup, steps // 10)), then the run's schedule
(cosine to its min_lr, or its step decays) over the `--steps` steps, at peak `--lr` (default:
the run's lr). Seed s draws the same batches for every kind (seeds --seed .. --seed + S - 1,
default --seed: the run's seed + 1, so that the first continuation does not replay the
source run's batch order). Validation every `--eval-every` steps (default steps // 5), the
Amax gains alike.

Each continuation is a run folder OUT/<kind>/seed<S>/ trained by the trainer: its checkpoint,
lock, metrics.jsonl and exit status are those of `mhc train`. The folder's start.json (the
converted model's validation loss and the settings) is written before its step-0
checkpoint, and result.json when the run ends. Running the command again (with or without
--resume) skips the runs that hold a result.json of the same settings and resumes the
others from their checkpoints; a folder made with other settings is refused, unless
--overwrite, which starts every run over. OUT itself is locked for the whole command.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from torch_mhc.connections import CONNECTION_KINDS, check_streams
from torch_mhc.lm.config import SEED_MAX, ConfigError, TrainConfig
from torch_mhc.lm.train import (
    RunInterrupted,
    RunLock,
    TrainingDiverged,
    load_training_corpus,
    train,
)
from torch_mhc.lm.train.checkpoint import find_checkpoint
from torch_mhc.runtime.files import atomic_write, remove_tree
from torch_mhc.tools.boundary import warn_warmup
from torch_mhc.tools.out_dirs import check_out_dir
from torch_mhc.tools.upcycle.report import dumps_json, write_outputs
from torch_mhc.tools.upcycle.source import SourceRun, read_source, start_loss, write_start

__all__ = ["START_TOLERANCE", "continuation_config", "upcycle"]

START_TOLERANCE = 1e-4  # relative: a converted model's start loss against the residual's
# fields a rerun may change without changing what a continuation computes
_FREE_FIELDS = ("out_dir", "resume", "overwrite", "quiet", "progress", "tensorboard", "threads")


def _check_int(name: str, value, lo: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{name} must be an integer >= {lo}, got {value!r}")


def check_kinds(kinds: tuple[str, ...], streams: int) -> tuple[str, ...]:
    """The kinds to convert to (residual left out: it is always continued), checked."""
    unknown = [k for k in kinds if k not in CONNECTION_KINDS]
    if unknown:
        raise ConfigError(f"unknown kind {unknown[0]!r}: --kinds takes "
                          f"{', '.join(k for k in CONNECTION_KINDS if k != 'residual')}")
    chosen = tuple(dict.fromkeys(k for k in kinds if k != "residual"))
    if not chosen:
        raise ConfigError("--kinds names no kind to convert to (residual is always continued)")
    for kind in chosen:
        try:
            check_streams(kind, streams)
        except ValueError as e:
            raise ConfigError(f"kind {kind} cannot be upcycled to {streams} streams: {e}") from None
    return chosen


def continuation_config(source: SourceRun, steps: int, lr: float | None = None,
                        warmup: int | None = None, eval_every: int | None = None,
                        verbose: bool = False) -> TrainConfig:
    """The source run's configuration for a continuation of `steps` steps (kind, streams,
    seed and out_dir are set per run)."""
    base = source.train_config
    lr = base.lr if lr is None else lr
    every = max(1, steps // 5) if eval_every is None else eval_every
    cfg = replace(
        base, steps=steps, lr=lr, min_lr=min(base.min_lr, lr),
        warmup=min(base.warmup, steps // 10) if warmup is None else warmup,
        eval_every=every, gain_every=every, parallel="none", micro_batches=1,
        out_dir=None, resume=False, overwrite=False, quiet=not verbose, progress=False)
    cfg.validate()
    return cfg


def _settings(cfg: TrainConfig, source: SourceRun) -> dict:
    """What a continuation's result depends on: a rerun must match it to reuse the folder."""
    d = cfg.to_dict()
    for name in _FREE_FIELDS:
        d.pop(name, None)
    return {"source": str(source.folder.resolve()), "source_step": source.state["step"],
            "train_config": d}


def _plan(base: TrainConfig, kinds: tuple[str, ...], streams: int, seeds: list[int],
          out: Path) -> list[TrainConfig]:
    """One config per run, seed by seed, the residual first within a seed (so that an
    interrupted upcycle holds whole pairs)."""
    return [replace(base, seed=s, out_dir=str(out / kind / f"seed{s}"), resume=True,
                    model=replace(base.model, connection=kind, streams=streams))
            for s in seeds for kind in ("residual", *kinds)]


def upcycle(source: str, out: str, *, kinds: tuple[str, ...] = ("hc", "mhc"), steps: int,
            seeds: int = 1, streams: int | None = None, seed: int | None = None,
            lr: float | None = None, warmup: int | None = None, eval_every: int | None = None,
            overwrite: bool = False, verbose: bool = False) -> dict:
    """Convert the residual run at `source` to each of `kinds`, continue every kind and the
    residual on `seeds` seeds, and write upcycle.json, report.md and loss_curves.png to
    `out`. Returns what upcycle.json holds."""
    _check_int("--steps", steps)
    _check_int("--seeds", seeds)
    if streams is not None:
        _check_int("--streams", streams)
    out_dir = check_out_dir(out, "mhc upcycle")
    src = read_source(source)
    streams = src.model.cfg.streams if streams is None else streams
    kinds = check_kinds(tuple(kinds), streams)
    base = continuation_config(src, steps, lr, warmup, eval_every, verbose)
    first = base.seed + 1 if seed is None else seed
    _check_int("--seed", first, lo=0)
    if first + seeds - 1 > SEED_MAX:
        raise ConfigError(f"--seed + --seeds - 1 must be <= {SEED_MAX}, got {first} and {seeds}")
    configs = _plan(base, kinds, streams, list(range(first, first + seeds)), out_dir)
    for cfg in configs:
        cfg.validate()
    corpus = load_training_corpus(base)
    out_dir.mkdir(parents=True, exist_ok=True)
    # the warmup warning once, when the first continuation starts training (cache: one call)
    warn_once = functools.cache(lambda: warn_warmup(base, "mhc upcycle"))
    with RunLock(out_dir):
        reference = start_loss(src.model, base, corpus)
        rows = []
        for i, cfg in enumerate(configs):
            where = f"[{i + 1}/{len(configs)}] {cfg.model.connection} seed {cfg.seed}"
            rows.append(_continue(cfg, src, corpus, reference, overwrite, where, warn_once))
        return write_outputs(out_dir, src, base, streams, rows, reference)


def _continue(cfg: TrainConfig, src: SourceRun, corpus, reference: float, overwrite: bool,
              where: str, on_start=None) -> dict:
    """One continuation, trained, resumed or skipped; its row with its histories. on_start:
    train's, called once the continuation's own checks have passed."""
    folder = Path(cfg.out_dir)
    settings = _settings(cfg, src)
    if overwrite:
        remove_tree(folder)
    done = _read_json(folder / "result.json")
    if done is not None and done.get("settings") == settings:
        _say(f"{where}: finished earlier, skipped (val loss {_num(done['result']['val_loss'])})")
        return _row(cfg, done["start_val_loss"], done["result"])
    start = _read_json(folder / "start.json")
    if start is not None and start.get("settings") != settings:
        raise ConfigError(f"{folder} holds a continuation with other settings (another source, "
                          "steps, seed or schedule): choose another --out, or pass --overwrite")
    if start is None or not _has_checkpoint(folder):
        start = _begin(cfg, src, corpus, settings, folder)
        began = "continued" if cfg.model.connection == "residual" else "converted"
        _say(f"{where}: {began}, start val loss {start['start_val_loss']:.4f}; training "
             f"{cfg.steps} steps")
    else:
        _say(f"{where}: resuming its checkpoint")
    _check_start(cfg.model.connection, start["start_val_loss"], reference)
    try:
        result = train(cfg, corpus=corpus, on_start=on_start)
    except TrainingDiverged as e:  # a finding, as in `mhc compare`: report what it reached
        _say(f"{where}: {e}")
        result = e.result
    except RunInterrupted as e:  # its own message names `mhc train --resume`
        raise e.saying(f"interrupted in {where} after step {e.step}; run the same "
                       "`mhc upcycle` again to finish: it skips the finished runs and "
                       "resumes this one") from None
    atomic_write(folder / "result.json", dumps_json({"settings": settings,
                                                 "start_val_loss": start["start_val_loss"],
                                                 "result": result.to_dict()}))
    row = _row(cfg, start["start_val_loss"], result.to_dict())
    _say(f"{where}: {result.steps} steps, val loss {_num(row['val_loss'])} (start "
         f"{start['start_val_loss']:.4f}), {_num(row['step_ms'], '.1f')} ms/step"
         + (f"; {result.diverged}" if result.diverged else ""))
    return row


def _begin(cfg: TrainConfig, src: SourceRun, corpus, settings: dict, folder: Path) -> dict:
    """start.json, then the step-0 checkpoint, under the run folder's lock."""
    folder.mkdir(parents=True, exist_ok=True)
    with RunLock(folder):
        loss = write_start(cfg, src, corpus)
        start = {"settings": settings, "start_val_loss": loss}
        atomic_write(folder / "start.json", dumps_json(start))
    return start


def _check_start(kind: str, loss: float, reference: float) -> None:
    if not abs(loss - reference) <= START_TOLERANCE * abs(reference):
        raise RuntimeError(f"the conversion to {kind} is not function-preserving: validation "
                           f"loss {loss:.6f} before any step, the residual run's {reference:.6f}")


def _row(cfg: TrainConfig, start: float, result: dict) -> dict:
    kind = cfg.model.connection
    gains = [g[k] for g in result.get("gain_history") or []
             for k in ("max_composite_fwd", "max_composite_bwd")]
    median = result.get("step_time_median_s")
    return {"kind": kind, "seed": cfg.seed, "streams": cfg.model.n_streams,
            "start_val_loss": start, "val_loss": result["val_loss"],
            "val_bpb": result["val_bpb"],
            "max_gain": max(gains) if kind != "residual" and gains else None,
            "step_ms": median * 1e3 if isinstance(median, float) else None,
            "steps": result["steps"], "diverged": result.get("diverged"),
            "loss_history": result["loss_history"], "val_history": result["val_history"]}


def _has_checkpoint(folder: Path) -> bool:
    try:
        find_checkpoint(folder)
    except Exception:  # noqa: BLE001 - any reason it cannot be read: start the run over
        return False
    return True


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _num(x, spec: str = ".4f") -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, spec)


def _say(message: str) -> None:
    print(f"mhc upcycle: {message}", file=sys.stdout, flush=True)

