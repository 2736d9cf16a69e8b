"""Worker for test_torchtitan_parallel.py: the mHC llama3 debug model trained a few
steps under one torchtitan parallelism, on gloo processes.

    torchrun --standalone --nproc-per-node 2 tests/integrations/titan_worker.py <scenario> <outdir>
    python tests/integrations/titan_worker.py single <outdir>       # the one-process reference

Scenarios: single; fsdp (FSDP2 over 2 ranks and torchtitan's per-block compile, with a DCP
checkpoint saved after SAVE_AT steps and resumed into a differently initialised model); tp
(TP2 with sequence parallel; the connection parameters returned); pp (two pipeline stages,
1F1B); fsdp_bf16 (FSDP with bf16 parameters: step-0 losses of converted and unconverted
models; a meta-device build initialised after sharding). Every scenario builds the same model
(`titan_support`), initialises it on the CPU with one seed, applies torchtitan's own
parallelize / pipeline functions (with selective activation checkpointing), then takes STEPS
AdamW steps on fixed token batches; rank r writes <outdir>/<scenario>_rank<r>.pt.

A small shim lets torchtitan 0.3.0 run on CPU processes: its device type falls back to "cuda"
without an accelerator (`cpu_shim`), and FSDP's PREMUL_SUM, which gloo lacks, becomes the
equal plain SUM (`gloo_sum_reduction`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.helpers
from tests.helpers import titan_support as S  # noqa: E402

STEPS = 3
SAVE_AT = 1  # fsdp: a DCP checkpoint before this step, resumed after the run
LR = 3e-3
GLOBAL_BATCH, SEQ = 4, 32
MICROBATCHES = 2  # pipeline


def cpu_shim() -> None:
    """Point torchtitan's device type at the CPU (it assumes CUDA without an accelerator)."""
    import torchtitan.distributed.parallel_dims as pd
    import torchtitan.tools.utils as tu

    pd.device_type = tu.device_type = "cpu"


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch of one step: tokens [B, T] and next-token labels [B, T]."""
    g = torch.Generator().manual_seed(100 + step)
    seq = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def build_initialised(trainer_like=None, seed: int = S.SEED, kind: str | None = "mhc",
                      fp32: bool = True):
    """The converted llama3 debug model, built and initialised on the CPU (not meta): every
    parallel layout then starts from the very same weights as the single process. With a
    trainer-like config, torchtitan first declares every module's placements, as its trainer
    does before building."""
    cfg = S.model_config("llama3", kind, fp32=fp32)
    if trainer_like is not None:
        cfg.update_from_config(config=trainer_like)
    return S.build(cfg, seed)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def run_single() -> list[float]:
    # The same configuration steps as the parallel runs (RoPE sized for SEQ, placements
    # declared but unused without a mesh).
    training, parallelism, _ = parallel_configs("single")
    model = build_initialised(_TrainerLike(training, parallelism))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        tok, labels = batch(step)
        opt.zero_grad()
        loss = loss_fn(model(tok), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def parallel_dims(scenario: str, world: int):
    from torchtitan.distributed import ParallelDims

    # Imported for its side effect: torchtitan's model code registers the "fake" process
    # group backend that build_mesh uses for size-1 mesh axes.
    from torchtitan.models.llama3 import parallelize_llama  # noqa: F401

    degrees = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1)
    degrees[{"fsdp": "dp_shard", "fsdp_bf16": "dp_shard", "tp": "tp", "pp": "pp"}[scenario]] = world
    dims = ParallelDims(**degrees, world_size=world)
    dims.build_mesh()
    return dims


def parallel_configs(scenario: str):
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    # FSDP computes in float32, but in fsdp_bf16 (torchtitan's default bf16 parameters).
    param_dtype = "bfloat16" if scenario == "fsdp_bf16" else "float32"
    training = TrainingConfig(local_batch_size=GLOBAL_BATCH, seq_len=SEQ, steps=STEPS,
                              mixed_precision_param=param_dtype,
                              mixed_precision_reduce="float32")
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=2 if scenario.startswith("fsdp") else 1,
        tensor_parallel_degree=2 if scenario == "tp" else 1,
        enable_sequence_parallel=scenario == "tp",
        pipeline_parallel_degree=2 if scenario == "pp" else 1,
        pipeline_parallel_schedule="1F1B",
        pipeline_parallel_microbatch_size=GLOBAL_BATCH // MICROBATCHES,
    )
    # fsdp: torchtitan's per-block compile (fullgraph; the aot_eager backend, since inductor
    # would take minutes on 2 CPU cores), hence connections without float32 units (blocks.py).
    compile_config = CompileConfig(enable=scenario == "fsdp", backend="aot_eager",
                                   components=["model"])
    return training, parallelism, compile_config


def run_parallel(scenario: str, outdir: Path) -> dict:
    import torch.distributed as dist
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_spmd_backend("spmd_types")  # torchtitan's default, as its trainer sets it
    dims = parallel_dims(scenario, dist.get_world_size())
    training, parallelism, compile_config = parallel_configs(scenario)
    trainer_like = _TrainerLike(training, parallelism)
    if scenario == "pp":
        model = build_initialised(trainer_like)
        return {"losses": run_pipeline(model, dims, training, parallelism, compile_config)}
    if scenario == "fsdp_bf16":
        return run_bf16(dims, trainer_like)
    fp32 = scenario != "fsdp"  # see parallel_configs
    model, opt = parallelized(scenario, dims, build_initialised(trainer_like, fp32=fp32))
    ckpt = outdir / "ckpt" if scenario == "fsdp" else None
    out = {"losses": train(scenario, model, opt, range(STEPS), save_to=ckpt)}
    if scenario == "tp":
        # Replicated over TP: every rank must hold the same connection parameters after
        # training (their gradients, from each rank's sequence shard, are reduced over TP).
        out["connections"] = {_plain_name(n): _local(p).detach().clone()
                              for n, p in model.named_parameters() if "_hc." in n}
    if ckpt is not None:  # resume: other weights, then everything from the checkpoint
        model, opt = parallelized(scenario, dims,
                                  build_initialised(trainer_like, seed=99, fp32=fp32))
        load(ckpt, model, opt)
        out["resumed"] = train(scenario, model, opt, range(SAVE_AT, STEPS))
    return out


def run_bf16(dims, trainer_like) -> dict:
    """Step-0 losses of the converted and the unconverted model under FSDP with bf16
    parameters, with the connections in float32 FSDP units (fp32=True, the default) and in
    their block's bf16 unit (fp32=False); and the dtype a connection computes in."""
    tok, labels = batch(0)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    tok, labels = tok.chunk(world)[rank], labels.chunk(world)[rank]
    out = {}
    for units in ("fp32", "bf16"):
        for kind in ("mhc", None):
            model, _ = parallelized("fsdp_bf16", dims, build_initialised(
                trainer_like, kind=kind, fp32=units == "fp32"))
            seen = []
            if kind is not None:
                conn = model.layers["0"]._checkpoint_wrapped_module.attention_hc
                conn.register_forward_pre_hook(
                    lambda m, a, seen=seen: seen.append(m.b_pre.dtype))
            with torch.no_grad(), spmd_region(dims, tok, labels) as (t, y):
                loss = loss_fn(model(t), y)
            torch.distributed.all_reduce(loss)
            out[f"{units}_{kind}"] = (loss / world).item()
            if seen:
                out[f"{units}_dtype"] = str(seen[0])
    out["meta_init_mismatch"] = meta_init_mismatch(dims, trainer_like)
    return out


def meta_init_mismatch(dims, trainer_like) -> list[str]:
    """torchtitan's own order: build on the meta device, parallelize (connections sharded
    over the 2 ranks as float32 FSDP units), to_empty, init_states. The names of connection
    parameters whose gathered values differ from an eagerly built model's."""
    from torch.distributed.tensor import DTensor

    cfg = S.model_config("llama3", "mhc")
    cfg.update_from_config(config=trainer_like)
    with torch.device("meta"):
        model = cfg.build()
    model, _ = parallelized("fsdp_bf16", dims, model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    eager = build_initialised(trainer_like).state_dict()
    bad = []
    for name, p in model.named_parameters():
        if "_hc." in name:
            assert isinstance(p, DTensor), name  # really sharded
            if not torch.equal(p.full_tensor(), eager[_plain_name(name)]):
                bad.append(name)
    return bad


def _plain_name(name: str) -> str:
    """A parameter name without activation checkpointing's wrapper module."""
    return name.replace("._checkpoint_wrapped_module", "")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def parallelized(scenario: str, dims, model):
    """torchtitan's parallelize_llama (TP plan, selective activation checkpointing as in
    its debug configuration, FSDP2) on an initialised model, and AdamW."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.llama3 import parallelize_llama

    training, parallelism, compile_config = parallel_configs(scenario)
    model = parallelize_llama(model, parallel_dims=dims, training=training,
                              parallelism=parallelism, compile_config=compile_config,
                              ac_config=SelectiveAC.Config(), dump_folder="/tmp")
    gloo_sum_reduction(model)
    model.parallel_dims_for_test = dims
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def train(scenario: str, model, opt, steps, save_to: Path | None = None) -> list[float]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        if save_to is not None and step == SAVE_AT:
            save(save_to, model, opt)
        tok, labels = batch(step)
        if scenario == "fsdp":  # each rank its half of the global batch
            tok, labels = tok.chunk(world)[rank], labels.chunk(world)[rank]
        opt.zero_grad()
        with spmd_region(model.parallel_dims_for_test, tok, labels) as (tok, labels):
            out = model(tok)
            if scenario == "tp":
                out = gather_vocab(out)
            loss = loss_fn(out, labels)
            # torchtitan has FSDP sum the gradients (its trainer divides the loss by the
            # global token count): each rank's mean over half the tokens counts half.
            (loss / world if scenario == "fsdp" else loss).backward()
        opt.step()
        if scenario == "fsdp":
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses


@contextlib.contextmanager
def spmd_region(dims, tok, labels):
    """What torchtitan's trainer wraps each step in: the current SPMD mesh (without it no
    TP collective runs: partial sums stay partial) and the inputs' SPMD types."""
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.distributed.utils import get_spmd_context

    with get_spmd_context(parallel_dims=dims)():
        tok, labels, _ = annotate_input_spmd_types(dims, tok, labels, {})
        yield tok, labels


def save(path: Path, model, opt) -> None:
    """A DCP checkpoint of the sharded model and optimizer. The model goes through
    torchtitan's ModelWrapper, as its CheckpointManager does (fused QKV weights are stored
    split into wq / wk / wv by a state-dict hook)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torchtitan.components.checkpoint import ModelWrapper

    state = {"model": ModelWrapper(model).state_dict(),
             "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=str(path))


def load(path: Path, model, opt) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torchtitan.components.checkpoint import ModelWrapper

    from torch_mhc.integrations.torchtitan import check_checkpoint_keys

    check_checkpoint_keys(path, model)  # both have connections: passes
    wrapper = ModelWrapper(model)
    state = {"model": wrapper.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=str(path))
    wrapper.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def run_pipeline(model, dims, training, parallelism, compile_config) -> list[float]:
    """torchtitan's pipeline_llm splits the model into 2 stages (layers 0-2 with the
    embedding and the expansion to streams, layers 3-5 with the reduction, norm and head)
    and runs 1F1B over MICROBATCHES micro-batches; the last stage broadcasts the losses."""
    import torch.distributed as dist
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import parallelize_llama

    def pp_loss(pred, labels, global_valid_tokens):
        ce = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
        return ce / global_valid_tokens, None  # summed over micro-batches: the mean

    schedule, parts, first, last = pipeline_llm(
        model, parallel_dims=dims, training=training, parallelism=parallelism,
        compile_config=compile_config, ac_config=SelectiveAC.Config(), dump_folder="/tmp",
        device=torch.device("cpu"), model_config=model.config,
        parallelize_fn=parallelize_llama, loss_fn=pp_loss)
    for part in parts:
        gloo_sum_reduction(part)
    opt = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=LR)
    losses = []
    for step in range(STEPS):
        tok, labels = batch(step)
        opt.zero_grad()
        step_losses = [] if last else None
        with spmd_region(dims, tok, labels) as (tok, labels):
            schedule.step(
                arg_mbs=[(t,) for t in tok.chunk(MICROBATCHES)] if first else None,
                kwarg_mbs=[{} for _ in range(MICROBATCHES)],
                target_mbs=list(labels.chunk(MICROBATCHES)) if last else None,
                losses=step_losses, loss_kwargs={"global_valid_tokens": labels.numel()},
                return_outputs=False)
        opt.step()
        loss = torch.stack(step_losses).sum() if last else torch.zeros(())
        dist.broadcast(loss, src=dist.get_world_size() - 1)
        losses.append(loss.item())
    return losses


def gather_vocab(local: torch.Tensor) -> torch.Tensor:
    """TP leaves lm_head's logits sharded over the vocabulary (local [B, T, V / tp]); the
    whole logits [B, T, V], with a backward that hands each rank its shard's gradient."""
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(local.contiguous()), dim=-1)


def gloo_sum_reduction(model) -> None:
    """torchtitan asks FSDP for a gradient divide factor of 1, which FSDP sends as
    ReduceOp.PREMUL_SUM(1.0); gloo has no PREMUL_SUM. A plain SUM is the same reduction."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


class _TrainerLike:
    """What Decoder.Config.update_from_config reads from a trainer config."""

    def __init__(self, training, parallelism):
        self.training, self.parallelism = training, parallelism


def main(scenario: str, outdir: str) -> None:
    torch.set_num_threads(1)
    cpu_shim()
    if scenario == "single":
        out = {"losses": run_single()}
        rank = 0
    else:
        import torch.distributed as dist

        from torch_mhc.lm.parallel import destroy_distributed

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        try:
            out = run_parallel(scenario, Path(outdir))
        except BaseException:
            dist.destroy_process_group()  # no barrier: the other rank may never reach one
            raise
        # Not a bare destroy_process_group: torchtitan's groups outlive it, and a gloo thread
        # still freeing the last collective's tensors when the interpreter exits aborts the
        # process after all its work is done (see destroy_distributed).
        destroy_distributed()
    torch.save(out, Path(outdir) / f"{scenario}_rank{rank}.pt")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], sys.argv[2])
