"""Everything behind the `mhc` command: cli (every parser), boundary (one line and an exit
status for every failure), errors (UsageError), compare/ (runs,
statistics, report, plots), bench/ (the benchmark suite, timing, op benchmarks, the GPU check),
cost/ (the analytic cost model). May import every other part; the rest of the package does not
import it, except as a script entry (`python -m torch_mhc`).
"""
