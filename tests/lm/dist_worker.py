"""Worker for tests/lm/test_parallel.py: one training scenario, run by every spawned process.

    torchrun --standalone --nproc-per-node 2 tests/lm/dist_worker.py <scenario> <outdir>
    python tests/lm/dist_worker.py resume <outdir>        # one process, no process group

Each process writes what it measured to <outdir>/<scenario>_rank<r>.pt; the test compares
that with a single-process reference computed by the functions below (`reference_*`), which
the test imports, so both sides use the same model, data and optimizer by construction.

Scenarios: ddp, fsdp (train STEPS steps of AdamW on shards of the global batch), pp_1f1b,
pp_dualpipev (one pipeline step: loss and every gradient, then more steps: losses; a DCP
checkpoint on the way), ckpt_save (FSDP2 on 2 ranks: train, save a DCP checkpoint, keep
training), resume / resume_pp (one process: load the checkpoint into a plain LM, continue).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from torch_mhc.connections import param_groups
from torch_mhc.lm.model import LM, ModelConfig

SEED = 1234
STEPS = 4  # optimizer steps of every loss trajectory
SAVE_AT = 2  # ckpt_save: checkpoint after this many steps
BATCH, SEQ = 4, 16  # data parallel: global batch [4, 16], 2 sequences per rank
PP_BATCH, PP_MICRO = 8, 4  # pipeline: global batch [8, 16] in 4 micro-batches of 2
LR = 1e-2


def make_config(connection: str = "mhc") -> ModelConfig:
    # 4 blocks: DualPipeV on 2 ranks runs 4 stages of 1 block each.
    return ModelConfig(dim=32, n_layers=4, n_heads=2, max_seq_len=SEQ, connection=connection,
                       streams=4)


def make_model(cfg: ModelConfig) -> LM:
    torch.manual_seed(SEED)
    return LM(cfg)


def make_optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(module, weight_decay=0.1), lr=LR, betas=(0.9, 0.95))


def make_batch(step: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: tokens drawn from 32 symbols (learnable in a few steps)."""
    g = torch.Generator().manual_seed(SEED + 1 + step)
    seq = torch.randint(0, 32, (batch, SEQ + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()  # idx, targets [B, T]


# --- single-process references ---------------------------------------------------------------


def reference_losses(connection: str = "mhc", steps: int = STEPS) -> list[float]:
    """Losses of `steps` AdamW steps of the plain LM on the full global batches."""
    model = make_model(make_config(connection))
    opt = make_optimizer(model)
    losses = []
    for step in range(steps):
        x, y = make_batch(step)
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def reference_pipeline(connection: str = "mhc", steps: int = STEPS):
    """What a pipeline step computes, in one process: the PP_BATCH batch in PP_MICRO
    micro-batches, each loss divided by PP_MICRO (gradient accumulation).

    Returns the mean losses per step, the gradients of the first step by parameter name (a
    tied head reported under both names), and the plain forward loss of the first batch after
    the last step (what Pipeline.eval_loss must give).
    """
    model = make_model(make_config(connection))
    opt = make_optimizer(model)
    losses, first_grads = [], None
    for step in range(steps):
        x, y = make_batch(step, PP_BATCH)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xm, ym in zip(x.chunk(PP_MICRO), y.chunk(PP_MICRO), strict=True):
            _, loss = model(xm, ym)
            (loss / PP_MICRO).backward()
            total += loss.item() / PP_MICRO
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            if model.cfg.tie_embeddings:
                first_grads["lm_head.weight"] = first_grads["tok_emb.weight"]
        opt.step()
        losses.append(total)
    with torch.no_grad():
        x, y = make_batch(0, PP_BATCH)
        _, eval_loss = model(x, y)
    return losses, first_grads, eval_loss.item()


# --- the scenarios ---------------------------------------------------------------------------


def run_data_parallel(mode: str, info, out: dict, save_dir: Path | None = None) -> None:
    from torch_mhc.lm.parallel import (
        all_reduce_mean,
        apply_fsdp,
        save_checkpoint,
        shard_batch,
        wrap_ddp,
    )

    model = make_model(make_config())
    model = wrap_ddp(model, info) if mode == "ddp" else apply_fsdp(model, info)
    opt = make_optimizer(model)
    if save_dir is not None:
        # The test made <outdir>/not_a_dir a file: rank 0 cannot create the checkpoint folder
        # under it, and every rank must hear so (an error, not a hang in a collective).
        try:
            save_checkpoint(save_dir.parent / "not_a_dir" / "ckpt", model, opt)
        except Exception as e:
            out["bad_save_error"] = f"{type(e).__name__}: {e}"
    losses = []
    for step in range(STEPS):
        if save_dir is not None and step == SAVE_AT:
            save_checkpoint(save_dir, model, opt, extra={"step": step})
        x, y = make_batch(step)
        opt.zero_grad(set_to_none=True)
        _, loss = model(shard_batch(x, info), shard_batch(y, info))
        loss.backward()
        opt.step()
        losses.append(all_reduce_mean(loss).item())
    out["losses"] = losses


def run_pipeline(schedule: str, info, out: dict, save_dir: Path) -> None:
    from torch_mhc.lm.parallel import build_pipeline, save_checkpoint

    cfg = make_config()
    pipe = build_pipeline(cfg, make_model(cfg), info, schedule=schedule, n_microbatches=PP_MICRO)
    opt = make_optimizer(pipe.module)
    losses = []
    for step in range(STEPS):
        if step == SAVE_AT:
            save_checkpoint(save_dir, pipe.module, opt, extra={"step": step})
        x, y = make_batch(step, PP_BATCH)
        opt.zero_grad(set_to_none=True)
        losses.append(pipe.step(x, y).item())
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in pipe.named_parameters()}
            # max_norm far above the norm: the clip multiplies by exactly 1.0, the norm is kept.
            out["grad_norm"] = pipe.clip_grad_norm_(1e9).item()
        opt.step()
    out["losses"] = losses
    out["eval_loss"] = pipe.eval_loss(*make_batch(0, PP_BATCH)).item()

    # Accumulating two steps without zeroing gives twice one step's gradients (the tied
    # matrix included: each step's part is summed across its copies once).
    x, y = make_batch(0, PP_BATCH)
    opt.zero_grad(set_to_none=True)
    pipe.step(x, y)
    once = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    opt.zero_grad(set_to_none=True)
    pipe.step(x, y)
    pipe.step(x, y)
    out["accumulation_error"] = max(
        ((p.grad - 2 * once[n]).abs().max() / (2 * once[n]).abs().max()).item()
        for n, p in pipe.named_parameters()
    )
    out["stages"] = [s.stage_index for s in pipe.stages]
    out["stage_ranges"] = pipe.stage_ranges


def run_resume(save_dir: Path, batch: int, info, out: dict) -> None:
    from torch_mhc.lm.parallel import load_checkpoint

    model = make_model(make_config())
    with torch.no_grad():  # a different starting point: everything must come from the file
        for p in model.parameters():
            p.add_(1.0)
    opt = make_optimizer(model)
    extra = load_checkpoint(save_dir, model, opt)
    losses = []
    for step in range(extra["step"], STEPS):
        x, y = make_batch(step, batch)
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out["losses"] = losses
    out["extra"] = extra


def main(scenario: str, outdir: str) -> None:
    from torch_mhc.lm.parallel import destroy_distributed, init_distributed

    torch.set_num_threads(1)  # two processes on a small shared machine
    outdir_p = Path(outdir)
    info = init_distributed()
    out: dict = {"world_size": info.world_size}
    try:
        if scenario in ("ddp", "fsdp"):
            run_data_parallel(scenario, info, out)
        elif scenario == "ckpt_save":
            run_data_parallel("fsdp", info, out, save_dir=outdir_p / "ckpt")
        elif scenario in ("pp_1f1b", "pp_dualpipev"):
            run_pipeline(scenario.removeprefix("pp_"), info, out, save_dir=outdir_p / "ckpt")
        elif scenario == "resume":
            run_resume(outdir_p / "ckpt", BATCH, info, out)
        elif scenario == "resume_pp":
            run_resume(outdir_p / "ckpt", PP_BATCH, info, out)
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
        torch.save(out, outdir_p / f"{scenario}_rank{info.rank}.pt")
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
