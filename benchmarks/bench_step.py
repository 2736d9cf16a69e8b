"""Training step of the reference LM: residual vs HC vs mHC.

A thin script: the benchmark is `step` in torch_mhc.tools.bench.suite (`mhc bench --only step`);
every option of `mhc bench` is accepted, e.g.

    python benchmarks/bench_step.py --sizes 256,512 --threads 1 --clock process
    python benchmarks/bench_step.py --quick
"""

import sys

from torch_mhc.tools.bench.suite import bench_main

if __name__ == "__main__":
    sys.exit(bench_main(["--only", "step", *sys.argv[1:]]))
