"""Bytes saved for backward per token per connection, with and without recomputation.

A thin script: `mhc bench --only saved` (torch_mhc/tools/bench/saved.py); every
option of `mhc bench` is accepted, e.g.

    python benchmarks/bench_saved.py --dim 512
    python benchmarks/bench_saved.py --quick
"""

import sys

from torch_mhc.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--only", "saved", *sys.argv[1:]]))
