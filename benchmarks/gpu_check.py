"""One command for the first GPU: correctness, kernel bandwidth, Sinkhorn, step, decode, memory.

    python benchmarks/gpu_check.py --out gpu_check        # JSON + markdown in gpu_check/
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --dry-run --out /tmp/gc   # CPU, tiny

The same as `mhc bench --gpu`; the code is torch_mhc/tools/bench/gpu_check.py (its docstring lists
the sections).
"""

import sys

from torch_mhc.tools.bench.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
