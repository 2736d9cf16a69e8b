"""lucidrains' hyper-connections mHC around the same blocks, against ours and the residual.

A thin script: `mhc bench --only hyper_connections` (torch_mhc/tools/bench/step.py); every
option of `mhc bench` is accepted, e.g.

    python benchmarks/bench_hyper_connections.py --sizes 256,512 --threads 1 --clock process
    python benchmarks/bench_hyper_connections.py --quick
"""

import sys

from torch_mhc.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--only", "hyper_connections", *sys.argv[1:]]))
