"""`mhc bench`: command (which tool a command line runs), suite (the command's options and run:
which benchmarks, their report), workloads
(the benchmark LM, tokens, a training step, bytes saved for backward), step, saved, sinkhorn,
decode (one benchmark each), decode_call (one connection's decoding call profiled), report (the
markdown tables), timing (every timing loop), ops (the per-op benchmark, `mhc bench --ops`),
gpu_check (the one-script check run on a lent GPU,
`mhc bench --gpu`)."""
