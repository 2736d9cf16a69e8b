"""Data parallelism: DDP (a full replica per process) and FSDP2 (parameters sharded per block).

Both keep the single-process maths: every process runs the same model on its own equal share
of the global batch, and the gradients are averaged over processes before the optimizer step,
which is the gradient of the mean loss over the global batch.

- DDP all-reduces gradient buckets during the backward pass; each process holds the whole
  model and the whole optimizer state.
- FSDP2 (`torch.distributed.fsdp.fully_shard`) turns each parameter into a DTensor sharded on
  dim 0 over the processes. Each transformer block is one unit: its parameters are gathered
  just before the block runs (forward and backward) and freed after, and its gradients are
  reduce-scattered, so a process holds 1 / world_size of the parameters, gradients and AdamW
  state. The root unit holds what is left: embedding (tied to the LM head), final norm.
  Build the optimizer after `apply_fsdp`: it must see the sharded parameters.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torch_mhc.lm.parallel.env import DistInfo, broadcast_module

__all__ = ["wrap_ddp", "apply_fsdp", "unwrap"]


def _require_group(info: DistInfo, what: str) -> None:
    if not info.distributed:
        raise RuntimeError(
            f"{what} needs a running process group: launch with torchrun and call "
            "init_distributed() first"
        )


def wrap_ddp(model: nn.Module, info: DistInfo, **ddp_kwargs) -> DistributedDataParallel:
    """Move model to info.device and wrap it in DistributedDataParallel.

    DDP broadcasts rank 0's parameters and buffers at construction, so every replica starts
    equal. Extra keyword arguments go to DistributedDataParallel (e.g. bucket_cap_mb).
    """
    _require_group(info, "wrap_ddp")
    model = model.to(info.device)
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)


def apply_fsdp(
    model: nn.Module,
    info: DistInfo,
    reshard_after_forward: bool = True,
    mp_policy=None,
) -> nn.Module:
    """Shard model in place with FSDP2: one unit per transformer block, then the root.

    model must hold its blocks in `model.blocks` (torch_mhc.lm.model.LM does). Rank 0's values
    are broadcast first, so the shards come from one initialisation. reshard_after_forward=True
    frees each block's gathered parameters after its forward (gathered again for backward);
    False keeps them, trading memory for one all-gather per block. mp_policy: an optional
    torch.distributed.fsdp.MixedPrecisionPolicy (e.g. bf16 compute, fp32 reduction).
    Returns the same module, now also an FSDPModule.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _require_group(info, "apply_fsdp")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList | nn.ModuleDict):
        raise TypeError(
            f"apply_fsdp expects a model with its transformer blocks in `.blocks` "
            f"(an nn.ModuleList), got {type(model).__name__} without one"
        )
    model = model.to(info.device)
    broadcast_module(model, src=0)
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    kwargs = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    block_list = blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks
    for block in block_list:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root's parameters (embedding / head, final norm) are needed last in the forward and
    # first in the backward: keeping them gathered after the forward saves one all-gather.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (the module itself otherwise, FSDP2 included)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
