"""Running a sweep: every cell of the grid trained by `torch_mhc.lm.train.train` in its own
folder, its result recorded in sweep.json as soon as it finishes.

    summary = sweep("runs/sweep", grid, config)            # one process
    summary = sweep("runs/sweep", grid, config, jobs=2)    # cells in 2 worker processes

Resuming: sweep.json holds the finished cells; a rerun into the same folder skips them and
runs the rest (a cell that was interrupted resumes from the checkpoint in its folder). The
base configuration is stored beside the cells, and a rerun with another one is refused, so
that one sweep.json never mixes cells of different training settings. A cell stopped by the
spike policy is a result (diverged), not an error.

With jobs > 1 the cells run in a spawn-context process pool, one torch thread per process.
On Ctrl-C or SIGTERM the parent sets a stop event; each worker's watcher thread passes it to
its training as SIGTERM, so the cell checkpoints at its next step boundary, and the cells
that finished meanwhile are recorded before the interrupt propagates.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import replace
from pathlib import Path

from torch_mhc.lm.config import ConfigError, TrainConfig
from torch_mhc.lm.train import (
    CheckpointError,
    RunInterrupted,
    RunLock,
    TrainingDiverged,
    TrainResult,
    load_training_corpus,
    train,
)
from torch_mhc.runtime.files import atomic_write
from torch_mhc.tools.out_dirs import check_out_dir
from torch_mhc.tools.sweep.grid import SWEPT, Cell, Grid, cell_config
from torch_mhc.tools.sweep.report import write_report

__all__ = ["IGNORED_KEYS", "SWEEP_FILE", "cell_record", "run_cell", "sweep"]

SWEEP_FILE = "sweep.json"
# config fields that do not change a cell's result: a rerun may differ in them
IGNORED_KEYS = ("quiet", "progress", "tensorboard", "threads", "cache_dir", "log_every",
                "out_dir", "resume", "overwrite")


def sweep(out_dir: str | os.PathLike, grid: Grid, config: TrainConfig, *, jobs: int = 1,
          label: str = "custom", say: Callable[[str], None] = print,
          progress: bool = True) -> dict:
    """Run every cell of `grid` not yet in out_dir/sweep.json, then write report.md and the
    heatmaps. Returns {"cells": every recorded cell, "ran", "skipped", "wall_time_s"}."""
    t0 = time.perf_counter()
    out = check_out_dir(out_dir, "mhc sweep")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"jobs must be an integer >= 1, got {jobs!r}")
    grid.check(config.model.streams, config.seed)
    if jobs > 1:
        config = replace(config, threads=1)
    cells = grid.cells(config.seed)
    configs = {c: cell_config(config, c, out / "cells" / c.name) for c in cells}
    for cfg in configs.values():
        cfg.validate()
    corpus = load_training_corpus(config)  # a missing or short corpus fails before any cell
    with RunLock(out):
        state = _load_state(out, config, label, grid)
        done = {Cell.of(r): r for r in state["cells"]}
        _write_state(out, state, done)
        todo = [c for c in cells if c not in done]
        # said before the first cell, which may take minutes to report
        say(f"sweep ({label}): {len(cells)} cells, {len(todo)} to run"
            + (f", {len(cells) - len(todo)} recorded" if len(todo) < len(cells) else "")
            + f"; {jobs} job{'s' if jobs > 1 else ''}, into {out}")
        bar = _progress_bar(len(cells), len(cells) - len(todo), progress)
        for i, c in enumerate(c for c in cells if c in done):
            say(f"[{i + 1}/{len(cells)}] {c.name}: skipped (recorded in {SWEEP_FILE})")

        finished = [len(cells) - len(todo)]  # this grid's cells done, for the lines

        def record(cell: Cell, rec: dict) -> None:
            done[cell] = rec
            _write_state(out, state, done)
            bar.update(1)
            finished[0] += 1
            say(f"[{finished[0]}/{len(cells)}] {cell.name}: {describe(rec)}")

        try:
            if jobs == 1:
                for c in todo:
                    try:
                        record(c, run_cell(configs[c], corpus))
                    except RunInterrupted as e:  # its own message names `mhc train --resume`
                        raise e.saying(
                            f"interrupted in cell {c.name} after step {e.step}; run the same "
                            "`mhc sweep` again to finish: it skips the finished cells and "
                            "resumes this one") from None
            else:
                _run_parallel(todo, configs, jobs, record)
        finally:
            bar.close()
        records = list(done.values())
        write_report(out, records, state["config"], label)
    return {"cells": records, "ran": len(todo), "skipped": len(cells) - len(todo),
            "wall_time_s": time.perf_counter() - t0}


def describe(rec: dict) -> str:
    """One cell's outcome in words, for its progress line."""
    if rec["diverged"]:
        text = f"diverged after {rec['steps']} steps"
    else:
        text = f"val loss {rec['val_loss']:.4f}"
    if rec["max_gain"] is not None:
        text += f", max gain {rec['max_gain']:.3g}"
    if rec["step_ms"] is not None:
        text += f", {rec['step_ms']:.1f} ms/step"
    return text


def run_cell(cfg: TrainConfig, corpus=None) -> dict:
    """Train one cell and return its record; a checkpoint that cannot be resumed is replaced
    by a fresh run of the cell."""
    try:
        return _train_cell(cfg, corpus)
    except CheckpointError:
        if cfg.resume is False:
            raise
        print(f"note: {cfg.out_dir}: its checkpoint does not resume; running the cell afresh",
              file=sys.stderr)
        return _train_cell(replace(cfg, resume=False, overwrite=True), corpus)


def _train_cell(cfg: TrainConfig, corpus) -> dict:
    try:
        result, stopped = train(cfg, corpus=corpus), None
    except TrainingDiverged as e:  # a finding: where this kind stops training
        result, stopped = e.result, str(e)
    return cell_record(cfg, result, stopped)


def cell_record(cfg: TrainConfig, result: TrainResult, stopped: str | None) -> dict:
    """The cell's entry of sweep.json: strict JSON (every figure finite or None)."""
    diverged = (stopped is not None or not math.isfinite(result.final_loss)
                or not math.isfinite(result.val_loss))
    gains = [g[key] for g in result.gain_history
             for key in ("max_composite_fwd", "max_composite_bwd")]
    finite = [g for g in gains if math.isfinite(g)]
    return {
        "kind": cfg.model.connection,
        "n_layers": cfg.model.n_layers,
        "lr": cfg.lr,
        "seed": cfg.seed,
        "diverged": diverged,
        "val_loss": None if diverged else result.val_loss,
        # the largest composite Amax gain, forward or backward, over every measurement
        "max_gain": max(finite) if finite else None,
        "gain_not_finite": len(finite) < len(gains),
        "step_ms": _finite(result.step_time_median_s * 1e3),
        "steps": result.steps,
        "stopped": stopped if stopped is not None else (
            "loss not finite" if diverged else None),
        "params": result.params,
        "elapsed_s": _finite(result.elapsed_s),
    }


def _finite(x: float) -> float | None:
    return x if isinstance(x, int | float) and math.isfinite(x) else None


def _load_state(out: Path, config: TrainConfig, label: str, grid: Grid) -> dict:
    """sweep.json's content: the recorded cells of an earlier run with the same base
    configuration, or a new state."""
    mine = _comparable(config.to_dict())
    path = out / SWEEP_FILE
    if not path.exists():
        return {"preset": label, "config": mine, "cells": []}
    try:
        state = json.loads(path.read_text())
        cells = [r for r in state["cells"] if Cell.of(r)]
        theirs = state["config"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} is not a sweep's record ({e}); choose another --out or "
                          "remove it") from None
    if theirs != mine:
        keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise ConfigError(f"{path} holds cells trained with other settings (differing: "
                          f"{', '.join(keys)}); choose another --out, or the same settings")
    return {"preset": label, "config": mine, "cells": cells}


def _comparable(config: dict) -> dict:
    """The base configuration as sweep.json stores it: model fields flattened, without the
    fields each cell sets and those that do not change a result."""
    flat = {k: v for k, v in config.items() if k != "model"}
    flat.update(config["model"])
    return {k: v for k, v in sorted(flat.items()) if k not in SWEPT and k not in IGNORED_KEYS}


def _write_state(out: Path, state: dict, done: dict[Cell, dict]) -> None:
    state["cells"] = list(done.values())
    text = json.dumps(state, indent=1, allow_nan=False) + "\n"
    atomic_write(out / SWEEP_FILE, text.encode())


def _progress_bar(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    # disable=None: shown on a terminal only, so logs and tests get the lines alone
    return tqdm(total=total, initial=initial, unit="cell", desc="sweep",
                disable=None if enabled else True, dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------
# cells in worker processes
# ---------------------------------------------------------------------------------------------

_STOP: list = []  # the parent's stop event, in each worker process


def _run_parallel(todo: list[Cell], configs: dict[Cell, TrainConfig], jobs: int,
                  record: Callable[[Cell, dict], None]) -> None:
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    pool = ProcessPoolExecutor(min(jobs, len(todo)) or 1, mp_context=ctx,
                               initializer=_init_worker, initargs=(stop,))
    pending = {pool.submit(_cell_in_worker, configs[c]): c for c in todo}
    try:
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                rec = future.result()
                if rec is None:
                    raise KeyboardInterrupt(f"the process of cell {pending[future].name} was "
                                            "interrupted")
                record(pending.pop(future), rec)
    except BaseException:
        stop.set()  # running cells checkpoint and stop; queued ones do not start
        pool.shutdown(wait=True, cancel_futures=True)
        for future, cell in pending.items():
            if future.done() and not future.cancelled() and future.exception() is None:
                if future.result() is not None:
                    record(cell, future.result())
        raise
    pool.shutdown(wait=True)


def _init_worker(stop) -> None:
    import torch

    torch.set_num_threads(1)
    _STOP.append(stop)
    # Ctrl-C reaches the whole process group: the parent decides, through the stop event
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    threading.Thread(target=_watch, args=(stop,), daemon=True).start()


def _on_sigterm(signum, frame) -> None:
    """Outside a training loop: the watcher's signals are ignored, anyone else's (the pool
    ending a broken worker) ends the process."""
    if not _STOP[0].is_set():
        os._exit(128 + signum)


def _watch(stop) -> None:
    """Once the parent stops: SIGTERM to this process every half second, which the trainer's
    handler turns into a checkpoint at the next step boundary (repeated, since a signal
    before its handler is installed is ignored)."""
    stop.wait()
    while True:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)


_CORPORA: dict = {}  # per worker: the corpus of each data setting, loaded once


def _cell_in_worker(cfg: TrainConfig) -> dict | None:
    """run_cell in a worker; None when the sweep was stopped or the cell interrupted."""
    if _STOP[0].is_set():
        return None
    key = (cfg.data, cfg.cache_dir, cfg.val_fraction, cfg.max_bytes)
    if key not in _CORPORA:
        _CORPORA[key] = load_training_corpus(cfg)
    try:
        return run_cell(cfg, _CORPORA[key])
    except KeyboardInterrupt:  # the trainer's RunInterrupted: its checkpoint is written
        return None
