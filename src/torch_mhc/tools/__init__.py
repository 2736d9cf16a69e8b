"""Everything behind the `mhc` command: cli (the one parser), compare/ (runs, statistics,
report, plots), bench/ (the benchmark suite, timing, op benchmarks, the GPU check), cost/ (the
analytic cost model). May import every other part; nothing imports it.
"""
