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
(bench/command.py). The tools' modules only add their options to a parser given to them
(`add_arguments(parser)`) and act on the parsed arguments (`run_command(args)`).

Every error is one line on stderr, `mhc <command>: error: <what was expected and what came>`,
with no traceback, and its own exit status (`EXIT_STATUS`, listed in `mhc train --help`):
0 done, 1 stopped by the spike policy, 2 bad input (a config value, a data path, a bad or
foreign checkpoint, an out_dir in use by another run, a symbolic link where the run writes, a
model too large for memory, a missing extra), 3 out of disk space (quota, file-size limit),
4 an internal error, 130 / 143 interrupted by SIGINT / SIGTERM however late it comes (a
training run writes a checkpoint first). `main` runs every command inside the one boundary
that does this (boundary.py). The benchmark tools keep argparse's usage line above a bad
option's message.

`train`, `compare` and `generate` need the `train` extra (numpy, tqdm; matplotlib for
compare's figures), `export-hf` the `train` and `hf` extras; without them they say which extra
to install. `cost` and `bench` need torch only.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import time
from collections.abc import Callable

from torch_mhc.tools import boundary
from torch_mhc.tools.bench.command import BENCH_TOOLS, run_bench, run_bench_tool
from torch_mhc.tools.boundary import (
    EXIT_STATUS,
    OneLineParser,
    RaisingParser,
    fail,
    parse,
    rank0,
    unrecognized,
    warn_warmup,
)
from torch_mhc.tools.errors import UsageError

__all__ = ["BENCH_TOOLS", "DELEGATED", "EXIT_STATUS", "SUBCOMMANDS", "UsageError", "build_parser",
           "main", "run_bench_tool"]

# what each command imports beyond torch, and the extra that installs it
_EXTRA_MODULES = {"train": ("numpy", "tqdm"), "compare": ("numpy", "tqdm", "matplotlib"),
                  "upcycle": ("numpy", "tqdm", "matplotlib"), "generate": ("numpy", "tqdm")}


def _require_extra(command: str) -> None:
    """UsageError naming the extra to install when a module the command needs is missing."""
    for name in _EXTRA_MODULES.get(command, ()):
        try:
            importlib.import_module(name)
        except ImportError:
            raise UsageError(
                f"{name} is not installed: mhc {command} needs the training extra, "
                "pip install -e '.[train]' in the torch-mhc checkout"
            ) from None


# ---------------------------------------------------------------------------------------------
# mhc train
# ---------------------------------------------------------------------------------------------


def _add_train(subparsers) -> None:
    from torch_mhc.lm import config as _config

    p = subparsers.add_parser(
        "train", help="train the reference LM (residual, HC, mHC or its successors)",
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
    from torch_mhc.tools.out_dirs import check_out_dir

    flags = _config.flag_overrides(args)
    base = TrainConfig()
    # resuming: the run's own settings, with the config file and the flags given now over
    # them (validated once, merged: defaults may not suit this launch where the run's do)
    wanted = _config.build_config(base, args.config, flags, validate=False)
    if (wanted.resume is True and wanted.out_dir) or isinstance(wanted.resume, str):
        base = _saved_settings(wanted) or base
    cfg = _config.build_config(base, args.config, flags)
    if cfg.out_dir:
        check_out_dir(cfg.out_dir, "mhc train", "--out-dir")
    train(cfg, on_start=lambda: warn_warmup(cfg, "mhc train"))
    return 0


# What a resumed run takes from the launch, not from the run it resumes: where it writes, how
# it resumes, and the machine and process layout it runs on.
_LAUNCH_SETTINGS = ("out_dir", "resume", "overwrite", "device", "threads", "compile", "parallel",
                    "pp_schedule", "micro_batches", "progress", "tensorboard", "quiet")


def _saved_settings(cfg):
    """The TrainConfig the run to resume was started with, but _LAUNCH_SETTINGS; None where no
    checkpoint reads (open_for_resume then says why) or its settings do not read in this
    version (said on stderr: the defaults stand, and the resume checks the model fits)."""
    from torch_mhc.lm.train import ConfigError, TrainConfig
    from torch_mhc.lm.train.checkpoint import saved_train_config

    saved = saved_train_config(cfg)
    if saved is None:
        return None
    try:
        return TrainConfig.from_dict({k: v for k, v in saved.items()
                                      if k not in _LAUNCH_SETTINGS})
    except (ConfigError, TypeError, ValueError) as e:
        if rank0():
            print(f"mhc train: warning: the run's saved settings do not read here ({e}): "
                  "resuming with the defaults and the flags given", file=sys.stderr)
        return None


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
    p.add_argument("--out", "--out-dir", dest="out", required=True, metavar="DIR",
                   help="folder for the report")
    p.add_argument("--preset", default="default", choices=_compare_presets(),
                   help="size of the comparison (default: default, about 5 min on 2 cores)")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file of config keys")
    p.add_argument("--kinds", default="residual,hc,mhc", metavar="K1,K2,...",
                   help="connection kinds to train, comma-separated (default: residual,hc,mhc; "
                   "also mhc-lite, kromhc, mhc-static-res)")
    p.add_argument("--seeds", type=int, default=1, metavar="K",
                   help="train every kind on K seeds (seed .. seed+K-1, paired across kinds) "
                   "and report mean +- sd and 95%% intervals of the differences to residual "
                   "(default: 1)")
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
    report = compare(args.out, preset=args.preset, config=cfg, kinds=kinds, seeds=args.seeds,
                     on_start=lambda: warn_warmup(cfg, "mhc compare"))
    if not cfg.quiet and rank0():
        print(summary_table(report))
        if args.seeds > 1:
            from torch_mhc.tools.compare.seeds import seeds_table, significance_lines

            print(seeds_table(report["variants"]))
            print("\n".join(significance_lines(report["variants"])))
        print(f"report: {args.out}/report.md ({report['wall_time_s']:.1f} s)")
    # a comparison where every run stopped compared nothing: a script must not read it as
    # done (a stopped kind or seed among finished runs is a finding, and exits 0). With
    # several seeds a variant's "diverged" names its first stopped seed: count the runs.
    runs = [run for v in report["variants"] for run in v.get("seed_runs", [v])]
    if all(run["diverged"] for run in runs):
        from torch_mhc.lm.train.errors import EXIT_STOPPED

        kinds = ", ".join(v["kind"] for v in report["variants"])
        return fail("mhc compare", f"every run stopped ({kinds}): the spike policy ended "
                    f"each; {args.out}/report.md says at which step and why",
                    EXIT_STOPPED, quiet=not rank0())
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


# without --max-new-tokens (fewer where the KV cache has no positions for them)
_DEFAULT_NEW_TOKENS = 200


def _add_generate(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="sample text from a checkpoint",
        description="Load a checkpoint written by `mhc train` / `mhc compare` and continue a "
        "prompt, decoding with the KV cache unless --no-cache.",
    )
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a checkpoint folder, or a run folder holding one (ckpt/)")
    p.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"tokens (bytes) to generate after the prompt (default: "
                   f"{_DEFAULT_NEW_TOKENS}, or as many as the model's max_seq_len leaves "
                   f"after the prompt with the KV cache)")
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
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="CPU threads for torch (0: torch's default); 1 is steadier on a busy "
                   "machine (default: 0)")
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    _require_extra("generate")
    from torch_mhc.lm.train import resolve_device, torch_threads

    try:
        device = resolve_device(args.device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    from torch_mhc.lm.config import SEED_MAX

    if not 0 <= args.seed <= SEED_MAX:  # as train's and upcycle's seeds
        raise UsageError(f"--seed must lie in [0, {SEED_MAX}], got {args.seed}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not args.prompt:
        raise UsageError("--prompt must not be empty: the model needs a token to start from")
    if args.threads < 0:
        raise UsageError(f"--threads must be >= 0 (0: torch's default), got {args.threads}")
    with torch_threads(args.threads):
        return _generate(args, device)


def _generate(args: argparse.Namespace, device) -> int:
    """The checked arguments' generation: the text on stdout, its speed on stderr."""
    import torch

    from torch_mhc.lm.data import decode, encode
    from torch_mhc.lm.train import load_model

    model = load_model(args.checkpoint, device,
                       say=lambda message: print(f"mhc generate: {message}", file=sys.stderr,
                                                 flush=True))
    cfg = model.cfg
    if args.top_k is not None and not 1 <= args.top_k <= cfg.vocab_size:
        raise UsageError(f"--top-k must lie in [1, {cfg.vocab_size}], got {args.top_k}")
    prompt = encode(args.prompt).to(device)[None]  # [1, T0]
    t0 = prompt.shape[1]
    if t0 > cfg.max_seq_len and args.use_cache:
        raise UsageError(f"the prompt is {t0} bytes, longer than the model allows "
                         f"(max_seq_len {cfg.max_seq_len}); --no-cache slides the context "
                         "window over it")
    if t0 > cfg.max_seq_len:
        print(f"[the prompt is {t0} bytes: the model sees its last {cfg.max_seq_len} "
              "(max_seq_len), as it will each step's]", file=sys.stderr, flush=True)
    new_tokens = args.max_new_tokens
    room = cfg.max_seq_len - t0 + 1  # new tokens the KV cache has positions for
    if new_tokens is None:
        new_tokens = min(_DEFAULT_NEW_TOKENS, room) if args.use_cache else _DEFAULT_NEW_TOKENS
        if new_tokens < _DEFAULT_NEW_TOKENS:
            print(f"[{new_tokens} new token{'s' if new_tokens > 1 else ''}: as many as the "
                  f"model's max_seq_len {cfg.max_seq_len} leaves after the {t0}-byte prompt "
                  f"(the last new token is never fed back, so it takes no position); "
                  f"--no-cache slides the context window for more]", file=sys.stderr, flush=True)
    elif args.use_cache and new_tokens > room:
        raise UsageError(
            f"prompt ({t0} bytes) + max_new_tokens ({new_tokens}) - 1 = {t0 + new_tokens - 1} "
            f"positions exceed the model's max_seq_len {cfg.max_seq_len}; ask for fewer "
            f"tokens, or pass --no-cache (which slides the context window)"
        )
    generator = torch.Generator(device=device).manual_seed(args.seed)
    start = time.perf_counter()
    out = model.generate(prompt, new_tokens, temperature=args.temperature,
                         top_k=args.top_k, use_cache=args.use_cache, generator=generator)
    elapsed = time.perf_counter() - start
    print(decode(out[0]))
    print(f"[{new_tokens} tokens in {elapsed:.2f} s, "
          f"{new_tokens / elapsed:,.0f} tokens/s, "
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
        "AutoTokenizer.from_pretrained(OUT_DIR, trust_remote_code=True). Its logits are "
        "checked against the run's model before the folder is renamed into place.",
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
    _require_extra("upcycle")
    from torch_mhc.tools.upcycle import command

    return command.run_command(args)


# ---------------------------------------------------------------------------------------------
# mhc cost, mhc bench: parsed from the raw arguments (bench's --gpu, --aot and --ops switch to
# another tool's parser, wherever they stand on the line)
# ---------------------------------------------------------------------------------------------


def _add_cost(subparsers) -> None:
    subparsers.add_parser("cost", help="analytic cost model (see mhc cost --help)",
                          add_help=False)


def _run_cost(argv: list[str]) -> int:
    from torch_mhc.tools.cost import command

    parser = RaisingParser(prog="mhc cost", description=command.DESCRIPTION)
    command.add_arguments(parser)
    try:
        args = parse(parser, argv)
        return args if isinstance(args, int) else command.run_command(args)
    except (UsageError, ValueError) as e:
        return fail("mhc cost", f"error: {e}", 2)


def _add_bench(subparsers) -> None:
    subparsers.add_parser("bench", help="benchmark suite (see mhc bench --help)",
                          add_help=False)


SUBCOMMANDS: list[Callable] = [_add_train, _add_compare, _add_sweep, _add_generate, _add_export_hf,
                               _add_cost, _add_bench, _add_upcycle]
DELEGATED: dict[str, Callable[[list[str]], int]] = {"cost": _run_cost, "bench": run_bench}


def build_parser() -> argparse.ArgumentParser:
    from torch_mhc import __version__

    parser = OneLineParser(prog="mhc", description="torch-mhc: residual, HC and mHC side by side.")
    parser.add_argument("--version", action="version", version=f"torch-mhc {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `mhc`; returns the exit status (see EXIT_STATUS). The one error boundary:
    every failure, BaseException subclasses included, is one line and its status
    (`boundary.report`); a SIGINT / SIGTERM ends with 130 / 143 whenever it comes (`Signals`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = f"mhc {argv[0]}" if argv and not argv[0].startswith("-") else "mhc"
    if argv and argv[0] in DELEGATED:  # their own parsing and errors; failures they let
        try:                           # through (a closed pipe, a bug) are reported alike
            status = DELEGATED[argv[0]](argv[1:])
            sys.stdout.flush()  # a closed pipe is found here, not by the interpreter's exit
            return status
        except BaseException as e:  # noqa: BLE001 - the boundary of the delegated tools
            return boundary.report(prog, e, None)
    signals = boundary.Signals()
    with signals.installed(), boundary.warnings_as_lines(prog):
        try:
            try:
                status = _dispatch(argv)
                sys.stdout.flush()  # as above
            finally:
                signals.mute()  # from here on a signal is recorded, never raised
        except BaseException as e:  # noqa: BLE001 - the one boundary of the command
            status = boundary.report(prog, e, signals.first)
        return signals.final_status(prog, status)


def _dispatch(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed)
        return e.code if isinstance(e.code, int) else 0
    prog = f"mhc {args.command}"
    if unknown:  # the subcommand's help lists its flags, the top level's does not
        return fail(prog, f"error: {unrecognized(parser, args, unknown)} (see {prog} --help)", 2)
    return args.run(args)


if __name__ == "__main__":  # python -m torch_mhc.tools.cli, as `mhc`
    sys.exit(main())
