"""The process group: start it from torchrun's environment, and the small collectives around it.

torchrun (`python -m torch.distributed.run`) starts one process per device and tells each who it
is through environment variables: RANK (global index), WORLD_SIZE (number of processes),
LOCAL_RANK (index on this machine) and MASTER_ADDR / MASTER_PORT (the rendezvous).
`init_distributed` reads them, picks the device (cuda:LOCAL_RANK on a GPU machine, else the CPU)
and the backend (NCCL for CUDA, gloo for the CPU) and starts the default process group.
Started without torchrun it does nothing and describes a single process, so the same training
script runs both ways.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DistInfo",
    "init_distributed",
    "destroy_distributed",
    "is_rank0",
    "barrier",
    "all_reduce_mean",
    "shard_batch",
    "broadcast_module",
]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistInfo:
    """Who this process is: global rank, number of processes, rank on this machine, device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        """True when a process group is running (launched by torchrun, even with one process)."""
        return dist.is_available() and dist.is_initialized()

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def _default_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def init_distributed(
    backend: str | None = None,
    device: str | torch.device | None = None,
    timeout: timedelta | None = None,
) -> DistInfo:
    """Start the default process group from torchrun's environment and return this process's
    DistInfo; without torchrun (no WORLD_SIZE in the environment) start nothing and return
    DistInfo(0, 1, 0, device).

    backend: None picks "nccl" for a CUDA device and "gloo" otherwise. device: None picks
    cuda:LOCAL_RANK when CUDA is available, else the CPU; pass "cpu" to run gloo on a GPU machine.
    Calling it again once the group is running returns the same description.
    """
    if "WORLD_SIZE" not in os.environ:
        dev = torch.device(device) if device is not None else _default_device(0)
        return DistInfo(rank=0, world_size=1, local_rank=0, device=dev)

    missing = [name for name in _TORCHRUN_VARS if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE is set but {missing} are not: launch with torchrun "
            f"(python -m torch.distributed.run), which sets all of {list(_TORCHRUN_VARS)}"
        )
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK")
    if not 0 <= rank < world_size:
        raise RuntimeError(f"RANK must lie in [0, WORLD_SIZE = {world_size}), got {rank}")

    dev = torch.device(device) if device is not None else _default_device(local_rank)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        # NCCL binds a communicator to the current device: set it before the group starts.
        torch.cuda.set_device(dev)
    if backend is None:
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError(f"the NCCL backend needs a CUDA device, got device {dev}")

    if not dist.is_initialized():
        kwargs = {"backend": backend, "rank": rank, "world_size": world_size}
        if timeout is not None:
            kwargs["timeout"] = timeout
        if backend == "nccl":
            kwargs["device_id"] = dev  # binds the group to our GPU at once (no lazy guessing)
        dist.init_process_group(**kwargs)
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(
            f"a process group is already running as rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, but the environment says rank {rank} of {world_size}"
        )
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def destroy_distributed() -> None:
    """Wait for every process, then stop the default process group (safe to call in any case).

    Call it at the end of a run. The barrier keeps a fast rank from closing its connections
    while a slow one still talks to it. The pause works around a race in gloo (torch 2.13, 2.14,
    pytorch/pytorch#190489): a gloo worker thread may still be releasing the tensors of the
    last collective, which needs the GIL; if the interpreter is already shutting down it
    aborts the process ("terminate called without an active exception") after all the work
    is done. Sleeping releases the GIL so that thread can finish first.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        time.sleep(0.05)
        dist.destroy_process_group()


def is_rank0() -> bool:
    """True on the process that logs and draws progress: global rank 0, or a single process."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def barrier() -> None:
    """Wait for every process (nothing to wait for in a single process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_mean(value: torch.Tensor | float) -> torch.Tensor:
    """The mean of a scalar (or tensor) over all processes, returned on every process.

    For logging: each data-parallel rank holds the loss of its own part of the batch; their mean
    is the loss of the global batch when the parts have equal sizes. Returns a detached tensor.
    """
    t = torch.as_tensor(value).detach().clone()
    if dist.is_available() and dist.is_initialized():
        # A detached copy on the group's device (NCCL reduces CUDA tensors only).
        if dist.get_backend() == "nccl" and t.device.type != "cuda":
            t = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t = t / dist.get_world_size()
    return t


def shard_batch(batch: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """This rank's contiguous part of a global batch [B, ...] -> [B / world_size, ...].

    Data parallelism: every rank draws the same global batch (same sampler seed) and keeps its
    own slice, so the union of the slices is exactly the single-process batch.
    """
    B = batch.shape[0]
    if B % info.world_size != 0:
        raise ValueError(
            f"global batch size {B} is not divisible by the world size {info.world_size}"
        )
    per_rank = B // info.world_size
    return batch[info.rank * per_rank : (info.rank + 1) * per_rank]


@torch.no_grad()
def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Overwrite every parameter and buffer with rank src's values (no-op in a single process).

    Makes the ranks start from one initialisation even if they were seeded differently; FSDP2
    and the pipeline split (which copies a tied embedding) rely on that, DDP does it itself.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    seen: set[int] = set()
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) in seen:  # a tied weight is one tensor: send it once
            continue
        seen.add(id(t))
        dist.broadcast(t.data, src=src)
