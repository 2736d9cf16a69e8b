"""`mhc bench`: suite (the benchmarks and their report), timing (interleaved rounds), ops (the
per-op benchmark), gpu_check (the one-script check run on a lent GPU)."""
