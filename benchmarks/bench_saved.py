"""Bytes saved for backward per token per connection, with and without recomputation.

A thin script: the benchmark is `saved` in torch_mhc.tools.bench.suite (`mhc bench --only saved`);
every option of `mhc bench` is accepted, e.g.

    python benchmarks/bench_saved.py --dim 512
    python benchmarks/bench_saved.py --quick
"""

import sys

from torch_mhc.tools.bench.suite import bench_main

if __name__ == "__main__":
    sys.exit(bench_main(["--only", "saved", *sys.argv[1:]]))
