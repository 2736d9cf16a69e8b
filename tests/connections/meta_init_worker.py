"""Worker for test_meta_init.py: a wrapped model built on the meta device, sharded with
FSDP2, materialised and initialised, then run; launched on 2 gloo processes.

    torchrun --standalone --nproc-per-node 2 tests/connections/meta_init_worker.py <outdir>

Each rank writes <outdir>/meta_rank<r>.pt: per connection kind, the full (gathered) state dict
after initialisation, the output and loss on a fixed batch, and the full gradients. The test
builds the same model eagerly in one process (`build` below) and compares.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from torch import nn

from torch_mhc import expand_streams, make_connection, reduce_streams

DIM, STREAMS, LAYERS = 16, 4, 4
KINDS = ("residual", "hc", "mhc")


class DetLinear(nn.Linear):
    """nn.Linear whose initialisation is a fixed function of the shape (no RNG): a model
    initialised shard by shard then equals the eagerly built one, branches included."""

    def reset_parameters(self) -> None:
        out_f, in_f = self.weight.shape
        i = torch.arange(out_f * in_f, dtype=torch.float64).reshape(out_f, in_f)
        full_w = (torch.sin(1.7 * i + 0.3) / math.sqrt(in_f)).float()
        full_b = 0.1 * torch.cos(torch.arange(out_f, dtype=torch.float64)).float()
        from torch_mhc.connections.base import assign_parameter  # the same shard-aware copy

        assign_parameter(self.weight, full_w)
        if self.bias is not None:
            assign_parameter(self.bias, full_b)


class Stack(nn.Module):
    """[B, T, C] -> [B, T, C]: LAYERS connections around small MLP branches."""

    def __init__(self, kind: str):
        super().__init__()
        self.streams = 1 if kind == "residual" else STREAMS
        self.blocks = nn.ModuleList(
            make_connection(kind, DIM, STREAMS, k, nn.Sequential(
                DetLinear(DIM, 2 * DIM), nn.GELU(), DetLinear(2 * DIM, DIM)))
            for k in range(LAYERS)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = expand_streams(h, self.streams)  # [B, T, n, C]
        for block in self.blocks:
            x = block(x)
        return reduce_streams(x)  # [B, T, C]


def build(kind: str) -> Stack:
    return Stack(kind)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(4, 8, DIM, generator=g), torch.randn(4, 8, DIM, generator=g)


def loss_of(model: nn.Module, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((model(h) - target) ** 2).mean()


def run_sharded(kind: str, world_size: int) -> dict:
    """Meta build -> fully_shard (blocks, then root) -> to_empty -> reset_parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    with torch.device("meta"):
        model = build(kind)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    h, target = batch()
    rank = torch.distributed.get_rank()
    # Each rank feeds its half of the batch; the mean loss over the whole batch is the average.
    hs, ts = h.chunk(world_size)[rank], target.chunk(world_size)[rank]
    loss = loss_of(model, hs, ts)
    loss.backward()
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    return {
        "sharded": sharded,
        "state": {n: full(p.detach()).clone() for n, p in model.named_parameters()},
        "buffers": {n: full(b).clone() for n, b in model.named_buffers()},
        "loss": loss.detach(),
        # FSDP averages gradients over ranks: the gradient of the whole batch's mean loss.
        "grads": {n: full(p.grad).clone() for n, p in model.named_parameters()},
    }


def main(outdir: str) -> None:
    import torch.distributed as dist

    from torch_mhc.lm.parallel import destroy_distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        out = {kind: run_sharded(kind, dist.get_world_size()) for kind in KINDS}
        torch.save(out, Path(outdir) / f"meta_rank{dist.get_rank()}.pt")
    except BaseException:
        dist.destroy_process_group()  # no barrier: the other rank may never reach one
        raise
    destroy_distributed()  # leave together, after gloo's threads are done (see its docstring)


if __name__ == "__main__":
    main(sys.argv[1])
