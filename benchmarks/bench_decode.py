"""KV-cached greedy decoding tokens/s: residual vs HC vs mHC.

A thin script: `mhc bench --only decode` (torch_mhc/tools/bench/decode.py); every
option of `mhc bench` is accepted, e.g.

    python benchmarks/bench_decode.py --decode-batches 1,8 --threads 1 --clock process
    python benchmarks/bench_decode.py --quick
"""

import sys

from torch_mhc.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--only", "decode", *sys.argv[1:]]))
