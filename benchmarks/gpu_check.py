"""One command for the first GPU: correctness, kernel bandwidth, Sinkhorn, step, decode, memory.

    python benchmarks/gpu_check.py --out gpu_check        # JSON + markdown in gpu_check/
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --dry-run --out /tmp/gc   # CPU, tiny

The same as `mhc bench --gpu` (errors name gpu_check); the code is the package
torch_mhc/tools/bench/gpu_check/ (its docstring lists the sections).
"""

import sys

from torch_mhc.tools.bench.command import run_bench_tool

if __name__ == "__main__":
    sys.exit(run_bench_tool("--gpu", sys.argv[1:], prog="gpu_check"))
