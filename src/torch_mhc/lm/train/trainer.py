"""The run: `train(cfg)` builds a Trainer and runs it, top to bottom.

    result = train(TrainConfig(model=ModelConfig(connection="mhc"), steps=500, out_dir="runs/a"))

What one run does, in order (`Trainer.run`):
1. validate the configuration (before anything is written), start the process group under
   torchrun, load the corpus and check it holds a batch;
2. lock out_dir (one run per folder, `RunLock`), refuse a fresh run over a checkpoint, remove
   temporary files of dead runs;
3. with resume, open the checkpoint and check it fits this configuration before any tensor is
   read (`open_for_resume`);
4. build the model (wrapped for DDP / FSDP2 / a pipeline / torch.compile), the optimizer, the
   schedule, the spike policy and the sampler; restore their state from the checkpoint;
5. the loop: one `train_step` per step; metrics every log_every steps, the validation loss
   every eval_every, Amax gains every gain_every, a checkpoint every checkpoint_every steps
   and at the end. Ctrl-C (SIGINT) or SIGTERM ends the loop at the next step boundary with a
   checkpoint (`RunInterrupted`); the spike policy ends it with `TrainingDiverged`, leaving
   the last good checkpoint as it was.
"""

from __future__ import annotations

import contextlib
import math
import shlex
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from torch_mhc.lm import data as _data
from torch_mhc.lm import parallel as par
from torch_mhc.lm.config import ConfigError, TrainConfig, resolve_device, resolve_dtype
from torch_mhc.lm.train import checkpoint as ckpt
from torch_mhc.lm.train.errors import RunInterrupted, RunLockedError, TrainingDiverged
from torch_mhc.lm.train.lock import RunLock
from torch_mhc.lm.train.metrics import MetricsLog, PeakMemory, Printer, progress_bar
from torch_mhc.lm.train.schedule import LRSchedule, SpikeGuard
from torch_mhc.lm.train.steps import (
    StepContext,
    StepRejected,
    build_model,
    build_optimizer,
    evaluate,
    evaluate_pipeline,
    measure_gains,
    rng_state,
    seed_everything,
    set_rng_state,
    train_step,
    wrap_model,
)
from torch_mhc.runtime.files import SymlinkRefused, refuse_symlink, remove_stale_temp_files

__all__ = ["TrainResult", "Trainer", "load_training_corpus", "train"]

_HISTORIES = ("loss_history", "grad_norm_history", "lr_history", "val_history", "gain_history")
# every name the run writes, renames or removes in out_dir: none may be a symbolic link
_RUN_FILES = (*ckpt.CANDIDATES, "ckpt.partial", "ckpt.deleting", "ckpt.old.deleting",
              "ckpt.prev.deleting", "metrics.jsonl", "tb")


@dataclass
class TrainResult:
    """What a run measured. Losses in nats per byte; times in seconds."""

    config: dict
    steps: int  # optimizer steps completed
    final_loss: float  # mean training loss over the last min(20, steps) steps
    val_loss: float
    val_bpb: float
    tokens_per_s: float  # tokens / time of the training steps (no eval, gains, checkpoints)
    step_time_median_s: float  # robust to other processes' interference, unlike the mean
    peak_mem_bytes: int
    peak_mem_kind: str
    params: int
    connection_params: int
    amp_dtype: str  # "fp32" or "bf16"
    device: str
    elapsed_s: float
    loss_history: list[float] = field(default_factory=list)  # one per step, step 1 first
    grad_norm_history: list[float] = field(default_factory=list)
    lr_history: list[float] = field(default_factory=list)
    val_history: list[dict] = field(default_factory=list)  # {"step", "val_loss", "val_bpb"}
    gain_history: list[dict] = field(default_factory=list)  # {"step", **GainReport.to_dict()}
    diverged: str | None = None  # the spike policy's message, if it stopped the run
    checkpoint: str | None = None  # the last checkpoint written

    @property
    def final_gains(self) -> dict | None:
        return self.gain_history[-1] if self.gain_history else None

    @property
    def max_composite_gain_fwd(self) -> float:
        """Worst token, worst depth, worst measurement over the run (nan for the residual)."""
        return max((g["max_composite_fwd"] for g in self.gain_history), default=math.nan)

    @property
    def max_composite_gain_bwd(self) -> float:
        return max((g["max_composite_bwd"] for g in self.gain_history), default=math.nan)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["max_composite_gain_fwd"] = self.max_composite_gain_fwd
        d["max_composite_gain_bwd"] = self.max_composite_gain_bwd
        return d


def load_training_corpus(cfg: TrainConfig) -> _data.Corpus:
    """The corpus, checked to hold a training batch and a validation batch."""
    try:
        corpus = _data.load_corpus(cfg.data, cache_dir=cfg.cache_dir,
                                   val_fraction=cfg.val_fraction, max_bytes=cfg.max_bytes)
    except (OSError, ValueError, ImportError) as e:  # missing, empty, not text, no `datasets`
        raise ConfigError(str(e)) from None
    where = cfg.data if cfg.data is not None else "the standard library corpus"
    need = cfg.seq_len + 1
    if len(corpus.train) < need:
        raise ConfigError(
            f"corpus shorter than one batch: {where} has {len(corpus.train)} training bytes, a "
            f"sequence needs seq_len + 1 = {need} (use a bigger corpus or a smaller seq_len)"
        )
    if len(corpus.val) < need:
        raise ConfigError(
            f"validation split too short: {where} has {len(corpus.val)} validation bytes "
            f"(val_fraction {cfg.val_fraction}), a sequence needs seq_len + 1 = {need}"
        )
    return corpus


def train(cfg: TrainConfig, corpus: _data.Corpus | None = None,
          on_start: Callable[[], object] | None = None) -> TrainResult:
    """Run the training `cfg` describes; see the module docstring.

    corpus: an already loaded corpus (compare passes one to three runs); by default the one
    cfg.data names. on_start: called once the run is set to start, after its out_dir, lock
    and checkpoint have passed their checks, before the first line about the run (`mhc train`
    says its warnings there, so that a run refused says only why). Raises ConfigError /
    CheckpointError / RunLockedError for bad input before anything is written,
    TrainingDiverged (with .result) when the spike policy stops the run, RunInterrupted after
    Ctrl-C, DiskFullError when the disk fills up.
    """
    t_start = time.perf_counter()
    cfg.validate()
    if cfg.parallel == "none":
        return Trainer(cfg, corpus, None, t_start, on_start).run()
    # "cuda" / "auto": cuda:LOCAL_RANK when there is a GPU; "cpu": gloo on the CPU
    info = par.init_distributed(device="cpu" if cfg.device == "cpu" else None)
    try:
        result = Trainer(cfg, corpus, info, t_start, on_start).run()
    except (TrainingDiverged, RunInterrupted, RunLockedError):  # alike on every rank
        par.destroy_distributed()
        raise
    # also avoids torch 2.13's abort at exit after DCP saves (see destroy_distributed)
    par.destroy_distributed()
    return result


@contextlib.contextmanager
def torch_threads(threads: int):
    """torch's CPU threads set to `threads` (0: as they are) for the run, then restored: a
    library call leaves the process's thread count as it found it."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


class Trainer:
    """One run of `cfg` on this process (info: its rank in a distributed run, else None)."""

    def __init__(self, cfg: TrainConfig, corpus: _data.Corpus | None,
                 info: par.DistInfo | None, t_start: float,
                 on_start: Callable[[], object] | None = None):
        self.cfg, self.corpus, self.info, self.t_start = cfg, corpus, info, t_start
        self.on_start = on_start
        self.device = resolve_device(cfg.device) if info is None else info.device
        self.amp_dtype = resolve_dtype(cfg.dtype, self.device)
        self.printer = Printer(cfg)
        self.pipe: par.Pipeline | None = None
        self.step_times: list[float] = []
        self.interrupt = _InterruptFlag()
        self.saved_step: int | None = None  # the step of the checkpoint on disk
        self.verified: Path | None = None  # the checkpoint last loaded or saved

    # --- the run, in order ---------------------------------------------------------------

    def run(self) -> TrainResult:
        if self.corpus is None:
            self.corpus = self._load_corpus()
        with self._out_dir_locked():
            self._prepare_out_dir()
            resume_path, resume_state = self._open_resume()
            with torch_threads(self.cfg.threads):
                self._train(resume_path, resume_state)
        self._say_done()
        return self.result

    def _train(self, resume_path: Path | None, resume_state: dict | None) -> None:
        self.memory = PeakMemory(self.device)  # from here: model, optimizer, activations
        self._build()
        start = self._restore(resume_path, resume_state)
        self.metrics = MetricsLog(self.cfg, start)
        if self.on_start is not None:
            self.on_start()
        self._announce(start, resume_path)
        self.bar = progress_bar(self.cfg, start)
        self.printer.bar = self.bar
        try:
            with self.interrupt.installed():
                self._loop(start)
                # a signal during the last step or the final save still ends the run as
                # interrupted (its checkpoint is already written)
                if self.interrupt.requested(self.info):
                    raise self._interrupted()
        finally:
            self.bar.close()
            self.printer.bar = None
            self.metrics.close()
            self._finish()

    def _load_corpus(self) -> _data.Corpus:
        """Rank 0 builds the token cache; the others read it once it is complete."""
        corpus = load_training_corpus(self.cfg) if par.is_rank0() else None
        par.barrier()
        return corpus if corpus is not None else load_training_corpus(self.cfg)

    @contextlib.contextmanager
    def _out_dir_locked(self):
        """Rank 0 holds out_dir's lock for the whole run; every rank learns if it failed."""
        lock = RunLock(self.cfg.out_dir) if self.cfg.out_dir and par.is_rank0() else None
        error = None  # (kind, message)
        if lock is not None and self.cfg.resume is True and not Path(self.cfg.out_dir).exists():
            # refused before the lock makes the folder, which a refused run would leave behind
            error = ("checkpoint", f"no checkpoint to resume from: {self.cfg.out_dir} does not "
                                   "exist")
        elif lock is not None:
            try:
                lock.acquire()
            except RunLockedError as e:
                error = ("lock", str(e))
        if self.info is not None:
            shared = [error]
            torch.distributed.broadcast_object_list(shared, src=0)
            error = shared[0]
        if error is not None:
            raise (ckpt.CheckpointError if error[0] == "checkpoint" else RunLockedError)(error[1])
        if lock is not None and lock.stale_pid:
            self.printer(f"note: {lock.path} was left by process {lock.stale_pid}, which is "
                         "no longer running; taking it over")
        try:
            yield
        finally:
            if lock is not None:
                lock.release()

    def _prepare_out_dir(self) -> None:
        """Refuse a fresh run over a checkpoint (unless overwrite); remove dead runs' temp
        files (safe: we hold the lock)."""
        cfg = self.cfg
        if cfg.out_dir is None:
            return
        out = Path(cfg.out_dir)
        try:
            for name in _RUN_FILES:
                refuse_symlink(out / name, "the run writes there")
        except SymlinkRefused as e:
            raise ConfigError(e.strerror) from None
        if not cfg.overwrite and not self._resumes_own_run():
            for name in (*ckpt.CANDIDATES, *ckpt.OLD_CHECKPOINTS):
                if not (out / name).exists():
                    continue
                if cfg.resume is False:
                    raise ConfigError(
                        f"{out / name} exists: pass resume (--resume) to continue that run, or "
                        "overwrite (--overwrite) to start a new one in its place, or choose "
                        "another out_dir")
                raise ConfigError(
                    f"{out / name} exists: resuming {cfg.resume} into {out} would replace the "
                    f"run there (its checkpoints and metrics); choose another out_dir, pass "
                    f"overwrite (--overwrite) to replace it, or resume (--resume) without a "
                    f"path to continue the run in {out}")
        if par.is_rank0():
            stale = remove_stale_temp_files(out)
            partial = par.remove_unfinished_save(out / ckpt.LAST_CHECKPOINT,
                                                 out / ckpt.PREVIOUS_CHECKPOINT)
            for p in stale + ([partial] if partial else []):
                self.printer(f"removed {p.name}, left by an earlier run that stopped mid-write")
        par.barrier()

    def _resumes_own_run(self) -> bool:
        """Whether this launch continues the run in out_dir: resume = True, or the path of
        out_dir's own checkpoint (a path that names no checkpoint is left to the resume's
        own error)."""
        resume = self.cfg.resume
        if not isinstance(resume, str):
            return resume is True
        try:
            path = ckpt.find_checkpoint(resume)
        except ckpt.CheckpointError:
            return True
        return path.resolve().parent == Path(self.cfg.out_dir).resolve()

    def _open_resume(self) -> tuple[Path | None, dict | None]:
        if self.cfg.resume is False:
            return None, None

        return ckpt.open_for_resume(self.cfg, say=_warn)

    def _build(self) -> None:
        """Model (wrapped for the layout), optimizer, schedule, spike policy, sampler, result."""
        cfg, info = self.cfg, self.info
        seed_everything(cfg.seed)
        self.model = model = _build_model(cfg, self.device)
        model.train()
        n_params, n_conn_params = model.num_params(), model.connection_params()
        if cfg.parallel == "ddp":
            step_model = par.wrap_ddp(model, info)
        elif cfg.parallel == "fsdp":
            step_model = self.model = par.apply_fsdp(model, info)
        elif cfg.parallel == "pp":
            self.pipe = par.build_pipeline(cfg.model, model, info, cfg.pp_schedule,
                                           n_microbatches=cfg.micro_batches)
            step_model = self.model = self.pipe.module  # this rank's stages, the LM's names
        else:
            step_model = wrap_model(model, cfg)
        # what a checkpoint saves: the bare model in one process, the step's module otherwise
        self.saved_model = self.model if info is None else step_model
        self.optimizer = build_optimizer(self.saved_model, cfg)
        self.schedule = LRSchedule(cfg)
        self.ctx = StepContext(step_model, self.optimizer, SpikeGuard(cfg.spike_factor,
                               cfg.spike_window), self.device, self.amp_dtype, cfg.grad_clip,
                               info=info, pipe=self.pipe)
        try:
            self.sampler = _data.BatchSampler(self.corpus.train, cfg.batch_size, cfg.seq_len,
                                              cfg.seed, device=self.device)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # the fixed batch the gains are measured on: the first validation windows
        self.gain_x, _ = next(_data.val_batches(self.corpus.val, cfg.gain_batch_size,
                                                cfg.seq_len, 1, device=self.device))
        self.result = TrainResult(
            config=cfg.to_dict(), steps=0, final_loss=math.nan, val_loss=math.nan,
            val_bpb=math.nan, tokens_per_s=math.nan, step_time_median_s=math.nan,
            peak_mem_bytes=0, peak_mem_kind="", params=n_params, connection_params=n_conn_params,
            amp_dtype="bf16" if self.amp_dtype is not None else "fp32", device=str(self.device),
            elapsed_s=0.0,
        )

    def _restore(self, path: Path | None, state: dict | None) -> int:
        """Load the checkpoint's tensors and the run's state; return the step to start at. A
        checkpoint whose tensors or state do not load falls back to the next older one."""
        if path is None:
            return 0
        failed: list[tuple[Path, str]] = []
        while True:
            try:
                self._restore_from(path, state)
                break
            except ckpt.CheckpointError as e:
                failed.append((path, str(e)))
                path, state = ckpt.open_for_resume(self.cfg, say=_warn, failed=tuple(failed))
        self.result.steps = self.saved_step = int(state["step"])
        self.result.checkpoint = str(path)
        self.verified = path
        return self.result.steps

    def _restore_from(self, path: Path, state: dict) -> None:
        ckpt.restore(path, self.saved_model, self.optimizer)
        try:
            self.sampler.load_state_dict(state["sampler"])
            self.ctx.guard.load_state_dict(state["spike"])
            set_rng_state(state["rng"])
            histories = {key: list(state["history"].get(key, [])) for key in _HISTORIES}
            last_val = histories["val_history"][-1] if histories["val_history"] else None
            if last_val is not None:
                val_loss, val_bpb = float(last_val["val_loss"]), float(last_val["val_bpb"])
        except _data.BatchShapeChanged as e:  # the launch's settings, not a damaged checkpoint
            raise ConfigError(
                f"{path} was trained on {e.describe()}: a resumed run keeps its batch size, "
                "sequence length and data (they fix the order of its batches); resume with "
                "the run's own, or start a new run") from None
        except (ValueError, KeyError, TypeError, RuntimeError, AttributeError,
                IndexError) as e:
            raise ckpt.CheckpointError(f"checkpoint {path} does not fit this run: {e}") from None
        for key, values in histories.items():
            setattr(self.result, key, values)
        if last_val is not None:
            self.result.val_loss, self.result.val_bpb = val_loss, val_bpb

    def _announce(self, start: int, resume_path: Path | None) -> None:
        cfg, r, info = self.cfg, self.result, self.info
        layout = "" if info is None else (
            f", parallel {cfg.parallel} on {info.world_size} processes"
            + (f" ({cfg.pp_schedule}, {cfg.micro_batches} micro-batches)" if self.pipe else ""))
        self.printer(
            f"training {cfg.model.connection} (n={cfg.model.n_streams}): {r.params:,} parameters "
            f"({r.connection_params:,} in connections), {cfg.steps} steps of "
            f"{cfg.batch_size}x{cfg.seq_len} tokens, {r.amp_dtype} on {self.device}{layout}; "
            f"data: {self.corpus.source_description}"
            + (f"; resuming {resume_path} at step {start}" if start else "")
            + ("; no out_dir (--out-dir): nothing is saved" if cfg.out_dir is None else "")
        )
        if self.metrics.dropped:
            self.printer(f"metrics.jsonl: dropped {self.metrics.dropped} line(s) written after "
                         f"step {start} or torn by the run that stopped")
        if self.pipe is not None and cfg.model.connection != "residual":
            self.printer("gains are not measured under parallel = 'pp' (no stage sees every "
                         "block)")

    # --- the loop --------------------------------------------------------------------------

    def _loop(self, start: int) -> None:
        cfg = self.cfg
        if start == 0:
            self._record_gains(0)  # at initialisation every HC / mHC is the residual network
        self.window = [0, 0.0]  # tokens and seconds since the last metrics line
        for step in range(start, cfg.steps):  # step = updates done before this one
            if self.interrupt.requested(self.info):
                raise self._interrupted()
            done = step + 1
            lr = self.schedule(step)
            t0 = time.perf_counter()
            x, y = self.sampler.next()  # [B, T] each
            try:
                loss, norm = train_step(self.ctx, x, y, lr, done)
            except StepRejected as stop:
                raise self._diverged(stop) from None
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._after_step(done, loss, norm, lr, x.numel(), time.perf_counter() - t0)

    def _after_step(self, done: int, loss: float, norm: float, lr: float, tokens: int,
                    dt: float) -> None:
        cfg, r = self.cfg, self.result
        self.step_times.append(dt)
        r.loss_history.append(loss)
        r.grad_norm_history.append(norm)
        r.lr_history.append(lr)
        r.steps = done
        self.window[0] += tokens
        self.window[1] += dt
        self.bar.update(1)
        last = done == cfg.steps
        if done % cfg.log_every == 0 or last:
            self._log_train(done, loss, norm, lr)
        if last or (cfg.eval_every and done % cfg.eval_every == 0):
            self._record_eval(done)
        if last or (cfg.gain_every and done % cfg.gain_every == 0):
            self._record_gains(done)
        if last or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
            self._checkpoint(done)

    def _log_train(self, done: int, loss: float, norm: float, lr: float) -> None:
        tok_s = self.window[0] / self.window[1]
        self.metrics.write({"kind": "train", "step": done, "loss": loss, "lr": lr,
                            "grad_norm": norm, "tokens_per_s": tok_s,
                            "elapsed": time.perf_counter() - self.t_start})
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
        if self.bar.disable:
            self.printer(f"step {done}/{self.cfg.steps}: loss {loss:.4f}, lr {lr:.2e}, "
                         f"grad norm {norm:.3f}, {tok_s:,.0f} tokens/s")
        self.window = [0, 0.0]

    def _record_eval(self, step: int) -> None:
        if self.pipe is not None:
            val = evaluate_pipeline(self.pipe, self.corpus.val, self.cfg, self.device)
        else:  # every rank runs the same forwards (FSDP2 gathers parameters collectively)
            val = evaluate(self.ctx.model, self.corpus.val, self.cfg, self.device,
                           self.amp_dtype)
        entry = {"step": step, "val_loss": val, "val_bpb": _data.bits_per_byte(val)}
        self.result.val_history.append(entry)
        self.result.val_loss, self.result.val_bpb = entry["val_loss"], entry["val_bpb"]
        self.metrics.write({"kind": "eval", **entry})
        self.printer(f"step {step}: val loss {val:.4f} nats, {entry['val_bpb']:.4f} bits/byte")

    def _record_gains(self, step: int) -> None:
        if self.pipe is not None:
            return
        report = measure_gains(self.model, self.gain_x, self.device, self.amp_dtype)
        if report is None:
            return
        self.result.gain_history.append({"step": step, **report.to_dict()})
        self.metrics.write({"kind": "gain", "step": step,
                            "max_composite_fwd": report.max_composite_fwd,
                            "max_composite_bwd": report.max_composite_bwd,
                            "composite_fwd": report.composite_fwd,
                            "composite_bwd": report.composite_bwd,
                            **report.flat()})  # connection health, one float per name

    def _checkpoint(self, step: int) -> None:
        """Every rank writes its pieces (a single process all of them); rank 0 the state."""
        if self.cfg.out_dir is None:
            return
        state = {
            "format": ckpt.CHECKPOINT_FORMAT,
            "model_config": self.cfg.model.to_dict(),
            "train_config": self.cfg.to_dict(),
            "scheduler": {"step": step, **self.schedule.state_dict()},
            "step": step,
            "rng": rng_state(),
            "sampler": self.sampler.state_dict(),
            "spike": self.ctx.guard.state_dict(),
            "history": {key: getattr(self.result, key) for key in _HISTORIES},
        }
        # a fresh run's first save replaces what an overwritten run left, ckpt.prev included
        own = self.saved_step is not None
        path = ckpt.save_checkpoint(self.cfg.out_dir, self.saved_model, self.optimizer, state,
                                    keep_previous=own, verified=self.verified, say=_warn)
        self.result.checkpoint = str(path)
        self.saved_step, self.verified = step, path

    # --- endings ---------------------------------------------------------------------------

    def _diverged(self, stop: StepRejected) -> TrainingDiverged:
        r = self.result
        kept = (f"the last good checkpoint {r.checkpoint} was left untouched"
                if r.checkpoint else "no checkpoint had been written")
        message = f"training stopped: {stop.reason}; {kept}"
        r.diverged = message
        self.metrics.write({"kind": "stopped", "step": stop.step, "reason": stop.reason})
        # not printed here: the caller says it once (`mhc train`'s error line; compare and
        # upcycle, which take a stopped run as a finding, print it as theirs; sweep's table)
        return TrainingDiverged(message, stop.step, r)

    def _interrupted(self) -> RunInterrupted:
        """At a step boundary after Ctrl-C / SIGTERM: checkpoint the last completed step."""
        r = self.result
        if self.cfg.out_dir is not None and r.steps > 0 and self.saved_step != r.steps:
            self._checkpoint(r.steps)
        if r.checkpoint:
            resume = (["--resume", str(r.checkpoint)] if self.cfg.out_dir is None
                      else ["--out-dir", str(self.cfg.out_dir), "--resume"])
            saved = (f"checkpoint {r.checkpoint}, which `{shlex.join(['mhc', 'train', *resume])}`"
                     " continues")
        else:
            saved = ("nothing saved (no out_dir, --out-dir)" if self.cfg.out_dir is None
                     else "no checkpoint")
        message = f"interrupted after step {r.steps}; {saved}"
        self.metrics.write({"kind": "stopped", "step": r.steps, "reason": "interrupted"})
        return RunInterrupted(message, r.steps, r.checkpoint, r,
                              signum=self.interrupt.signum or signal.SIGINT)

    def _finish(self) -> None:
        """Fill in the summary numbers of the result (also for a stopped run)."""
        r, cfg = self.result, self.cfg
        tail = r.loss_history[-min(20, len(r.loss_history)):]
        r.final_loss = sum(tail) / len(tail) if tail else math.nan
        if self.step_times:
            r.tokens_per_s = (len(self.step_times) * cfg.batch_size * cfg.seq_len
                              / sum(self.step_times))
            r.step_time_median_s = float(statistics.median(self.step_times))
        r.peak_mem_bytes = self.memory.peak()
        r.peak_mem_kind = self.memory.kind
        r.elapsed_s = time.perf_counter() - self.t_start

    def _say_done(self) -> None:
        r = self.result
        speed = (f"{r.tokens_per_s:,.0f} tokens/s" if math.isfinite(r.tokens_per_s)
                 else "no step in this launch")  # a finished run resumed
        self.printer(
            f"done: {r.steps} steps, final loss {r.final_loss:.4f} ({_last_steps(r)}), val "
            f"{r.val_loss:.4f} nats = {r.val_bpb:.4f} bits/byte, {speed}"
            + (f", checkpoint {r.checkpoint}" if r.checkpoint else "")
        )


def _last_steps(r) -> str:
    """What the done line's final loss is: the mean of the last steps' losses (up to 20)."""
    k = min(20, len(r.loss_history))
    return "the last step's" if k == 1 else f"mean of the last {k} steps"


def _warn(message: str) -> None:
    """Shown even with quiet (the run changed course), by rank 0."""
    if par.is_rank0():
        print(message, file=sys.stderr, flush=True)


def _build_model(cfg: TrainConfig, device: torch.device):
    """build_model, with a model that does not fit in memory as one ConfigError."""
    try:
        return build_model(cfg, device)
    except (MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        m = cfg.model
        raise ConfigError(
            f"model too large for memory: dim {m.dim}, n_layers {m.n_layers}, n_streams "
            f"{m.n_streams}, vocab {m.vocab_size} on {device} ({_first_line(e)})") from None


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation the memory (CPU or GPU) could not serve."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(k in text for k in (
        "can't allocate memory", "out of memory", "Cannot allocate memory",
        "not enough memory"))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


class _InterruptFlag:
    """SIGINT / SIGTERM set a flag that the loop reads at each step boundary (so no step is
    cut in half); a second Ctrl-C interrupts at once. In a distributed run the ranks agree
    (an all-reduce of the flag) so that they all stop at the same step."""

    def __init__(self):
        self.flag = False
        self.signum: int | None = None  # the first signal received

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread
            return
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def handler(signum, frame):
            if self.flag and signum == signal.SIGINT:
                raise KeyboardInterrupt  # the second Ctrl-C: stop now
            self.flag = True
            self.signum = self.signum or signum

        for s in previous:
            signal.signal(s, handler)
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def requested(self, info: par.DistInfo | None) -> bool:
        if info is None:
            return self.flag
        t = torch.tensor([1.0 if self.flag else 0.0])
        if torch.distributed.get_backend() == "nccl":
            t = t.to(info.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item() > 0)
