"""`mhc bench`: the benchmark suite, or with --gpu, --aot or --ops another tool with its own
options (the GPU check, the Triton ahead-of-time compile check, the per-op benchmark). Those
switches pick the tool wherever they stand on the line (`BENCH_TOOLS`, `run_bench_tool`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from torch_mhc.tools.boundary import fail, parse, parse_error
from torch_mhc.tools.errors import UsageError

__all__ = ["BENCH_TOOLS", "run_bench", "run_bench_tool"]


def run_bench(argv: list[str]) -> int:
    for switch in BENCH_TOOLS:
        if switch in argv:
            return run_bench_tool(switch, [a for a in argv if a not in BENCH_TOOLS])
    from torch_mhc.tools.bench import suite

    parser = argparse.ArgumentParser(prog="mhc bench", description=suite.DESCRIPTION,
                                     epilog=suite.EPILOG)
    suite.add_arguments(parser)
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    try:
        suite.check_arguments(args)
    except (UsageError, ValueError) as e:
        return fail("mhc bench", f"error: {e}", 2)
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
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    check = getattr(tool, "check_arguments", None)
    try:
        if check is not None:
            check(args)
    except (UsageError, ValueError) as e:
        return parse_error(parser, str(e))
    try:
        return tool.run_command(args)
    except UsageError as e:
        return fail(prog, f"error: {e}", 2)
