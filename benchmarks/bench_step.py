"""Training step of the reference LM: residual vs HC vs mHC.

A thin script: `mhc bench --only step` (torch_mhc/tools/bench/step.py); every
option of `mhc bench` is accepted, e.g.

    python benchmarks/bench_step.py --sizes 256,512 --threads 1 --clock process
    python benchmarks/bench_step.py --quick
"""

import sys

from torch_mhc.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--only", "step", *sys.argv[1:]]))
