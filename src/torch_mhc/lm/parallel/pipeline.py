"""Pipeline parallelism for the reference LM with torch.distributed.pipelining (1F1B, DualPipeV).

The LM is cut between transformer blocks into stages of equal block counts; what crosses a
boundary is the streams tensor x [b, T, n, C] of one micro-batch, n times the width of a
plain residual network's activation (the pipeline cost the paper hides with DualPipe):

    stage 0:      idx [b, T] -> tok_emb -> expand_streams -> its blocks   -> x [b, T, n, C]
    middle:       x [b, T, n, C]          -> its blocks                   -> x [b, T, n, C]
    last stage:   x [b, T, n, C] -> its blocks -> reduce_streams -> norm_f -> lm_head
                                                                          -> logits [b, T, V]
    loss_fn(logits, targets) on the last stage: mean cross-entropy of the micro-batch.

Schedules. 1F1B runs one stage per process. DualPipeV (DeepSeek-V3's DualPipe folded into a
V) runs two per process: rank r holds stages r and 2 * world - 1 - r, so rank 0 holds both the
embedding and the head, and forward chunks of one micro-batch overlap backward chunks of
another. Both need at least as many micro-batches as stages.

Exactness. Each micro-batch loss is a mean, divided by the number of micro-batches M before
its backward pass, so one `Pipeline.step` computes the gradient of the mean loss over the
global batch exactly as one process accumulating `(loss / M).backward()` over the same
micro-batches does (tokens ignored with -1 would weight micro-batches unequally: the
micro-batch means are averaged with equal weights). The schedules' own `scale_grads` (divide
every gradient by M after the step) is off: it would also divide gradients accumulated by
earlier steps, so accumulating over several `step` calls would go wrong.

Tied embeddings. With `tie_embeddings` the input embedding (stage 0) and the LM head (last
stage) are one matrix in the LM. Here the last stage holds a copy; after the backward pass the
two gradients are summed (an all-reduce between the two ranks, or a local sum when DualPipeV
puts both on rank 0), so both copies take identical optimizer steps and stay equal. A copy
even when both stages sit on one rank: one code path for every placement, and no parameter
shared between two stage modules for the schedule to reason about.

Names. Stage modules keep the LM's attribute names (`tok_emb`, `blocks.<i>`, `norm_f`,
`lm_head`), and `Pipeline.module` gathers this rank's stages under those names, so optimizer
parameter groups, checkpoints and gradients line up with the single-process model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torch_mhc.connections import expand_streams, reduce_streams
from torch_mhc.lm.model import LM, ModelConfig, recompute_context, rope_angles
from torch_mhc.lm.parallel.env import DistInfo, broadcast_module
from torch_mhc.lm.parallel.layout import SCHEDULES, stage_block_ranges, stage_to_rank, stages_for

__all__ = ["StageModule", "Pipeline", "build_pipeline", "lm_loss"]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in nats of logits [b, T, V] against targets [b, T] (-1 = ignore),
    computed in fp32 as LM.forward does."""
    V = logits.shape[-1]
    return F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1), ignore_index=-1)


class StageModule(nn.Module):
    """One pipeline stage of the LM: blocks [start, end), plus the embedding on the first stage
    and the head on the last. Parameter names are the LM's (`blocks.<i>.attn.phi`, ...)."""

    def __init__(
        self,
        cfg: ModelConfig,
        stage_index: int,
        n_stages: int,
        block_range: tuple[int, int],
        blocks: nn.ModuleList,
        tok_emb: nn.Embedding | None = None,
        norm_f: nn.Module | None = None,
        lm_head: nn.Linear | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.stage_index, self.n_stages = stage_index, n_stages
        self.block_range = block_range
        self.is_first, self.is_last = stage_index == 0, stage_index == n_stages - 1
        if self.is_first != (tok_emb is not None):
            raise ValueError("the embedding belongs to stage 0 and only there")
        if self.is_last != (norm_f is not None and lm_head is not None):
            raise ValueError(
                "the final norm and the LM head belong to the last stage and only there"
            )
        start, end = block_range
        if self.is_first:
            self.tok_emb = tok_emb
        # A ModuleDict keyed by the global block index keeps the LM's names: blocks.<i>.
        self.blocks = nn.ModuleDict({str(i): blocks[i] for i in range(start, end)})
        if self.is_last:
            self.norm_f, self.lm_head = norm_f, lm_head

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """First stage: idx [b, T]; later stages: x [b, T, n, C]. Returns x [b, T, n, C], or
        logits [b, T, V] on the last stage."""
        if self.is_first:
            x = expand_streams(self.tok_emb(inp), self.cfg.n_streams)  # [b, T, n, C]
        else:
            x = inp  # [b, T, n, C]
        T = x.shape[1]
        cos, sin = rope_angles(0, T, self.cfg.head_dim, self.cfg.rope_base, x.device)
        with recompute_context(self.cfg, self.training, len(self.blocks)):
            for block in self.blocks.values():
                x = block(x, cos, sin)  # [b, T, n, C]
        if self.is_last:
            return self.lm_head(self.norm_f(reduce_streams(x, self.cfg.n_streams)))  # [b, T, V]
        # Sent to the next stage as one buffer. A block may return a view (a matmul's reshape),
        # and the zero-bubble backward of DualPipeV detaches stage outputs in place, which a
        # view refuses: hand over a tensor of our own (one copy of [b, T, n, C]).
        return x.clone(memory_format=torch.contiguous_format) if x._is_view() else x.contiguous()

    def extra_repr(self) -> str:
        return (f"stage {self.stage_index} of {self.n_stages}, blocks "
                f"[{self.block_range[0]}, {self.block_range[1]})")


class _LocalParams(nn.Module):
    """This rank's stages under the LM's names (for optimizers, param_groups, checkpoints).

    It owns nothing new: it registers the stages' own submodules a second time.
    """

    def __init__(self, stages: list[StageModule]):
        super().__init__()
        self.blocks = nn.ModuleDict()
        for st in stages:
            if st.is_first:
                self.tok_emb = st.tok_emb
            for name, block in st.blocks.items():
                self.blocks[name] = block
            if st.is_last:
                self.norm_f, self.lm_head = st.norm_f, st.lm_head


class Pipeline:
    """This rank's part of a pipeline: its stage modules and the schedule that runs them.

    Every rank calls `step(idx, targets)` with the same global batch (the first stage reads idx,
    the last reads targets); it returns the mean loss of the global batch on every rank and
    leaves the gradients in this rank's parameters (`parameters()`, or `module` for names).
    """

    def __init__(self, stages, schedule, info, stage_ranges, ranks, tied_group, tied, loss_fn):
        self.stages: list[StageModule] = stages
        self.schedule = schedule
        self.info: DistInfo = info
        self.stage_ranges: list[tuple[int, int]] = stage_ranges  # stage -> blocks [start, end)
        self.stage_to_rank: dict[int, int] = ranks
        self.module = _LocalParams(stages)
        self.n_microbatches: int = schedule._n_microbatches
        self._tied, self._tied_group = tied, tied_group
        self._loss_fn = loss_fn
        cfg = stages[0].cfg
        self._n_streams, self._dim = cfg.n_streams, cfg.dim
        self._first = next((s for s in stages if s.is_first), None)
        self._last = next((s for s in stages if s.is_last), None)
        self._last_rank = ranks[len(stage_ranges) - 1]

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()

    def _check_batch(self, idx: torch.Tensor, targets: torch.Tensor | None) -> None:
        if idx.dim() != 2:
            raise ValueError(f"Pipeline.step expects idx [B, T], got {tuple(idx.shape)}")
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(
                f"targets must have idx's shape {tuple(idx.shape)}, got {tuple(targets.shape)}"
            )
        if idx.shape[0] % self.n_microbatches != 0:
            raise ValueError(
                f"batch size {idx.shape[0]} is not divisible into {self.n_microbatches} "
                "micro-batches"
            )

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the global batch idx, targets [B, T] over the micro-batches.

        Gradients accumulate into this rank's parameters (zero them before, step the optimizer
        after, as in a single process). Returns the mean loss (fp32 scalar) on every rank.
        """
        self._check_batch(idx, targets)
        dev = self.info.device
        args = (idx.to(dev),) if self._first is not None else ()
        target = targets.to(dev) if self._last is not None else None
        losses: list[torch.Tensor] | None = [] if self._last is not None else None
        tied_before = self._tied_grads_before_step()
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        self._sync_tied_grads(tied_before)
        if self._last is not None:  # each is a micro-batch mean already divided by M
            loss = torch.stack([x.detach().float() for x in losses]).sum()
        else:
            loss = torch.zeros((), device=dev)
        dist.broadcast(loss, src=self._last_rank)  # every rank learns the loss (rank 0 logs)
        return loss

    @torch.no_grad()
    def eval_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of idx, targets [B, T], forward only; returned on every rank.

        Runs the micro-batches one after another through the stages in stage order with
        plain send / recv, not through the schedule: torch 2.13's DualPipeV cannot run
        forward-only (`schedule.eval` fails asserting on a backward action), and evaluation
        needs no overlap.
        """
        self._check_batch(idx, targets)
        dev, rank, where = self.info.device, self.info.rank, self.stage_to_rank
        local = {s.stage_index: s for s in self.stages}
        n_stages, M = len(self.stage_ranges), self.n_microbatches
        dtype = next(self.module.parameters()).dtype
        total = torch.zeros((), device=dev, dtype=torch.float32)
        for xm, ym in zip(idx.chunk(M), targets.chunk(M), strict=True):
            b, T = xm.shape
            carry = None  # a stage output handed to the next stage on this same rank
            for s in range(n_stages):
                if where[s] != rank:
                    continue
                if s == 0:
                    inp = xm.to(dev)
                elif where[s - 1] == rank:
                    inp = carry
                else:
                    inp = torch.empty(b, T, self._n_streams, self._dim, device=dev, dtype=dtype)
                    dist.recv(inp, src=where[s - 1])  # [b, T, n, C]
                out = local[s](inp)
                if s == n_stages - 1:
                    total += self._loss_fn(out, ym.to(dev)).float()
                elif where[s + 1] == rank:
                    carry = out
                else:
                    dist.send(out, dst=where[s + 1])
        loss = total / M
        dist.broadcast(loss, src=self._last_rank)
        return loss

    def _tied_params(self) -> list[nn.Parameter]:
        """This rank's copies of the tied matrix: the embedding, the head, both or none."""
        if not self._tied:
            return []
        mine = [self._first.tok_emb.weight] if self._first is not None else []
        if self._last is not None:
            mine.append(self._last.lm_head.weight)
        return mine

    @torch.no_grad()
    def _tied_grads_before_step(self) -> torch.Tensor | None:
        """The tied gradient already accumulated (and synchronised) before this step, if any:
        gradients accumulated over several steps must not have it summed twice."""
        mine = self._tied_params()
        if not mine or mine[0].grad is None:
            return None
        return mine[0].grad.clone()

    @torch.no_grad()
    def _sync_tied_grads(self, before: torch.Tensor | None) -> None:
        """Sum this step's gradients of the embedding (stage 0) and of its copy in the head."""
        mine = self._tied_params()
        if not mine:
            return
        steps = []
        for p in mine:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            steps.append(g if before is None else g - before)  # this step's part
        total = steps[0].clone() if len(steps) == 1 else steps[0] + steps[1]
        if self._tied_group is not None:
            dist.all_reduce(total, group=self._tied_group)
        if before is not None:
            total = before + total
        for p in mine:
            p.grad = total.clone() if len(mine) > 1 else total

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients of the whole pipeline by their global 2-norm; return that norm.

        As torch.nn.utils.clip_grad_norm_ on the single-process model: the norm is over every
        parameter once (the tied LM head copy is not counted twice), summed over all ranks.
        """
        params = [p for n, p in self.module.named_parameters()
                  if p.grad is not None and not (self._tied and n == "lm_head.weight")]
        sq = torch.zeros((), device=self.info.device, dtype=torch.float32)
        for p in params:
            sq += p.grad.detach().float().pow(2).sum()
        dist.all_reduce(sq)
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
        return total


def build_pipeline(
    model_cfg: ModelConfig,
    model: LM | dict | None,
    info: DistInfo,
    schedule: str = "1f1b",
    n_microbatches: int | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
) -> Pipeline:
    """Split the LM into stages, keep this rank's, and build the schedule; every rank calls it.

    model: an LM built from model_cfg, its state_dict, or None for a fresh LM(model_cfg). Every
    rank builds the whole model once, rank 0's values are broadcast (one initialisation
    everywhere), then the rank keeps only its stages. schedule: "1f1b" | "dualpipev".
    n_microbatches: micro-batches per step (>= number of stages; default: the number of stages).
    loss_fn(logits [b, T, V], targets [b, T]) -> mean loss of one micro-batch.
    """
    from torch.distributed.pipelining import Schedule1F1B, ScheduleDualPipeV

    n_stages, n_microbatches = _check_pipeline(model_cfg, info, schedule, n_microbatches)
    ranges = stage_block_ranges(model_cfg.n_layers, n_stages)  # ValueError if uneven
    model = _whole_model(model_cfg, model, info)
    ranks = stage_to_rank(info.world_size, schedule)
    tied_group = _tied_head_group(model_cfg, info, ranks, n_stages)
    stage_mods, pipe_stages = _my_stages(model_cfg, model, info, ranks, ranges)

    def scaled_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, targets) / n_microbatches  # see "Exactness" above

    kw = {"n_microbatches": n_microbatches, "loss_fn": scaled_loss, "scale_grads": False}
    if schedule == "1f1b":
        sched = Schedule1F1B(pipe_stages[0], **kw)
    else:
        sched = ScheduleDualPipeV(pipe_stages, **kw)
    return Pipeline(stage_mods, sched, info, ranges, ranks, tied_group,
                    model_cfg.tie_embeddings, loss_fn)


def _check_pipeline(model_cfg: ModelConfig, info: DistInfo, schedule: str,
                    n_microbatches: int | None) -> tuple[int, int]:
    """(stages, micro-batches) of the pipeline, after checking the layout can run it."""
    if not info.distributed:
        raise RuntimeError(
            "build_pipeline needs a running process group: launch with torchrun and call "
            "init_distributed() first"
        )
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    n_stages = stages_for(info.world_size, schedule)
    if info.world_size < 2:
        raise ValueError("pipeline parallelism needs at least 2 processes, got world_size 1")
    if n_microbatches is None:
        n_microbatches = n_stages
    if n_microbatches < n_stages:
        raise ValueError(
            f"schedule {schedule!r} needs n_microbatches >= {n_stages} stages, got {n_microbatches}"
        )
    return n_stages, n_microbatches


def _whole_model(model_cfg: ModelConfig, model: LM | dict | None, info: DistInfo) -> LM:
    """The whole LM on info.device with rank 0's values (one initialisation everywhere)."""
    if model is None or isinstance(model, dict):
        state = model
        model = LM(model_cfg)
        if state is not None:
            model.load_state_dict(state)
    elif not isinstance(model, LM):
        raise TypeError(f"model must be an LM, a state_dict or None, got {type(model).__name__}")
    elif model.cfg.to_dict() != model_cfg.to_dict():
        raise ValueError("model.cfg differs from model_cfg")
    model = model.to(info.device)
    broadcast_module(model, src=0)
    return model


def _tied_head_group(model_cfg: ModelConfig, info: DistInfo, ranks: dict[int, int],
                     n_stages: int):
    """The process group of the first and last stage's ranks, which sum the gradient of a
    tied embedding and its head copy; None where not needed (or not a member)."""
    first_rank, last_rank = ranks[0], ranks[n_stages - 1]
    if not model_cfg.tie_embeddings or first_rank == last_rank:
        return None
    # new_group is collective over the default group: every rank creates it.
    group = dist.new_group([first_rank, last_rank])
    return group if info.rank in (first_rank, last_rank) else None


def _my_stages(model_cfg: ModelConfig, model: LM, info: DistInfo, ranks: dict[int, int],
               ranges: list[tuple[int, int]]):
    """This rank's StageModules (the LM's own submodules) and their PipelineStages."""
    from torch.distributed.pipelining import PipelineStage

    n_stages = len(ranges)
    stage_mods, pipe_stages = [], []
    for s in sorted(s for s, r in ranks.items() if r == info.rank):
        lm_head = None
        if s == n_stages - 1:
            lm_head = model.lm_head
            if model_cfg.tie_embeddings:  # a copy of the embedding, synced through its grad
                lm_head = nn.Linear(model_cfg.dim, model_cfg.vocab_size, bias=False,
                                    device=info.device)
                lm_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())
        mod = StageModule(
            model_cfg, s, n_stages, ranges[s], model.blocks,
            tok_emb=model.tok_emb if s == 0 else None,
            norm_f=model.norm_f if s == n_stages - 1 else None,
            lm_head=lm_head,
        )
        stage_mods.append(mod)
        pipe_stages.append(PipelineStage(mod, s, n_stages, info.device))
    return stage_mods, pipe_stages
