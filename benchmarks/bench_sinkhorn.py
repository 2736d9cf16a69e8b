"""Sinkhorn forward + backward: recomputing backward vs autograd through the loop.

A thin script: the benchmark is `sinkhorn` in tools/bench/suite.py (`mhc bench --only sinkhorn`);
every option of `mhc bench` is accepted, e.g.

    python benchmarks/bench_sinkhorn.py --threads 1 --clock process
    python benchmarks/bench_sinkhorn.py --quick
"""

import sys

from torch_mhc.tools.bench.suite import bench_main

if __name__ == "__main__":
    sys.exit(bench_main(["--only", "sinkhorn", *sys.argv[1:]]))
