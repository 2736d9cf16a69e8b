"""KV-cached greedy decoding tokens/s: residual vs HC vs mHC.

A thin script: the benchmark is `decode` in torch_mhc.tools.bench.suite (`mhc bench --only decode`);
every option of `mhc bench` is accepted, e.g.

    python benchmarks/bench_decode.py --decode-batches 1,8 --threads 1 --clock process
    python benchmarks/bench_decode.py --quick
"""

import sys

from torch_mhc.tools.bench.suite import bench_main

if __name__ == "__main__":
    sys.exit(bench_main(["--only", "decode", *sys.argv[1:]]))
