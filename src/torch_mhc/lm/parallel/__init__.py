"""Training on several processes with PyTorch's own engine: DDP, FSDP2, pipelines, checkpoints.

Launch with torchrun; every process runs the same script:

    info = init_distributed()                       # rank, world_size, local_rank, device
    validate_layout(info.world_size, "fsdp", cfg.n_layers, batch_size, micro_batches)

    model = apply_fsdp(LM(cfg), info)               # or wrap_ddp(LM(cfg), info)
    opt = torch.optim.AdamW(param_groups(model))    # after sharding
    x, y = shard_batch(x, info), shard_batch(y, info)    # this rank's half of the global batch
    _, loss = model(x, y); loss.backward(); opt.step()
    save_checkpoint("ckpt", model, opt, extra={"step": step})

    pipe = build_pipeline(cfg, LM(cfg), info, "dualpipev", n_microbatches=8)
    opt = torch.optim.AdamW(param_groups(pipe.module))
    loss = pipe.step(x, y); opt.step()              # the global batch on every rank

Modules: env (process group and small collectives), layout (checks and stage placement),
data_parallel (DDP, FSDP2), checkpoint (DCP: crash-safe, checksummed, loaded without running
pickled code; also the format of single-process runs), pipeline (1F1B, DualPipeV).
"""

from torch_mhc.lm.parallel.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_extra,
    read_state_dict,
    remove_unfinished_save,
    resolve_checkpoint,
    save_checkpoint,
)
from torch_mhc.lm.parallel.data_parallel import apply_fsdp, unwrap, wrap_ddp
from torch_mhc.lm.parallel.env import (
    DistInfo,
    all_reduce_mean,
    barrier,
    broadcast_module,
    destroy_distributed,
    init_distributed,
    is_rank0,
    shard_batch,
)
from torch_mhc.lm.parallel.layout import (
    PARALLEL_MODES,
    SCHEDULES,
    recompute_segments,
    stage_block_ranges,
    stage_to_rank,
    stages_for,
    validate_layout,
)
from torch_mhc.lm.parallel.pipeline import Pipeline, StageModule, build_pipeline, lm_loss

__all__ = [
    "PARALLEL_MODES",
    "CheckpointError",
    "SCHEDULES",
    "DistInfo",
    "Pipeline",
    "StageModule",
    "all_reduce_mean",
    "apply_fsdp",
    "barrier",
    "broadcast_module",
    "build_pipeline",
    "destroy_distributed",
    "init_distributed",
    "is_rank0",
    "lm_loss",
    "load_checkpoint",
    "read_extra",
    "read_state_dict",
    "recompute_segments",
    "remove_unfinished_save",
    "resolve_checkpoint",
    "save_checkpoint",
    "shard_batch",
    "stage_block_ranges",
    "stage_to_rank",
    "stages_for",
    "unwrap",
    "validate_layout",
    "wrap_ddp",
]
