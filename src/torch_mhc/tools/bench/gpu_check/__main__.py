"""`python -m torch_mhc.tools.bench.gpu_check`: `mhc bench --gpu` with errors as gpu_check's;
0 all passed, 1 a section failed, 2 bad input (one line on stderr)."""

import sys

from torch_mhc.tools.bench.command import run_bench_tool

if __name__ == "__main__":
    raise SystemExit(run_bench_tool("--gpu", sys.argv[1:], prog="gpu_check"))
