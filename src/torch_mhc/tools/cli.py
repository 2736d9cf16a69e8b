"""The `mhc` command (also `python -m torch_mhc`): every parser of the tools is built here.

    mhc train    [--config run.toml] [--connection mhc --steps 2000 ...]
    mhc compare  --out DIR [--preset default|tiny|stress|shakespeare] [--config f.toml] [flags]
    mhc sweep    --out DIR [--preset stability|smoke] [--kinds --depths --lrs --seeds] [--jobs N]
    mhc upcycle  --from RUN_DIR --kinds hc,mhc --steps N --seeds S --out DIR
    mhc generate --checkpoint RUN_DIR [--prompt "def "] [--no-cache]
    mhc export-hf RUN_DIR OUT_DIR [--kind K [--seed S]] [--overwrite]
    mhc cost     ...   (the analytic cost model: torch_mhc.tools.cost)
    mhc bench    ...   (the benchmark suite: torch_mhc.tools.bench.suite)
    mhc bench --gpu ...  (the GPU check: torch_mhc.tools.bench.gpu_check)
    mhc bench --aot ...  (the Triton ahead-of-time compile check of ops/triton/aot.py)
    mhc bench --ops ...  (the per-op benchmark: torch_mhc.tools.bench.ops)

train, compare, sweep, upcycle, generate and export-hf are subparsers, each one
`_add_<name>(subparsers)` function that builds its parser and sets `run`; `SUBCOMMANDS` lists
them. cost and bench (`DELEGATED`) are parsed from their raw arguments, since bench's --gpu,
--aot and --ops switch to another tool's options wherever they stand on the line
(`BENCH_TOOLS`, `run_bench_tool`). The tools' modules only add their options to a parser given
to them (`add_arguments(parser)`) and act on the parsed arguments (`run_command(args)`).

Every error is one line on stderr, `mhc <command>: error: <what was expected and what came>`,
with no traceback, and its own exit status (`EXIT_STATUS`, listed in `mhc train --help`):
0 done, 1 stopped by the spike policy, 2 bad input (a config value, a data path, a bad or
foreign checkpoint, an out_dir in use by another run, a symbolic link where the run writes, a
model too large for memory, a missing extra), 3 out of disk space (quota, file-size limit),
4 an internal error, 130 / 143 interrupted by SIGINT / SIGTERM however late it comes (a
training run writes a checkpoint first). `main` is the one boundary that does this. The
benchmark tools keep argparse's usage line above a bad option's message.

`train`, `compare` and `generate` need the `train` extra (numpy, tqdm; matplotlib for
compare's figures), `export-hf` the `train` and `hf` extras; without them they say which extra
to install. `cost` and `bench` need torch only.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from torch_mhc.tools.errors import UsageError

__all__ = ["BENCH_TOOLS", "DELEGATED", "EXIT_STATUS", "SUBCOMMANDS", "UsageError", "build_parser",
           "main", "run_bench_tool"]

EXIT_STATUS = """exit status:
  0    the run finished
  1    stopped by the spike policy (a NaN/Inf or spiking loss); the last good checkpoint is kept
  2    bad input: configuration, data, a corrupt or foreign checkpoint, out_dir in use by
       another run, a missing extra
  3    no space left on the device (or disk quota exceeded, or a file over the file-size
       limit); a checkpoint written before is left intact
  4    an internal error (a bug): one line naming it; MHC_TRACEBACK=1 shows the traceback
  130  interrupted (Ctrl-C, SIGINT) after writing a checkpoint of the last completed step
  143  terminated (SIGTERM), alike"""
EXIT_INTERNAL = 4

# what each command imports beyond torch, and the extra that installs it
_EXTRA_MODULES = {"train": ("numpy", "tqdm"), "compare": ("numpy", "tqdm", "matplotlib"),
                  "generate": ("numpy", "tqdm")}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `mhc train: error: ...`, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _require_extra(command: str) -> None:
    """UsageError naming the extra to install when a module the command needs is missing."""
    for name in _EXTRA_MODULES.get(command, ()):
        try:
            importlib.import_module(name)
        except ImportError:
            raise UsageError(
                f"{name} is not installed: mhc {command} needs the training extra, "
                "pip install 'torch-mhc[train]'"
            ) from None


# ---------------------------------------------------------------------------------------------
# mhc train
# ---------------------------------------------------------------------------------------------


def _add_train(subparsers) -> None:
    from torch_mhc.lm import config as _config

    p = subparsers.add_parser(
        "train", help="train the reference LM (residual, HC or mHC)",
        description="Train the reference LM. Precedence: defaults < --config file < flags.\n"
        "One run per --out-dir: a second one is refused while the first holds its lock.",
        epilog=EXIT_STATUS, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE.toml", help="TOML file of config keys")
    _config.add_config_flags(p)
    p.set_defaults(run=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from torch_mhc.lm import config as _config

    _require_extra("train")
    from torch_mhc.lm.train import TrainConfig, train

    cfg = _config.build_config(TrainConfig(), args.config, _config.flag_overrides(args))
    _warn_warmup(cfg, "mhc train")
    train(cfg)
    return 0


def _warn_warmup(cfg, prog: str) -> None:
    """One warning line when the warmup never ends: the peak lr is then never reached."""
    if cfg.warmup >= cfg.steps and _rank0():
        print(f"{prog}: warning: warmup ({cfg.warmup}) >= steps ({cfg.steps}): the learning "
              f"rate rises for the whole run and never reaches lr {cfg.lr}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# mhc compare
# ---------------------------------------------------------------------------------------------

_COMPARE_EXCLUDED = {"out_dir", "resume", "overwrite", "connection"}


def _add_compare(subparsers) -> None:
    from torch_mhc.lm import config as _config

    p = subparsers.add_parser(
        "compare", help="train connection kinds alike (residual, HC, mHC, ...) and report",
        description="Train connection kinds (default: the plain residual, HC and mHC) with the "
        "same seed, data order and steps, on one or more seeds; write report.json, report.md "
        "and PNG figures to --out. Precedence: preset < --config file < flags.",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the report")
    p.add_argument("--preset", default="default", choices=_compare_presets(),
                   help="size of the comparison (default: default, about 6 min on 2 cores)")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file of config keys")
    p.add_argument("--kinds", default="residual,hc,mhc", metavar="K1,K2,...",
                   help="connection kinds to train, comma-separated (default: residual,hc,mhc; "
                   "also mhc-lite, kromhc, mhc-static-res)")
    p.add_argument("--seeds", type=int, default=1, metavar="K",
                   help="train every kind on K seeds (seed .. seed+K-1, paired across kinds) "
                   "and report mean +- sd and 95%% intervals of the differences to residual")
    _config.add_config_flags(p, exclude=_COMPARE_EXCLUDED, preset_keys=_preset_keys())
    p.set_defaults(run=_run_compare)


def _compare_presets() -> list[str] | None:
    """The preset names for --preset's choices; None (any name, checked later) when compare
    cannot be imported without the train extra."""
    try:
        from torch_mhc.tools.compare.run import PRESETS
    except ImportError:
        return None
    return sorted(PRESETS)


def _preset_keys() -> set[str]:
    """The config fields some preset sets (their help says "default: from --preset"); without
    the train extra, every field (compare cannot run then anyway)."""
    try:
        from torch_mhc.tools.compare.run import PRESETS
    except ImportError:
        from dataclasses import fields

        from torch_mhc.lm.config import TrainConfig
        from torch_mhc.lm.model import ModelConfig

        return {f.name for cls in (ModelConfig, TrainConfig) for f in fields(cls)} - {"model"}
    return {key for values in PRESETS.values() for key in values}


def _run_compare(args: argparse.Namespace) -> int:
    from torch_mhc.lm import config as _config

    _require_extra("compare")
    from torch_mhc.lm.config import ConfigError
    from torch_mhc.tools.compare.report import summary_table
    from torch_mhc.tools.compare.run import compare, preset_config

    base = preset_config(args.preset)
    if args.config is not None:
        values = _config.load_toml(args.config)
        clash = sorted(_COMPARE_EXCLUDED & (set(values) | set(values.get("model", {}))))
        if clash:
            raise ConfigError(f"config file {args.config}: compare sets {clash} itself")
    cfg = _config.build_config(base, args.config,
                               _config.flag_overrides(args, exclude=_COMPARE_EXCLUDED))
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    _warn_warmup(cfg, "mhc compare")
    report = compare(args.out, preset=args.preset, config=cfg, kinds=kinds, seeds=args.seeds)
    if not cfg.quiet and _rank0():
        print(summary_table(report))
        if args.seeds > 1:
            from torch_mhc.tools.compare.seeds import seeds_table, significance_lines

            print(seeds_table(report["variants"]))
            print("\n".join(significance_lines(report["variants"])))
        print(f"report: {args.out}/report.md ({report['wall_time_s']:.1f} s)")
    return 0


# ---------------------------------------------------------------------------------------------
# mhc sweep
# ---------------------------------------------------------------------------------------------


def _add_sweep(subparsers) -> None:
    from torch_mhc.tools.sweep import command

    p = subparsers.add_parser("sweep", help="find where each connection kind diverges: a grid "
                              "of kind x depth x learning rate", description=command.DESCRIPTION)
    command.add_arguments(p)
    p.set_defaults(run=command.run_command)


# ---------------------------------------------------------------------------------------------
# mhc generate
# ---------------------------------------------------------------------------------------------


def _add_generate(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="sample text from a checkpoint",
        description="Load a checkpoint written by `mhc train` / `mhc compare` and continue a "
        "prompt, decoding with the KV cache unless --no-cache.",
    )
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a checkpoint folder, or a run folder holding one (ckpt/)")
    p.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                   help="tokens (bytes) to generate after the prompt (default: 200)")
    p.add_argument("--temperature", type=float, default=0.8, metavar="X",
                   help="a finite number >= 0; 0 is greedy decoding (default: 0.8)")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample from the K most likely tokens only (default: all of them)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sampling (default: 0)")
    p.add_argument("--device", default="auto",
                   help="auto | cpu | cuda | cuda:N | mps (default: auto)")
    p.add_argument("--no-cache", dest="use_cache", action="store_false",
                   help="recompute the whole context every step instead of using the KV cache")
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    _require_extra("generate")
    import torch

    from torch_mhc.lm.data import decode, encode
    from torch_mhc.lm.train import load_model, resolve_device

    try:
        device = resolve_device(args.device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not args.prompt:
        raise UsageError("--prompt must not be empty: the model needs a token to start from")
    model = load_model(args.checkpoint, device,
                       say=lambda message: print(message, file=sys.stderr, flush=True))
    cfg = model.cfg
    if args.top_k is not None and not 1 <= args.top_k <= cfg.vocab_size:
        raise UsageError(f"--top-k must lie in [1, {cfg.vocab_size}], got {args.top_k}")
    prompt = encode(args.prompt).to(device)[None]  # [1, T0]
    t0 = prompt.shape[1]
    if t0 > cfg.max_seq_len:
        raise UsageError(f"the prompt is {t0} bytes, longer than the model allows "
                         f"(max_seq_len {cfg.max_seq_len})")
    needed = t0 + args.max_new_tokens - 1
    if args.use_cache and needed > cfg.max_seq_len:
        raise UsageError(
            f"prompt ({t0} bytes) + max_new_tokens ({args.max_new_tokens}) - 1 = {needed} "
            f"positions exceed the model's max_seq_len {cfg.max_seq_len}; ask for fewer "
            f"tokens, or pass --no-cache (which slides the context window)"
        )
    generator = torch.Generator(device=device).manual_seed(args.seed)
    start = time.perf_counter()
    out = model.generate(prompt, args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k, use_cache=args.use_cache, generator=generator)
    elapsed = time.perf_counter() - start
    print(decode(out[0]))
    print(f"[{args.max_new_tokens} tokens in {elapsed:.2f} s, "
          f"{args.max_new_tokens / elapsed:,.0f} tokens/s, "
          f"KV cache {'on' if args.use_cache else 'off'}, {cfg.connection}]", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# mhc export-hf
# ---------------------------------------------------------------------------------------------


def _add_export_hf(subparsers) -> None:
    from torch_mhc.tools import export_hf

    p = subparsers.add_parser(
        "export-hf", help="write a run as a Hugging Face folder (remote code, safetensors)",
        description="Write the model of a `mhc train` run, or of one kind of a `mhc compare` "
        "folder, as a folder that transformers loads without torch_mhc: "
        "AutoModelForCausalLM.from_pretrained(OUT_DIR, trust_remote_code=True) and "
        "AutoTokenizer.from_pretrained(OUT_DIR). Its logits are checked against the run's "
        "model before the folder is renamed into place.",
    )
    export_hf.add_arguments(p)
    p.set_defaults(run=export_hf.run_command)


# ---------------------------------------------------------------------------------------------
# mhc upcycle
# ---------------------------------------------------------------------------------------------


def _add_upcycle(subparsers) -> None:
    from torch_mhc.tools.upcycle import command

    p = subparsers.add_parser(
        "upcycle", help="convert a trained residual run to HC / mHC kinds and train on",
        description=command.DESCRIPTION, epilog=EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_arguments(p)
    p.set_defaults(run=_run_upcycle)


def _run_upcycle(args: argparse.Namespace) -> int:
    _require_extra("compare")
    from torch_mhc.tools.upcycle import command

    return command.run_command(args)


# ---------------------------------------------------------------------------------------------
# mhc cost, mhc bench: parsed from the raw arguments (bench's --gpu, --aot and --ops switch to
# another tool's parser, wherever they stand on the line)
# ---------------------------------------------------------------------------------------------


class _RaisingParser(argparse.ArgumentParser):
    """argparse whose usage errors raise UsageError (the caller prints one line)."""

    def error(self, message: str):
        raise UsageError(message)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """The parsed arguments, or the exit status of --help (0) or of a usage error argparse
    printed (2)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0


def _parse_error(parser: argparse.ArgumentParser, message: str) -> int:
    """The parser's own report of a usage error (usage line, then the message): exit status 2."""
    try:
        parser.error(message)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    return 2


def _add_cost(subparsers) -> None:
    subparsers.add_parser("cost", help="analytic cost model (see mhc cost --help)",
                          add_help=False)


def _run_cost(argv: list[str]) -> int:
    from torch_mhc.tools.cost import command

    parser = _RaisingParser(prog="mhc cost", description=command.DESCRIPTION)
    command.add_arguments(parser)
    try:
        args = _parse(parser, argv)
        return args if isinstance(args, int) else command.run_command(args)
    except (UsageError, ValueError) as e:
        return _fail("mhc cost", f"error: {e}", 2)


def _add_bench(subparsers) -> None:
    subparsers.add_parser("bench", help="benchmark suite (see mhc bench --help)",
                          add_help=False)


def _run_bench(argv: list[str]) -> int:
    for switch in BENCH_TOOLS:
        if switch in argv:
            return run_bench_tool(switch, [a for a in argv if a not in BENCH_TOOLS])
    from torch_mhc.tools.bench import suite

    parser = argparse.ArgumentParser(prog="mhc bench", description=suite.DESCRIPTION,
                                     epilog=suite.EPILOG)
    suite.add_arguments(parser)
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args
    try:
        suite.check_arguments(args)
    except (UsageError, ValueError) as e:
        return _fail("mhc bench", f"error: {e}", 2)
    return suite.run_command(args, argv)


def _gpu_check_parser() -> tuple[argparse.ArgumentParser, object]:
    from torch_mhc.tools.bench import gpu_check

    return argparse.ArgumentParser(prog="gpu_check",
                                   description=gpu_check.__doc__.splitlines()[0]), gpu_check


def _aot_parser() -> tuple[argparse.ArgumentParser, object]:
    from torch_mhc.ops.triton import aot

    return argparse.ArgumentParser(prog="mhc bench --aot",
                                   description=aot.__doc__.splitlines()[0]), aot


def _ops_parser() -> tuple[argparse.ArgumentParser, object]:
    from torch_mhc.tools.bench import ops

    return argparse.ArgumentParser(prog="mhc bench --ops",
                                   description=ops.__doc__.splitlines()[0]), ops


# switch of `mhc bench` -> (its parser, the module with add_arguments and run_command)
BENCH_TOOLS: dict[str, Callable[[], tuple[argparse.ArgumentParser, object]]] = {
    "--gpu": _gpu_check_parser, "--aot": _aot_parser, "--ops": _ops_parser}


def run_bench_tool(switch: str, argv: list[str], prog: str = "mhc bench") -> int:
    """`mhc bench <switch> ARGS`: the GPU check (--gpu), the Triton AOT compile check (--aot) or
    the op benchmark (--ops), with their own options. A bad option value is a usage error of
    the tool's parser; what the run itself refuses (the GPU check without a GPU) is one line,
    `<prog>: error: ...`. Returns the exit status."""
    parser, tool = BENCH_TOOLS[switch]()
    tool.add_arguments(parser)
    args = _parse(parser, argv)
    if isinstance(args, int):
        return args
    check = getattr(tool, "check_arguments", None)
    try:
        if check is not None:
            check(args)
    except (UsageError, ValueError) as e:
        return _parse_error(parser, str(e))
    try:
        return tool.run_command(args)
    except UsageError as e:
        return _fail(prog, f"error: {e}", 2)


SUBCOMMANDS: list[Callable] = [_add_train, _add_compare, _add_sweep, _add_generate, _add_export_hf,
                               _add_cost, _add_bench, _add_upcycle]
DELEGATED: dict[str, Callable[[list[str]], int]] = {"cost": _run_cost, "bench": _run_bench}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mhc", description="torch-mhc: residual, HC and mHC side by side.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `mhc`; returns the exit status (see EXIT_STATUS). The one error boundary:
    every failure, BaseException subclasses included, is one line and its status
    (`_report`); a SIGINT / SIGTERM ends with 130 / 143 whenever it comes (`_Signals`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return DELEGATED[argv[0]](argv[1:])
    signals = _Signals()
    prog = f"mhc {argv[0]}" if argv and not argv[0].startswith("-") else "mhc"
    with signals.installed():
        try:
            try:
                status = _dispatch(argv)
            finally:
                signals.mute()  # from here on a signal is recorded, never raised
        except BaseException as e:  # noqa: BLE001 - the one boundary of the command
            status = _report(prog, e, signals.first)
        return signals.final_status(prog, status)


def _dispatch(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed)
        return e.code if isinstance(e.code, int) else 0
    prog = f"mhc {args.command}"
    if unknown:  # the subcommand's help lists its flags, the top level's does not
        return _fail(prog, f"error: unrecognized arguments: {' '.join(unknown)} (see {prog} "
                     "--help)", 2)
    return args.run(args)


class _Signals:
    """SIGINT and SIGTERM for the whole command. Outside the trainer's loop (which installs
    its own handler and stops at a step boundary) the first one raises KeyboardInterrupt, so
    that SIGTERM too unwinds through every cleanup instead of killing the process; later ones,
    and every one after `mute()`, are only recorded. `first` decides the exit status."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.first: int | None = None
        self.raised = self.muted = False

    def handler(self, signum: int, frame) -> None:
        self.first = self.first or signum
        if not (self.raised or self.muted):
            self.raised = True
            raise KeyboardInterrupt(f"interrupted by {signal.Signals(signum).name}")

    def mute(self) -> None:
        self.muted = True

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # handlers can only be set from the main thread
            return
        previous = {s: signal.getsignal(s) for s in self.SIGNALS}
        for s in self.SIGNALS:
            signal.signal(s, self.handler)
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def final_status(self, prog: str, status: int) -> int:
        """A signal that came after the command's status was decided still decides it."""
        if self.first is None or status in (128 + s for s in self.SIGNALS):
            return status
        if status == 0:
            _fail(prog, f"interrupted by {signal.Signals(self.first).name} after the command "
                  "finished", 0)
        return 128 + self.first


def _report(prog: str, e: BaseException, first_signal: int | None) -> int:
    """One line and the exit status of any failure."""
    if isinstance(e, SystemExit):
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    interrupt = _wrapped(e, KeyboardInterrupt)
    if interrupt is not None:  # RunInterrupted says what was saved and which signal it was
        signum = getattr(interrupt, "signum", None) or first_signal or signal.SIGINT
        return _fail(prog, _one_line(interrupt) or "interrupted", 128 + signum)
    if isinstance(e, UsageError):
        return _fail(prog, f"error: {_one_line(e)}", 2)
    return _known_error(prog, e)


def _wrapped(e: BaseException, kind: type) -> BaseException | None:
    """`e` or an error it wraps (a cause, a context, one of DCP's per-rank failures) that
    is a `kind`, else None."""
    seen, stack = set(), [e]
    while stack:
        x = stack.pop()
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, kind):
            return x
        failures = getattr(x, "failures", None)  # DCP's CheckpointException
        if isinstance(failures, dict):
            stack.extend(v[0] if isinstance(v, tuple) and v else v for v in failures.values())
        stack.extend([x.__cause__, x.__context__])
    return None


def _known_error(prog: str, e: BaseException) -> int:
    """One line and the exit status of an error the commands raise for the user, of the
    system (a refused write, memory, permissions) or of a bug (EXIT_INTERNAL)."""
    from torch_mhc.lm.train.errors import (
        EXIT_BAD_INPUT,
        EXIT_NO_SPACE,
        EXIT_STOPPED,
        CheckpointError,
        ConfigError,
        DiskFullError,
        TrainingDiverged,
        storage_errno,
        storage_problem,
    )

    if isinstance(e, ConfigError):  # every rank has the same config: one rank says it
        return _fail(prog, f"error: {_one_line(e)}", EXIT_BAD_INPUT, quiet=not _rank0())
    if isinstance(e, CheckpointError):
        return _fail(prog, f"error: {_one_line(e)}", EXIT_BAD_INPUT)
    if isinstance(e, TrainingDiverged):
        return _fail(prog, _one_line(e), EXIT_STOPPED)
    if isinstance(e, DiskFullError):
        return _fail(prog, f"error: {_one_line(e)}", EXIT_NO_SPACE)
    code = storage_errno(e)
    if code is not None:
        where = getattr(_wrapped(e, OSError), "filename", None)
        return _fail(prog, f"error: {storage_problem(code)}" + (f" writing {where}" if where
                                                                  else ""), EXIT_NO_SPACE)
    if _is_out_of_memory(e):
        return _fail(prog, f"error: out of memory: {_first_line(e)} (a smaller model, batch or "
                     "seq_len fits)", EXIT_BAD_INPUT)
    os_error = _wrapped(e, OSError)
    if os_error is not None:  # permissions, a vanished folder, a link refused
        name = errno.errorcode.get(os_error.errno or 0, "no errno")
        where = f": {os_error.filename}" if os_error.filename is not None else ""
        text = os_error.strerror or _first_line(os_error)
        return _fail(prog, f"error: {text} ({name}){where}", EXIT_BAD_INPUT)
    if os.environ.get("MHC_TRACEBACK"):
        raise e
    return _fail(prog, f"error: internal error, {type(e).__name__}: {_first_line(e)} (a bug; "
                 "MHC_TRACEBACK=1 shows the traceback)", EXIT_INTERNAL)


def _is_out_of_memory(e: BaseException) -> bool:
    if _wrapped(e, MemoryError) is not None or type(e).__name__ == "OutOfMemoryError":
        return True
    text = str(e)
    return any(k in text for k in ("can't allocate memory", "out of memory",
                                   "Cannot allocate memory"))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def _fail(prog: str, message: str, status: int, quiet: bool = False) -> int:
    if not quiet:
        print(f"{prog}: {message}", file=sys.stderr)
    return status


def _rank0() -> bool:
    """False on the ranks > 0 of a torchrun launch (RANK, set before any process group)."""
    try:
        return int(os.environ.get("RANK", "0")) == 0
    except ValueError:
        return True


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


if __name__ == "__main__":  # python -m torch_mhc.tools.cli, as `mhc`
    sys.exit(main())
