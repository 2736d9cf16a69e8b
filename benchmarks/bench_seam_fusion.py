"""What fusing one connection's merge with the next connection's maps would save, measured
before building it.

Between two mHC connections nothing runs: connection l's merge writes x_{l+1} = H_res x_l +
H_post f_l, and connection l + 1's maps read it at once (forward); in the backward, the maps
of l + 1 write dx_{l+1}, which is the merge of l's upstream gradient. Fused per group of 16
tokens, the second pass would find its input in L2 instead of memory. This script builds
native.c with that fusion patched in (maps_fwd_body runs merge_fwd_body on each group first;
maps_bwd_body runs the merge's backward on each group's dx after its tiles), checks that the
fused passes give the same bits as the two passes, and times both with the caches evicted
before every call (a 256 MiB write; f and ga, produced just before in a model, touched
afterwards), T tokens of n = 4 streams of C floats, one thread, process clock:

    python benchmarks/bench_seam_fusion.py --repeats 31

The patch is a prototype of this file, not of the library: it fails with a clear message
once native.c no longer has the lines it patches.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import torch

from torch_mhc.ops.cpu import build
from torch_mhc.tools.bench.report import script_report
from torch_mhc.tools.bench.timing import summarize

SEAM = """typedef struct { const void* x; const void* f; const float* hp; const float* hr;
                 void* df; float* dhp; } seam_t;
"""
PATCHES = [  # (anchor, replacement): each anchor must occur in native.c
    ("INLINE void gate_logits(", SEAM + "INLINE void gate_logits("),
    ("float pre_eps, int bf) {\n    const int64_t K = n * C, Mp = MV * WG, nn = n * n,",
     "float pre_eps, int bf, const seam_t* seam) {\n    const int64_t K = n * C, Mp = MV * WG, "
     "nn = n * n,"),
    ("        xphi_rows(x, phip, t, g, K, MV, z, bf);",
     "        if (seam) merge_fwd_body(seam->x, seam->f, seam->hp, seam->hr, (void*)x, t, t + g,"
     " n, C, bf);\n        xphi_rows(x, phip, t, g, K, MV, z, bf);"),
    ("float sk_eps, float pre_eps, int bf) {\n    const int64_t K = n * C, nn = n * n,",
     "float sk_eps, float pre_eps, int bf, const seam_t* seam) {\n    const int64_t K = n * C, "
     "nn = n * n,"),
    ("                         base, t + s, 1, n, C, M, Mp, bf);\n    }",
     "                         base, t + s, 1, n, C, M, Mp, bf);\n        if (seam) "
     "merge_bwd_pass(NULL, seam->f, seam->hp, seam->hr, dx, NULL, seam->df, seam->dhp, NULL, t,"
     " t + g, n, C, 0, bf);\n    }"),
    ("(float)norm_eps, (float)sk_eps, (float)pre_eps, bf))",
     "(float)norm_eps, (float)sk_eps, (float)pre_eps, bf, NULL))"),
    ("             (float)sk_eps, (float)pre_eps, bf))",
     "             (float)sk_eps, (float)pre_eps, bf, NULL))"),
    ("(float)d->sk_eps, (float)d->pre_eps, bf)));", "(float)d->sk_eps, (float)d->pre_eps, bf, "
     "NULL)));"),
]
EXPORTS = """
void seam_fwd(const void* xl, const void* f, const float* hp, const float* hr, void* out,
              const float* phip, const float* ab, float* lt, float* r, float* hpre,
              float* hpost, float* hres, void* a, int64_t T, int64_t n, int64_t C, int64_t M,
              int64_t MV, int64_t iters) {
    const int bf = 0;
    const seam_t s = {xl, f, hp, hr, NULL, NULL};
    WITH_N(n, maps_fwd_body(out, phip, ab, lt, r, hpre, hpost, hres, a, 0, T, N_, C, M, MV,
                            (int)iters, 0, 1e-6f, 0.0f, 0.0f, bf, &s));
}
void seam_bwd(const void* x, const float* phitb, const float* ab, const float* lt,
              const float* r, const float* gpre, const float* gpost, const void* ga,
              const void* gmerge, void* dx, float* dht, float* dphi, float* sk_y, float* base,
              const void* f, const float* hp, const float* hr, void* df, float* dhp, int64_t T,
              int64_t n, int64_t C, int64_t M, int64_t MV, int64_t iters) {
    const int bf = 0;
    const seam_t s = {NULL, f, hp, hr, df, dhp};
    WITH_N(n, maps_bwd_body(x, phitb, ab, lt, r, gpre, gpost, NULL, ga, gmerge, dx, dht, dphi,
                            (v16*)sk_y, base, 0, T, N_, C, M, MV, (int)iters, 0, 0.0f, 0.0f,
                            bf, &s));
}
"""


def patched_library(out_dir: Path) -> ctypes.CDLL:
    source = build.SOURCE.read_text()
    for anchor, replacement in PATCHES:
        if source.count(anchor) < 1:
            raise SystemExit(f"native.c no longer has the line this prototype patches: {anchor!r}")
        source = source.replace(anchor, replacement, 1)
    src, lib = out_dir / "seam.c", out_dir / "seam.so"
    src.write_text(source + EXPORTS)
    command = build._compiler()
    if command is None:
        raise SystemExit("no C compiler (cc, gcc or clang on PATH, or set CC)")
    print("building the patched native.c ...", file=sys.stderr, flush=True)
    build._compile(command, build.library_flags(), lib, src)
    dll = ctypes.CDLL(str(lib))
    P, I, D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    for name, types in {"seam_fwd": [P] * 13 + [I] * 6, "seam_bwd": [P] * 19 + [I] * 6,
                        "merge_fwd_f32": [P] * 5 + [I] * 5,
                        "maps_fwd_f32": [P] * 9 + [I] * 9 + [D] * 3,
                        "maps_bwd_f32": [P] * 15 + [I] * 9 + [D] * 2,
                        "merge_bwd_f32": [P] * 9 + [I] * 5}.items():
        getattr(dll, name).argtypes, getattr(dll, name).restype = types, None
    return dll


def calls(lib: ctypes.CDLL, T: int, C: int, n: int = 4, iters: int = 20) -> dict:
    """name -> (call, the tensors a model would have in cache before it); checks that each
    fused pass gives the bits of the two passes."""
    K, M = n * C, 2 * n + n * n
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    xl, f, ga, gm, gpre, gpost = rnd(T, n, C), rnd(T, C), rnd(T, C), rnd(T, n, C), rnd(T, n), \
        rnd(T, n)
    hp, hr = 2 * torch.rand(T, n, generator=g), torch.softmax(rnd(T, n, n), -1)
    phi = 0.02 * rnd(K, M)
    phip = torch.nn.functional.pad(phi, (0, 32 - M)).contiguous()  # the wide forward table
    phitb = phi.t().reshape(M, K // 16, 16).permute(1, 0, 2).contiguous()
    ab = torch.cat([torch.full((M,), 0.5), 0.1 * rnd(M)])
    p = lambda t: None if t is None else t.data_ptr()  # noqa: E731

    def fwd(fused, o):
        maps = [o[k] for k in ("lt", "r", "hpre", "hpost", "hres", "a")]
        if fused:
            return lib.seam_fwd(*map(p, [xl, f, hp, hr, o["x"], phip, ab, *maps]), T, n, C, M, 4,
                                iters)
        lib.merge_fwd_f32(*map(p, [xl, f, hp, hr, o["x"]]), 0, T, 1, n, C)
        lib.maps_fwd_f32(*map(p, [o["x"], phip, ab, *maps]), 0, T, 1, n, C, M, 4, iters, 0,
                         1e-6, 0.0, 0.0)

    def bwd(fused, o, m):
        o["dphi"].zero_()
        grads = [o[k] for k in ("dx", "dht", "dphi", "sk", "base")]
        if fused:
            return lib.seam_bwd(*map(p, [m["x"], phitb, ab, m["lt"], m["r"], gpre, gpost, ga, gm,
                                         *grads, f, hp, hr, o["df"], o["dhp"]]), T, n, C, M, 3,
                                iters)
        lib.maps_bwd_f32(*map(p, [m["x"], phitb, ab, m["lt"], m["r"], gpre, gpost, None, ga, gm,
                                  *grads]), 0, T, 1, n, C, M, 3, iters, 0, 0.0, 0.0)
        lib.merge_bwd_f32(*map(p, [None, f, hp, hr, o["dx"], None, o["df"], o["dhp"], None]), 0,
                          T, 1, n, C)

    def buffers():
        return dict(x=torch.empty(T, n, C), lt=torch.empty(T, M), r=torch.empty(T),
                    hpre=torch.empty(T, n), hpost=torch.empty(T, n), hres=torch.empty(T, n, n),
                    a=torch.empty(T, C), dx=torch.empty(T, n, C), dht=torch.empty(T, M),
                    dphi=torch.zeros(K * 24), sk=torch.empty((2 * iters - 1) * (n * n + n) * 16),
                    base=torch.empty(8 * K), df=torch.empty(T, C), dhp=torch.empty(T, n))
    two, one = buffers(), buffers()
    fwd(False, two), fwd(True, one), bwd(False, two, two), bwd(True, one, two)
    for key in ("x", "lt", "r", "hpre", "hpost", "hres", "a", "dx", "dht", "dphi", "df", "dhp"):
        if not torch.equal(two[key], one[key]):
            raise SystemExit(f"the fused passes' {key} differs from the two passes'")
    return {"forward, two passes": (lambda: fwd(False, two), [f]),
            "forward, fused": (lambda: fwd(True, one), [f]),
            "backward, two passes": (lambda: bwd(False, two, two), [ga]),
            "backward, fused": (lambda: bwd(True, one, two), [ga])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=31, help="rounds (at least 2)")
    ap.add_argument("--json", help="also write the JSON here")
    args = ap.parse_args()
    if args.repeats < 2 or args.tokens < 1 or args.dim < 4 or args.dim % 4:
        ap.error(f"expected --repeats >= 2, --tokens >= 1 and --dim a positive multiple of 4 "
                 f"(n C = 4 --dim in whole 16-float blocks), got {args.repeats}, "
                 f"{args.tokens} and {args.dim}")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        lib = patched_library(Path(tmp))
        cases = calls(lib, args.tokens, args.dim)
        junk = torch.empty(64 * 2**20)  # 256 MiB
        times = {name: [] for name in cases}
        for _ in range(args.repeats):
            for name, (run, hot) in cases.items():
                junk.fill_(1.0)
                for t in hot:
                    t.sum()
                start = time.process_time()
                run()
                times[name].append((time.process_time() - start) * 1e3)
    results = {}
    for which in ("forward", "backward"):
        s = summarize({k: v for k, v in times.items() if k.startswith(which)},
                      f"{which}, two passes")
        results.update(s)
    config = {"tokens": args.tokens, "streams": 4, "dim": args.dim, "dtype": "float32",
              "threads": 1, "clock": "process", "rounds": args.repeats}
    print(script_report(config, results, args.json))
    print("\n| pass | median ms | min-max ms | paired ratio to the two passes (interval) |")
    print("|---|---:|---:|---|")
    for name, e in results.items():
        low, high, cover = e["ratio_interval"]
        print(f"| {name} | {e['median_ms']:.3f} | {e['min_ms']:.3f}-{e['max_ms']:.3f} | "
              f"{e['ratio_paired']:.3f} ({low:.3f}-{high:.3f}, {cover:.0%}) |")


if __name__ == "__main__":
    main()
