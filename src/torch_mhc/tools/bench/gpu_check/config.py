"""What the GPU check runs: its sections in order, the plan of cases, the full and dry sizes."""

from __future__ import annotations

import torch

# Most important first: a run that spends its budget early still reports these. The step
# and decode come before Sinkhorn's timings: the first run on an H200 (330 s) spent 84 s on
# those, most of it compiling Inductor's, and never reached decode.
SECTIONS = ("correctness", "large", "nan_fill", "params", "compile", "contexts", "eps",
            "far_logits", "correctness_rest", "kernels", "step", "decode", "sinkhorn",
            "inductor")

_NO_GPU = "needs a CUDA device (CUDA graphs, the caching allocator, streams or timings)"
# The cases of the full check, most important first; implemented: run by this check now;
# section: where the report holds its results; dry_run_skip: what the CPU dry run leaves out.
PLAN = [
    dict(case="correctness: every op, forward and gradients, against functional.maps in fp32",
         n=[2, 3, 4, 5, 8, 12, 16], streams=["fp32", "bf16", "fp16"], params=["fp32"],
         tolerance="outputs/maps: MAPS_TOL; x grad: TOL; parameter grads: max(MAPS_TOL, 1e-4); "
                   "other grads: TOL of their dtype",
         section="correctness, correctness_rest", implemented=True, dry_run_skip=None),
    dict(case="determinism: each op twice, outputs and gradients bitwise equal",
         section="every check section", implemented=True, dry_run_skip=None),
    dict(case="T = 75000, n = 4, C = 7168, bf16 (> 2^31 elements): the first and last token "
              "blocks against the reference on those slices, every output finite",
         section="large", implemented=True,
         dry_run_skip="past 2^31 elements: too large for the CPU dry run (it runs the same "
                      "slice check at a tiny shape)"),
    dict(case="outputs after filling the caching allocator with NaN", section="nan_fill",
         implemented=True,
         dry_run_skip="the CPU dry run fills the CPU allocator instead (no caching allocator)"),
    dict(case="correctness with bf16 parameters (a model cast whole)", params=["bf16"],
         tolerance="parameter grads: at least TOL of the parameters' dtype",
         section="params", implemented=True,
         dry_run_skip="bf16 is not supported by Triton's interpreter (the dry run holds fp16 "
                      "parameters)"),
    dict(case="torch.compile(fullgraph=True) and CUDA-graph capture of a connection's forward "
              "and backward against eager", section="compile", implemented=True,
         dry_run_skip="CUDA graphs need a CUDA device; torch.compile runs with aot_eager"),
    dict(case="autocast (bf16 streams, fp32 parameters), non-contiguous inputs, a non-default "
              "stream", section="contexts", implemented=True,
         dry_run_skip="the stream needs a CUDA device; autocast runs with fp16 on the CPU"),
    dict(case="eps > 0 (sinkhorn_eps, pre_eps) in the fused maps", section="eps",
         implemented=True, dry_run_skip=None),
    dict(case="far logits inside the fused maps (alpha_res large: log domain)",
         tolerance="fp32: 1e-4 (as the far-logits maps test); half streams: as correctness",
         section="far_logits", implemented=True, dry_run_skip=None),
    dict(case="kernel timings with L2 flushed and launches amortised (section kernels)",
         section="kernels", implemented=True,
         dry_run_skip="CPU wall clock per launch (no L2, no CUDA graphs)"),
    dict(case="training step, decode, sinkhorn, inductor sections",
         tolerance="inductor: maps as correctness; aggregation, merge and Sinkhorn at the "
                   "streams' TOL (the compiled reference computes in the streams' dtype)",
         section="step, decode, sinkhorn, inductor", implemented=True,
         dry_run_skip="inductor: compiles C++ per graph on a CPU (tests/ops/test_inductor.py)"),
]

MIB = 2**20

def _split(dtypes, ns, first_dtypes, first_ns) -> dict:
    """The (dtype, n) pairs of the correctness section (first_*) and of correctness_rest (the
    others: kernel variants that cost a compile each, run once the other cases have)."""
    pairs = [(dt, n) for dt in dtypes for n in ns]
    first = [(dt, n) for dt, n in pairs if dt in first_dtypes and n in first_ns]
    return {"first": first, "rest": [p for p in pairs if p not in first]}


FULL = dict(device="cuda", dtypes=(torch.float32, torch.bfloat16, torch.float16),
            ns=(2, 3, 4, 5, 8, 12, 16), tokens=257, channels=1000,
            # The cases' (dtype, n) pairs are among correctness's first ones: their kernels
            # are compiled already (a compile costs seconds; fp16 waits for correctness_rest).
            case_ns=(3, 4, 8), case_dtypes=(torch.float32, torch.bfloat16),
            combos=_split((torch.float32, torch.bfloat16, torch.float16), (2, 3, 4, 5, 8, 12, 16),
                          (torch.float32, torch.bfloat16), (2, 3, 4, 8)),
            half=torch.bfloat16, param_dtypes=(torch.bfloat16,),
            large=dict(tokens=75000, n=4, channels=7168, slice=256, dtype=torch.bfloat16),
            # Run in a process of their own: a fault there cannot stop the other sections.
            isolated=("large",),
            nan_fill_mib=4096, compile=dict(backend="inductor", dtypes=(torch.float32,
                                                                        torch.bfloat16),
                                            batch=2, tokens=129, n=4, channels=1000),
            big_tokens=8192, big_channels=(4096, 7168), kernel_n=4, repeats=20,
            timing=dict(launches=20, flush_min_mib=256),
            sk_tokens=65536, step=dict(dim=2048, layers=16, batch=8, seq=1024, repeats=5),
            decode=dict(dim=2048, layers=16, batches=(1, 8), prompt=128, new_tokens=64,
                        call=dict(impls=("triton", "triton/ops", "reference"), calls=100, rounds=3,
                                  profiled=10, top=12)),
            impls=("triton",), sk_impls=("triton", "inductor", "reference"),
            inductor=dict(impls=("inductor",), ns=(4,)))
DRY = dict(device="cpu", dtypes=(torch.float32, torch.float16), ns=(2, 4), tokens=5,
           channels=9, case_ns=(3, 4), case_dtypes=(torch.float32, torch.float16),
           half=torch.float16, param_dtypes=(torch.float16,),
           combos=_split((torch.float32, torch.float16), (2, 4), (torch.float32,), (2, 4)),
           large=dict(tokens=70, n=4, channels=9, slice=8, dtype=torch.float16),
           isolated=("large",),
           nan_fill_mib=8, compile=dict(backend="aot_eager", dtypes=(torch.float32,),
                                        batch=1, tokens=5, n=4, channels=9),
           big_tokens=16, big_channels=(24,), kernel_n=4, repeats=2,
           timing=dict(launches=2, flush_min_mib=1), sk_tokens=16,
           step=dict(dim=64, layers=1, batch=1, seq=8, repeats=1),
           decode=dict(dim=64, layers=1, batches=(1,), prompt=4, new_tokens=3,
                       call=dict(impls=("cpu", "cpu/ops", "reference"), calls=5, rounds=2,
                                 profiled=2, top=5)),
           # Inductor compiles C++ on a CPU (seconds a graph): tests/ops/test_inductor.py
           # checks it there.
           impls=("triton",), sk_impls=("triton", "reference"), inductor=dict(impls=()))
