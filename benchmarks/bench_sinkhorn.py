"""Sinkhorn forward + backward: recomputing backward vs autograd through the loop.

A thin script: `mhc bench --only sinkhorn` (torch_mhc/tools/bench/sinkhorn.py); every
option of `mhc bench` is accepted, e.g.

    python benchmarks/bench_sinkhorn.py --threads 1 --clock process
    python benchmarks/bench_sinkhorn.py --quick
"""

import sys

from torch_mhc.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--only", "sinkhorn", *sys.argv[1:]]))
