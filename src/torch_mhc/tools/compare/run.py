"""`mhc compare`: connection kinds trained side by side, over one or more seeds, and their report.

    report = compare("cmp/")                       # the "default" preset: residual, hc, mhc
    report = compare("cmp/", preset="stress", steps=200)
    report = compare("cmp/", kinds=("residual", "mhc", "mhc-lite"), seeds=3)

The runs of one seed share everything except the connection: the seed (hence the same
initial block weights: connections draw no random numbers), the same batches in the same
order (the sampler is seeded alike), the same steps and schedule. HC and mHC carry the
connection parameters on top of the residual model's; the report states every budget.
With seeds=K every kind trains on seeds seed, seed+1, ..., seed+K-1 (paired: the same seed
gives every kind the same blocks and batches), the report gives each kind's mean +- sd over
seeds and its paired difference to the residual with a 95% t interval, saying which
differences are significant (torch_mhc.tools.compare.seeds), and the loss plot shows the seed band.

Written to out_dir (created if missing), each file atomically (temp file + rename):
    report.json            one entry per variant (kind, val_loss, val_bpb, tokens_per_s,
                           peak_mem_bytes, step_time_ratio, max_composite_gain_fwd/bwd,
                           params, connection_params, histories) plus the configuration;
                           strict JSON: a NaN or infinite figure (a stopped run's) is null
    report.md              the same as a markdown table, with the configuration
    loss_curves.png        training and validation loss of all three
    grad_norm.png          gradient norm per step
    composite_gain.png     composite forward / backward Amax gain versus depth, HC vs mHC
    gain_over_training.png the largest composite gain at each measurement
    health.png             stream similarity and H_res's distance from the identity against
                           depth, per kind (final measurement, first seed)
    <kind>/                each run's metrics.jsonl and final checkpoint (ckpt/);
                           <kind>/seed<S>/ per seed when seeds > 1
Running compare again on the same folder replaces all of these: the figures this run does
not draw, the folders of kinds it does not train and the per-seed folders (or single-seed
files) of another seed count are removed with the report. Files of other names are left.
Under torchrun only rank 0 writes the report and prints.

Presets (`PRESETS`):
- "default": finishes on a 2-core CPU in about 5 minutes and every variant learns clearly
  (validation about 2.6 bits per byte on the standard library source); see the README.
- "tiny": seconds; for tests and smoke checks.
- "stress": 24 blocks (48 sublayers) of width 64 at a high learning rate: the setting in
  which the HC paper's unconstrained H_res maps compound, so HC's composite gain can grow by
  orders of magnitude while mHC's doubly stochastic maps keep it near 1.
- "shakespeare": nanoGPT's CPU recipe for a text file given with --data (tiny Shakespeare:
  nanoGPT's residual model reaches about 1.88 nats there): 4 layers, 4 heads, width 128,
  context 64, batch 12, 2000 steps, lr 1e-3 cosine to 1e-4 after 100 warmup steps, beta2
  0.99, no dropout, the last 10% of the bytes held out. Bytes are characters for ASCII text.
Every preset runs torch on one CPU thread (`threads = 1`, set around the comparison's runs
and restored after them; `--threads 0` keeps torch's default). Their matrices are small:
on an idle 2-core machine a second thread made a step only 1.3-1.8x faster, while on a
machine shared with other work a two-thread step stalled whenever either thread lost its
core, and whole comparisons took 2-3x longer (9-17 minutes measured, against 5.6 on one thread).
"""

from __future__ import annotations

import math
import os
import platform
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from torch_mhc.connections import CONNECTION_KINDS
from torch_mhc.lm import parallel as par
from torch_mhc.lm.config import SEED_MAX
from torch_mhc.lm.data import bits_per_byte
from torch_mhc.lm.train import (
    ConfigError,
    RunInterrupted,
    TrainConfig,
    TrainingDiverged,
    TrainResult,
    load_training_corpus,
    torch_threads,
    train,
)
from torch_mhc.tools.compare import seeds as compare_stats
from torch_mhc.tools.compare.report import write_report
from torch_mhc.tools.out_dirs import check_out_dir

__all__ = ["DEFAULT_KINDS", "KINDS", "PRESETS", "compare", "preset_config"]

KINDS = CONNECTION_KINDS  # what compare accepts
DEFAULT_KINDS = ("residual", "hc", "mhc")
FIGURES = ("loss_curves.png", "grad_norm.png", "composite_gain.png", "gain_over_training.png",
           "health.png")
# what train writes into a run folder (out/<kind> with one seed)
_RUN_FILES = ("metrics.jsonl", "ckpt", "ckpt.prev", "tb")

PRESETS: dict[str, dict] = {
    "tiny": {
        "dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 32,
        "seq_len": 32, "batch_size": 4, "steps": 20, "lr": 3e-3, "min_lr": 3e-4,
        "warmup": 2, "eval_every": 10, "eval_batches": 2, "gain_every": 10,
        "gain_batch_size": 2, "log_every": 5, "threads": 1,
    },
    "default": {
        "dim": 128, "n_layers": 4, "n_heads": 4, "max_seq_len": 128,
        "seq_len": 128, "batch_size": 16, "steps": 400, "lr": 4e-3, "min_lr": 4e-4,
        "warmup": 40, "eval_every": 100, "eval_batches": 10, "gain_every": 50,
        "log_every": 10, "threads": 1,
    },
    "stress": {
        "dim": 64, "n_layers": 24, "n_heads": 2, "max_seq_len": 64,
        "seq_len": 64, "batch_size": 8, "steps": 500, "lr": 1e-2, "min_lr": 1e-3,
        "warmup": 20, "eval_every": 100, "eval_batches": 5, "gain_every": 25,
        "log_every": 10, "threads": 1,
    },
    "shakespeare": {
        "dim": 128, "n_layers": 4, "n_heads": 4, "max_seq_len": 64,
        "seq_len": 64, "batch_size": 12, "steps": 2000, "lr": 1e-3, "min_lr": 1e-4,
        "warmup": 100, "beta2": 0.99, "val_fraction": 0.1, "eval_every": 500,
        "eval_batches": 100, "gain_every": 250, "log_every": 50, "threads": 1,
    },
}


def preset_config(preset: str) -> TrainConfig:
    """TrainConfig defaults with the preset's values applied."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    return TrainConfig().updated(PRESETS[preset])


def compare(out_dir: str | os.PathLike, preset: str = "default", *,
            config: TrainConfig | None = None, kinds: tuple[str, ...] = DEFAULT_KINDS,
            seeds: int = 1, on_start: Callable[[], object] | None = None,
            **overrides) -> dict:
    """Train each of `kinds` on `seeds` seeds with the same configuration and write the report
    to out_dir.

    config: the base configuration (its model.connection and seed are replaced per run); by
    default the preset's, with `overrides` (TrainConfig or ModelConfig field names) applied.
    Every run's configuration is validated and the corpus loaded before the first step;
    on_start is called then (`mhc compare` says its warnings there, after the checks that
    could refuse the comparison). Returns the report dict that report.json holds.
    """
    t_start = time.perf_counter()
    out = check_out_dir(out_dir, "mhc compare")
    base = config if config is not None else preset_config(preset)
    base = base.updated(overrides)
    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ConfigError(f"unknown kind{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(unknown)}: kinds must be names from {', '.join(KINDS)}")
    if not kinds or len(set(kinds)) != len(kinds):
        raise ConfigError(f"kinds must be distinct names from {', '.join(KINDS)}; got "
                          f"{', '.join(kinds) or 'none'}")
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ConfigError(f"seeds must be an integer >= 1, got {seeds!r}")
    if base.resume is not False:
        raise ConfigError("compare starts fresh runs: resume is not supported")
    if preset == "shakespeare" and base.data is None:
        raise ConfigError("the shakespeare preset trains on a text file given with --data "
                          "(for example tiny Shakespeare's input.txt); got no --data")
    if base.seed + seeds - 1 > SEED_MAX:
        raise ConfigError(f"seed + seeds - 1 must be <= {SEED_MAX} (the runs use seeds seed .. "
                          f"seed + seeds - 1), got seed {base.seed} and seeds {seeds}")
    models = {}
    for kind in kinds:  # every kind checked before any training
        try:
            models[kind] = replace(base.model, connection=kind)
        except ValueError as e:
            raise ConfigError(f"kind {kind} cannot run with streams = {base.model.streams}: "
                              f"{e}") from None
    seed_list = [base.seed + s for s in range(seeds)]
    configs = {
        (kind, seed): replace(base, seed=seed, model=models[kind],
                              out_dir=str(out / kind if seeds == 1 else
                                          out / kind / f"seed{seed}"), overwrite=True)
        for seed in seed_list for kind in kinds
    }
    for cfg in configs.values():
        cfg.validate()
    corpus = load_training_corpus(base)
    if on_start is not None:
        on_start()

    # One throwaway step of each kind first, checkpoint included, so that the one-time costs
    # of a process (thread pools, kernel initialisation, each kind's lazily loaded libraries,
    # the checkpoint writer) land in none of the measured runs: at small sizes they are a few
    # MiB, as large as a run's own growth, and would fall on whichever kind runs first. And
    # every page of the memory-mapped corpus is read once, so that no run's peak RSS is
    # charged for the pages its random batches happen to fault in first.
    # The thread count is set once for all of them (each run's own setting is then the count
    # it finds), so that no run starts by resizing torch's thread pool.
    int(np.asarray(corpus.tokens[::4096], dtype=np.int64).sum())
    with torch_threads(base.threads):
        _warm_up(configs, kinds, seed_list[0], corpus, out)
        results = _train_runs(configs, kinds, corpus, several_seeds=seeds > 1)
    report = _report(base, preset_label(preset, base), results, corpus,
                     time.perf_counter() - t_start)
    if _rank0():
        written = write_report(out, report, results)
        removed = remove_stale(out, kinds, seed_list, written)
        if removed:  # an earlier comparison's runs, gone with it: say so
            print(f"mhc compare: note: removed {', '.join(removed)} from {out}, left by an "
                  "earlier comparison into this folder (this one replaces it)",
                  file=sys.stderr, flush=True)
    return report


def _warm_up(configs: dict, kinds: tuple[str, ...], seed: int, corpus, out: Path) -> None:
    """One step of each kind, its checkpoint written into out/.warmup (the same path on every
    rank under torchrun; removed after)."""
    folder = out / ".warmup"
    for kind in kinds:
        cfg = replace(configs[kind, seed], steps=1, warmup=0, eval_batches=1, quiet=True,
                      progress=False, out_dir=str(folder / kind), overwrite=True)
        try:
            train(cfg, corpus=corpus)
        except TrainingDiverged:  # the measured run stops alike and is reported as such
            pass
        except RunInterrupted as e:  # its checkpoint is the warm-up's, nothing to resume
            raise e.saying(f"interrupted in the warm-up step of {kind}, before any measured "
                           "run; run `mhc compare` again to start it over") from None
    par.barrier()
    if _rank0():
        shutil.rmtree(folder, ignore_errors=True)


def _train_runs(configs: dict, kinds: tuple[str, ...], corpus, several_seeds: bool
                ) -> dict[str, list[TrainResult]]:
    """Each run of configs ({(kind, seed): TrainConfig}, seed by seed, every kind within a
    seed: an interrupted comparison holds whole pairs); a stopped run is a result too."""
    results: dict[str, list[TrainResult]] = {kind: [] for kind in kinds}
    for (kind, seed), cfg in configs.items():
        try:
            results[kind].append(train(cfg, corpus=corpus))
        except TrainingDiverged as e:  # a finding, not a failure: report what it reached
            if not cfg.quiet and _rank0():
                print(e, flush=True)
            results[kind].append(e.result)
        except RunInterrupted as e:  # the run's own message offers a resume compare lacks
            which = kind + (f", seed {seed}" if several_seeds else "")
            raise e.saying(f"interrupted in the {which} run after step {e.step}; a comparison "
                           "does not resume: run `mhc compare` again to start it over") from None
    return results


def _rank0() -> bool:
    """True on the process that writes: a single process, or rank 0 under torchrun (read
    from the environment too, since train closes its process group when it returns)."""
    try:
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        rank = 0
    return rank == 0 and par.is_rank0()


def remove_stale(out: Path, kinds: tuple[str, ...], seed_list: list[int],
                 written: list[str]) -> list[str]:
    """Remove what an earlier comparison left in out that this one did not write: figures it
    did not draw, folders of kinds it did not train, and in the kinds' folders the seed<S>
    folders of other seeds (with one seed: every seed folder; with several: the files of a
    single-seed run). Only names compare writes are touched. Returns the runs' folders and
    files removed (relative to out; the figures left out)."""
    for name in FIGURES:
        if name not in written:
            (out / name).unlink(missing_ok=True)
    removed = []
    for kind in KINDS:
        folder = out / kind
        if not folder.is_dir():
            continue
        if kind not in kinds:
            shutil.rmtree(folder)
            removed.append(f"{kind}/")
            continue
        keep = {f"seed{s}" for s in seed_list} if len(seed_list) > 1 else set()
        for entry in sorted(folder.iterdir()):
            stale_seed = re.fullmatch(r"seed\d+", entry.name) and entry.name not in keep
            stale_run = len(seed_list) > 1 and entry.name in _RUN_FILES
            if stale_seed or stale_run:
                is_dir = entry.is_dir()
                if is_dir:
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
                removed.append(f"{kind}/{entry.name}{'/' if is_dir else ''}")
    return removed


def preset_label(preset: str, base: TrainConfig) -> str:
    """The preset's name, with ", modified" when base differs from it (shakespeare's --data,
    which the preset requires, does not count)."""
    if preset not in PRESETS:
        return f"{preset}, modified"
    ref = preset_config(preset)
    if preset == "shakespeare":
        ref = replace(ref, data=base.data)
    return preset if base == ref else f"{preset}, modified"


def _report(base: TrainConfig, preset: str, results: dict[str, list[TrainResult]], corpus,
            wall_s: float) -> dict:
    """Per kind: the first seed's run in full (speed, memory, gains, histories), the validation
    figures averaged over seeds, the seed statistics and the final connection health."""
    ref = results["residual"][0] if "residual" in results else None
    seeds = len(next(iter(results.values())))
    stats = compare_stats.seed_summary({
        kind: [{"seed": base.seed + i, "val_loss": r.val_loss, "val_bpb": r.val_bpb}
               for i, r in enumerate(runs)]
        for kind, runs in results.items()})
    variants = []
    for kind, runs in results.items():
        r = runs[0]
        ratio = (r.step_time_median_s / ref.step_time_median_s
                 if ref is not None and ref.step_time_median_s > 0 else None)
        final = r.final_gains
        variants.append({
            "kind": kind,
            "streams": 1 if kind == "residual" else base.model.streams,
            "val_loss": r.val_loss,
            "val_bpb": r.val_bpb,
            "final_train_loss": r.final_loss,
            "final_train_bpb": bits_per_byte(r.final_loss),
            "tokens_per_s": r.tokens_per_s,
            "tokens_per_s_median_step": base.batch_size * base.seq_len / r.step_time_median_s,
            "step_time_median_s": r.step_time_median_s,
            "step_time_ratio": ratio,
            "peak_mem_bytes": r.peak_mem_bytes,
            "peak_mem_kind": r.peak_mem_kind,
            "max_composite_gain_fwd": _or_none(r.max_composite_gain_fwd),
            "max_composite_gain_bwd": _or_none(r.max_composite_gain_bwd),
            "final_composite_gain_fwd": final["max_composite_fwd"] if final else None,
            "final_composite_gain_bwd": final["max_composite_bwd"] if final else None,
            "params": r.params,
            "connection_params": r.connection_params,
            "extra_params_vs_residual": (r.params - ref.params) if ref is not None else None,
            "steps_completed": r.steps,
            "diverged": r.diverged,
            "elapsed_s": r.elapsed_s,
            "amp_dtype": r.amp_dtype,
            "device": r.device,
            "checkpoint": r.checkpoint,
            "loss_history": r.loss_history,
            "grad_norm_history": r.grad_norm_history,
            "val_history": r.val_history,
            "gain_history": [{"step": g["step"], "max_composite_fwd": g["max_composite_fwd"],
                              "max_composite_bwd": g["max_composite_bwd"]}
                             for g in r.gain_history],
            "final_gains": final,
            "health": compare_stats.health_summary(final),
            **stats[kind],
        })
        if seeds > 1:
            _average_over_seeds(variants[-1], runs, base.seed)
    config = base.to_dict()
    config["model"]["connection"] = "varies: " + ", ".join(results)
    config["seed"] = f"{base.seed} to {base.seed + seeds - 1}" if seeds > 1 else base.seed
    return {
        "preset": preset,
        "seeds": seeds,
        "wall_time_s": wall_s,
        "corpus": corpus.source_description,
        "train_bytes": int(len(corpus.train)),
        "val_bytes": int(len(corpus.val)),
        "machine": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": base.threads or torch.get_num_threads(),  # what the runs used
        },
        "config": config,
        "variants": variants,
    }


def _average_over_seeds(entry: dict, runs: list[TrainResult], first_seed: int) -> None:
    """Validation and final training figures as means over seeds; each seed's run kept in
    entry["seed_runs"] (for the seed band of the loss plot)."""
    entry["val_loss"], entry["val_bpb"] = entry["val_loss_mean"], entry["val_bpb_mean"]
    train_losses = [r.final_loss for r in runs]
    entry["final_train_loss"] = sum(train_losses) / len(train_losses)
    entry["final_train_bpb"] = bits_per_byte(entry["final_train_loss"])
    entry["diverged"] = next((r.diverged for r in runs if r.diverged), None)
    entry["seed_runs"] = [
        {"seed": first_seed + i, "val_loss": r.val_loss, "val_bpb": r.val_bpb,
         "final_train_loss": r.final_loss, "steps_completed": r.steps, "diverged": r.diverged,
         "loss_history": r.loss_history, "val_history": r.val_history}
        for i, r in enumerate(runs)]


def _or_none(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x
