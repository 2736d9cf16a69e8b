"""`mhc bench`: the benchmark suite, or with --gpu, --aot or --ops another tool with its own
options (the GPU check, the Triton ahead-of-time compile check, the per-op benchmark). Those
switches pick the tool wherever they stand on the line (`BENCH_TOOLS`, `run_bench_tool`)."""

from __future__ import annotations

import importlib

from torch_mhc.ops.checks import ImplUnavailableError
from torch_mhc.tools.boundary import OneLineParser, fail, parse, parse_error
from torch_mhc.tools.errors import UsageError

__all__ = ["BENCH_TOOLS", "run_bench", "run_bench_tool"]


def run_bench(argv: list[str]) -> int:
    for switch in BENCH_TOOLS:
        if switch in argv:
            return run_bench_tool(switch, [a for a in argv if a not in BENCH_TOOLS])
    from torch_mhc.tools.bench import suite

    parser = OneLineParser(prog="mhc bench", description=suite.DESCRIPTION,
                           epilog=suite.EPILOG)
    suite.add_arguments(parser)
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    try:
        suite.check_arguments(args)
    except (UsageError, ValueError, ImplUnavailableError) as e:
        return fail("mhc bench", f"error: {e}", 2)
    return suite.run_command(args, argv)


# switch of `mhc bench` -> (the tool's module, with add_arguments and run_command; its prog)
BENCH_TOOLS: dict[str, tuple[str, str]] = {
    "--gpu": ("torch_mhc.tools.bench.gpu_check", "gpu_check"),
    "--aot": ("torch_mhc.ops.triton.aot", "mhc bench --aot"),
    "--ops": ("torch_mhc.tools.bench.ops", "mhc bench --ops"),
}


def run_bench_tool(switch: str, argv: list[str], prog: str = "mhc bench") -> int:
    """`mhc bench <switch> ARGS`: the GPU check (--gpu), the Triton AOT compile check (--aot) or
    the op benchmark (--ops), with their own options. A bad option value is a usage error of
    the tool's parser; what the run itself refuses (the GPU check without a GPU) is one line,
    `<prog>: error: ...`. Returns the exit status."""
    module, tool_prog = BENCH_TOOLS[switch]
    tool = importlib.import_module(module)  # imported only when its switch is given
    parser = OneLineParser(prog=tool_prog, description=tool.__doc__.splitlines()[0])
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
