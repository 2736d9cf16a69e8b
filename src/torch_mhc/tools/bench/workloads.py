"""What the benchmarks run: the benchmark LM and its variants, token batches, a training step
as a closure, and the count of bytes autograd saves for backward.

Shared by the suite behind `mhc bench` (step, saved, sinkhorn, decode) and by the GPU check
(gpu_check), which is why they live apart from both.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import sys
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from torch_mhc import ops as _ops
from torch_mhc.functional import successors as _successors
from torch_mhc.lm.model import LM, ModelConfig, rope_angles

__all__ = [
    "DTYPES",
    "VARIANTS",
    "LucidrainsMHCLM",
    "build_model",
    "connection_step",
    "hyper_connections_version",
    "import_hyper_connections",
    "lm_config",
    "log",
    "random_tokens",
    "residual_step",
    "saved_bytes",
    "train_step",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Model variants: our three connections, and lucidrains' mHC around the same blocks.
# mHC's successors are LM connection kinds too (connections.successors.VARIANT_KINDS).
VARIANTS = ("residual", "hc", "mhc", "lucidrains_mhc", "mhc-lite", "kromhc", "mhc-static-res")


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries the report)."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def lm_config(kind: str, dim: int, layers: int, streams: int, seq: int, **fields) -> ModelConfig:
    """The benchmark LM: heads of width 64 (one head below dim 64), max_seq_len = seq."""
    return ModelConfig(dim=dim, n_layers=layers, n_heads=max(1, dim // 64), max_seq_len=seq,
                       connection=kind, streams=streams, **fields)


class LucidrainsMHCLM(nn.Module):
    """The reference LM's blocks wrapped by lucidrains' `hyper_connections.mHC` instead.

    Built from an LM with plain residual connections, whose embedding, branches (pre-norm
    attention and MLP), final norm and head it reuses; each branch is wrapped by
    `hyper_connections.mHC(n, dim=C, branch=..., layer_index=...)`. That package keeps the
    streams folded into the batch, [B * n, T, C], expands by repetition and reduces by sum.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hc = import_hyper_connections()
        base = LM(dataclasses.replace(cfg, connection="residual"))
        self.cfg = cfg
        self.tok_emb, self.norm_f, self.lm_head = base.tok_emb, base.norm_f, base.lm_head
        self.expand, self.reduce = hc.mc_get_expand_reduce_stream_functions(cfg.streams)
        n = cfg.streams
        self.attn = nn.ModuleList(
            hc.mHC(n, dim=cfg.dim, branch=b.attn.branch, layer_index=2 * i)
            for i, b in enumerate(base.blocks)
        )
        self.mlp = nn.ModuleList(
            hc.mHC(n, dim=cfg.dim, branch=b.mlp.branch, layer_index=2 * i + 1)
            for i, b in enumerate(base.blocks)
        )

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        cos, sin = rope_angles(0, T, self.cfg.head_dim, self.cfg.rope_base, idx.device)
        x = self.expand(self.tok_emb(idx))  # [B * n, T, C]
        for attn, mlp in zip(self.attn, self.mlp, strict=True):
            x = mlp(attn(x, cos, sin))  # [B * n, T, C]
        logits = self.lm_head(self.norm_f(self.reduce(x)))  # [B, T, V]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss


def import_hyper_connections():
    """lucidrains' package, or ImportError with the install hint."""
    try:
        import hyper_connections
    except ImportError as err:
        raise ImportError(
            "the hyper_connections benchmark needs lucidrains' hyper-connections package "
            f"(pip install -e '.[bench]' in the torch-mhc checkout): {err}"
        ) from err
    return hyper_connections


def hyper_connections_version() -> str | None:
    try:
        return importlib.metadata.version("hyper-connections")
    except importlib.metadata.PackageNotFoundError:
        return None


def build_model(
    variant: str,
    dim: int,
    layers: int,
    streams: int = 4,
    seq: int = 256,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    **fields,
) -> nn.Module:
    """One of VARIANTS, initialised from `seed`; `fields` go to ModelConfig (e.g. recompute)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown model variant {variant!r}; expected one of {VARIANTS}")
    torch.manual_seed(seed)
    if variant == "lucidrains_mhc":
        model = LucidrainsMHCLM(lm_config("mhc", dim, layers, streams, seq))
    else:
        model = LM(lm_config(variant, dim, layers, streams, seq, **fields))
    return model.to(device=device, dtype=dtype)


def random_tokens(batch: int, length: int, vocab: int = 256, device="cpu", seed: int = 1):
    """Token ids [batch, length] from a fixed seed (the same for every variant)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).to(device)


def train_step(
    model: nn.Module, idx: torch.Tensor, impl: str | None = None, optimizer: bool = False
) -> Callable[[], None]:
    """A closure running one training step on idx [B, T + 1] (inputs idx[:, :-1], targets
    idx[:, 1:]): forward, cross-entropy, backward, then AdamW's step if `optimizer`.

    impl: the op implementation "auto" resolves to during the step (None: leave it alone).
    Gradients are dropped after each step, so every run does the same work.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5) if optimizer else None

    def step():
        if impl is not None:
            _ops.set_default_impl(impl)
        try:
            _, loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
        finally:
            if impl is not None:
                _ops.set_default_impl(None)
        if opt is not None:
            opt.step()
        for p in model.parameters():
            p.grad = None

    return step


def saved_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()):
    """Bytes of the distinct storages autograd saves for backward while fn() runs.

    Storages of `exclude` (e.g. the parameters, alive anyway) are not counted; neither is
    anything kept outside autograd's saved tensors (see RecomputeStats.kept). Returns
    (bytes, fn's result); keep the result alive until the count is used.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


def connection_step(impl: str, tokens: int, n: int, c: int, dtype: torch.dtype, device: str,
                    kind: str = "mhc"):
    """A closure running one forward + backward of the connection's ops: mHC's, HC's
    (kind "hc": hc_maps_pre, dynamic) or one of mHC's successors' (variant_maps_pre)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, n, c, generator=g).to(device=device, dtype=dtype).requires_grad_()
    if kind == "hc":  # w [C, 2 + n], the two scales, static_pre, static_post, static_res
        params = [torch.randn(c, 2 + n, generator=g) / c ** 0.5, torch.full((), 0.01),
                  torch.full((), 0.01), torch.eye(n)[0], torch.ones(n), torch.eye(n)]
    else:
        r = n * n if kind == "mhc" else _successors.res_count(kind, n)
        params = [
            (torch.randn(n * c, 2 * n + r, generator=g) / (n * c) ** 0.5),
            torch.full((3 if r else 2,), 0.5),
            torch.zeros(n),
            torch.zeros(n),
            torch.randn(n, n, generator=g) if kind == "mhc" else
            (torch.randn(r, generator=g) if r else None),
        ]
    params = [None if p is None else p.to(device).requires_grad_() for p in params]
    upstream = torch.randn(tokens, n, c, generator=g).to(device=device, dtype=dtype)
    ops = _ops.get_impl(impl, device, dtype)
    if kind == "hc":
        maps_pre = ops.hc_maps_pre
    elif kind == "mhc":
        maps_pre = ops.mhc_maps_pre
    else:
        maps_pre = functools.partial(ops.variant_maps_pre, kind)

    leaves = [t for t in (x, *params) if t is not None]

    def step():  # what the connection module runs, around an identity branch
        _drop_grads(leaves)
        if ops.fused_dx:
            _, h_post, h_res, f, x_for_merge = maps_pre(x, *params, fused_dx=True)
        else:
            (_, h_post, h_res, f), x_for_merge = maps_pre(x, *params), None
        if x_for_merge is not None:  # x's gradient through the merge joins the maps' one dx
            out = ops.post_merge(x_for_merge, f, h_post, h_res, fused_dx=True)
        else:  # no single node (HC's torch path, or no fused_dx): the merge writes its dx
            out = ops.post_merge(x, f, h_post, h_res)
        out.backward(upstream)

    step.leaves = (x, *params)  # for tests: the tensors whose gradients a step leaves
    return step


def _drop_grads(leaves) -> None:
    """Each run starts with no gradients, so that every run does the same work (a
    gradient left from the run before would be added to: one more [T, n, C] pass)."""
    for t in leaves:
        t.grad = None


def residual_step(tokens: int, c: int, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, c, generator=g).to(device=device, dtype=dtype).requires_grad_()
    upstream = torch.randn(tokens, c, generator=g).to(device=device, dtype=dtype)

    def step():
        _drop_grads((x,))
        (x + x * 1.0).backward(upstream)  # x + F(x) with a (nearly free) branch

    return step
