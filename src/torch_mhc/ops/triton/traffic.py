"""The bytes model of the Triton kernels: what each launch must move, re-reads counted.

A launch moves every tensor argument at least once (read or written), and the tensors its
programs read more than once between them (`Launch.reads`, set by the plans) that many times:
phi [n*C, M] is read once per token block by the maps' matmul kernels (mhc_xphi_kernel
forward, mhc_dx_kernel backward), dz once per K block by mhc_dphi_kernel. The model counts
the bytes the kernels request: re-reads come from L2 while the tensor fits there (H100 and
H200: 50 MB), from DRAM otherwise, so it is an upper bound on DRAM traffic, and the figure
that matters once phi outgrows L2 (n = 16, C = 7168: 66 MB in bf16).

`phi_traffic` builds the maps' launches from the ops' own plans on meta tensors (nothing is
allocated) and reports phi's share of each pass's bytes; `traffic_table` is the table in
docs/performance.md:

    python -m torch_mhc.ops.triton.traffic
"""

from __future__ import annotations

import torch

__all__ = ["launch_bytes", "phi_traffic", "traffic_table"]


def launch_bytes(launch) -> int:
    """Bytes a launch must move at least: each tensor argument once (an argument passed twice
    counts once), those in launch.reads as many times as its programs read them."""
    times = dict(launch.reads)
    seen, total = set(), 0
    for i, a in enumerate(launch.args):
        if not isinstance(a, torch.Tensor):
            continue
        key = id(a) if a.device.type == "meta" else a.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += a.numel() * a.element_size() * times.get(i, 1)
    return total


# The launches reading phi, and its position among their arguments.
PHI_ARGUMENT = {"mhc_xphi_kernel": 1, "mhc_dx_kernel": 1}


def _phi_reads(launch) -> tuple[int, int]:
    """(times phi is read, phi's bytes) in one launch; (0, 0) if it does not read phi."""
    i = PHI_ARGUMENT.get(launch.name)
    if i is None:
        return 0, 0
    phi = launch.args[i]
    return dict(launch.reads).get(i, 1), phi.numel() * phi.element_size()


def phi_traffic(n: int, channels: int, tokens: int, dtype: torch.dtype = torch.bfloat16,
                param_dtype: torch.dtype | None = None, cc: int = 90) -> dict:
    """phi's traffic in the maps' forward and backward at this size, as the plans launch them
    for sm_<cc>: per pass, the reads of phi (token blocks), the K splits, the bytes of phi read
    and of the whole pass (all its launches), and phi's share of them (MB = 1e6 bytes)."""
    from torch_mhc.ops.triton import aot
    from torch_mhc.ops.triton.ops import SMEM_PER_BLOCK

    out = dict(n=n, channels=channels, tokens=tokens)
    launches = aot.op_launches(n, dtype, tokens, channels, 20, param_dtype=param_dtype,
                               smem=SMEM_PER_BLOCK[cc], ops=("mhc_maps_fwd", "mhc_maps_bwd"))
    for op, key in (("mhc_maps_fwd", "fwd"), ("mhc_maps_bwd", "bwd")):
        total = phi_read = reads = splits = phi_bytes = 0
        for name, launch in launches:
            if name != op:
                continue
            total += launch_bytes(launch)
            times, nbytes = _phi_reads(launch)
            if times:
                reads, splits, phi_bytes = times, launch.grid[1], nbytes
                phi_read += times * nbytes
        out[key] = dict(phi_reads=reads, splits=splits, phi_mb=phi_bytes / 1e6,
                        phi_read_mb=phi_read / 1e6, total_mb=total / 1e6,
                        phi_share=phi_read / total if total else 0.0)
    return out


SIZES = dict(n=(2, 4, 8, 16), channels=(4096, 7168), tokens=(8192, 1, 8, 32))


def traffic_table(sizes: dict = SIZES, dtype: torch.dtype = torch.bfloat16, cc: int = 90) -> str:
    """Markdown: per n, C and T, phi's reads and share of each pass's bytes (phi_traffic)."""
    lines = ["| n | C | T | phi MB | fwd reads x splits | fwd phi MB read | fwd phi share "
             "| bwd reads x splits | bwd phi MB read | bwd phi share |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sizes["n"]:
        for c in sizes["channels"]:
            for t in sizes["tokens"]:
                row = phi_traffic(n, c, t, dtype, cc=cc)
                f, b = row["fwd"], row["bwd"]
                lines.append(
                    f"| {n} | {c} | {t} | {f['phi_mb']:.1f} "
                    f"| {f['phi_reads']} x {f['splits']} | {f['phi_read_mb']:.1f} "
                    f"| {f['phi_share']:.1%} | {b['phi_reads']} x {b['splits']} "
                    f"| {b['phi_read_mb']:.1f} | {b['phi_share']:.1%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    from torch_mhc.ops.triton.aot import require_triton

    try:
        require_triton("the bytes model of the Triton kernels")
    except ValueError as err:
        print(f"python -m torch_mhc.ops.triton.traffic: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(traffic_table())
