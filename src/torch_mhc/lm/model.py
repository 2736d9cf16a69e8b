"""The reference decoder-only language model: one file, read top to bottom.

A byte-level GPT with rotary position embeddings in which every sublayer is wrapped by a
connection from torch_mhc.connections, so the same blocks run as a plain residual network,
as HC or as mHC by changing one config field:

    h = embed(idx)                                  # [B, T, C]
    x = expand_streams(h, n)                        # [B, T, n, C]   (n = 1 for "residual")
    for each block:
        x = conn_attn(x)   with branch  attn(norm1(.))   # layer_index 2 * block
        x = conn_mlp(x)    with branch  mlp(norm2(.))    # layer_index 2 * block + 1
    h = reduce_streams(x, n)                        # [B, T, C]
    logits = lm_head(norm_f(h))                     # [B, T, V]

Every connection starts as the residual network built from the same blocks, so at
initialisation "hc" and "mhc" compute the function of "residual" (up to fp32 rounding).

Decoding keeps a KVCache of each attention layer's keys and values. Nothing about the
streams needs caching: the n-stream state lives per token and the connections mix streams
within a token only, so a cached step runs one forward over the new tokens alone.

Classes in reading order: ModelConfig, KVCache, the rotary helpers, CausalSelfAttention, MLP,
the two branches (pre-norm + sublayer), Block, LM.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from torch_mhc.connections import (
    CONNECTION_KINDS,
    check_streams,
    expand_streams,
    frozen_connections,
    make_connection,
    reduce_streams,
)
from torch_mhc.runtime.recompute import optimal_interval, recompute_streams

__all__ = ["BYTE_VOCAB", "ModelConfig", "KVCache", "LM"]

BYTE_VOCAB = 256  # the reference LM reads raw bytes (lm.data): no tokenizer


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """Sizes and choices of the reference LM; validated on construction."""

    vocab_size: int = BYTE_VOCAB
    dim: int = 128
    n_layers: int = 4  # transformer blocks; 2 * n_layers connections
    n_heads: int = 4
    max_seq_len: int = 256
    mlp_ratio: float = 4.0
    connection: str = "mhc"  # one of CONNECTION_KINDS: "residual" | "hc" | "mhc" | variants
    streams: int = 4  # ignored for "residual", which has one stream
    sinkhorn_iters: int = 20
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    init_std: float = 0.02
    tie_embeddings: bool = True
    check_finite: bool = False  # connections raise on NaN/Inf in input, maps or branch output
    recompute: bool = False  # recompute the connections' stream arithmetic in backward
    recompute_interval: int = 0  # connections per recompute group; 0: round(sqrt(nL/(n+2)))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field, what was expected and what came."""
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "streams",
                     "sinkhorn_iters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("mlp_ratio", "norm_eps", "rope_base", "init_std"):
            value = getattr(self, name)
            # isfinite too: an infinite width overflows, an infinite init_std trains to NaN
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not math.isfinite(value) or not value > 0):
                raise ValueError(
                    f"ModelConfig.{name} must be a number > 0 and finite, got {value!r}")
        if self.connection not in CONNECTION_KINDS:
            raise ValueError(
                f"ModelConfig.connection must be one of {CONNECTION_KINDS}, got {self.connection!r}"
            )
        if self.connection != "residual":
            try:
                check_streams(self.connection, self.streams)
            except ValueError as e:
                raise ValueError(f"ModelConfig.streams: {e}") from None
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"ModelConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"rotary embeddings need an even head_dim; dim / n_heads = {self.dim} / "
                f"{self.n_heads} = {self.head_dim}"
            )
        if self.hidden_dim < 1:
            raise ValueError(
                f"dim * mlp_ratio must give an MLP width >= 1, got {self.dim} * {self.mlp_ratio}"
            )
        if isinstance(self.recompute_interval, bool) or not isinstance(
            self.recompute_interval, int
        ) or self.recompute_interval < 0:
            raise ValueError(
                "ModelConfig.recompute_interval must be an integer >= 0 (0: the optimal "
                f"interval), got {self.recompute_interval!r}"
            )
        for name in ("tie_embeddings", "check_finite", "recompute"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        return int(self.dim * self.mlp_ratio)

    @property
    def n_streams(self) -> int:
        """Streams actually used: 1 for the plain residual, `streams` otherwise."""
        return 1 if self.connection == "residual" else self.streams

    def to_dict(self) -> dict:
        """Plain dict of the fields, for checkpoints."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Inverse of to_dict; unknown keys are an error (a checkpoint from another version)."""
        known = {f.name for f in fields(cls)}
        if "residual" in d and "connection" not in d:  # the kind's key in older checkpoints
            d = {("connection" if k == "residual" else k): v for k, v in d.items()}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"ModelConfig.from_dict got unknown keys {unknown}; known keys: {sorted(known)}"
            )
        return cls(**d)


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------


class KVCache:
    """Keys and values of every attention layer, preallocated to max_len positions.

    k[layer], v[layer]: [B, n_heads, max_len, head_dim]. `pos` counts the positions
    written so far; LM.forward writes the new tokens at [start_pos, start_pos + T) and sets
    pos = start_pos + T (so decoding passes start_pos=cache.pos each step).
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_heads: int,
        max_len: int,
        head_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        shape = (batch_size, n_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.batch_size, self.max_len = batch_size, max_len
        self.pos = 0

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, H, T, D] at [start_pos, start_pos + T); return all keys and values
        so far, [B, H, start_pos + T, D]."""
        end = start_pos + k.shape[2]
        self.k[layer][:, :, start_pos:end] = k
        self.v[layer][:, :, start_pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def reset(self) -> None:
        """Forget everything (the tensors are overwritten by the next writes)."""
        self.pos = 0


# ---------------------------------------------------------------------------------------------
# Rotary position embeddings
# ---------------------------------------------------------------------------------------------


def rope_angles(
    start_pos: int, length: int, head_dim: int, base: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles of positions [start_pos, start_pos + length).

    Computed on the fly in fp32 (a few thousand numbers): nothing to keep in a buffer that a
    `model.to(torch.bfloat16)` would round, and the angle of position p is the same product
    p * inv_freq whether p arrives in a full forward or in a cached step.
    Returns cos, sin: [length, head_dim / 2].
    """
    inv_freq = base ** (
        -torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )  # [D/2]
    pos = torch.arange(start_pos, start_pos + length, device=device, dtype=torch.float32)
    angles = pos[:, None] * inv_freq[None, :]  # [T, D/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + D/2]) of x [B, H, T, D] by the angles [T, D/2].

    The "rotate half" pairing (GPT-NeoX, Llama); computed in fp32, returned in x's dtype.
    """
    d = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :d], xf[..., d:]  # [B, H, T, D/2] each
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Sublayers
# ---------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE on q and k, through SDPA."""

    def __init__(self, cfg: ModelConfig, block_index: int):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.block_index = block_index  # which KVCache slot is ours
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)  # a residual output projection

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache | None = None,
        start_pos: int = 0,
    ) -> torch.Tensor:
        B, T, C = h.shape
        q, k, v = self.qkv(h).split(C, dim=-1)  # [B, T, C] each
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        v = v.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            k, v = kv_cache.update(self.block_index, k, v, start_pos)  # [B, H, S, D], S = start+T
            if T == 1:
                # One new token sees every cached position: no mask needed.
                y = F.scaled_dot_product_attention(q, k, v)
            else:
                # SDPA's is_causal aligns the mask top-left, which is wrong when S > T:
                # query i sits at position start_pos + i and sees keys j <= start_pos + i.
                qpos = torch.arange(start_pos, start_pos + T, device=h.device)
                kpos = torch.arange(k.shape[2], device=h.device)
                mask = kpos[None, :] <= qpos[:, None]  # [T, S], True = attend
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(B, T, C)  # [B, T, C]
        return self.out_proj(y)


class MLP(nn.Module):
    """Two-layer MLP with GELU.

    GELU rather than SiLU/SwiGLU: this is the GPT-2 shape (two matrices, ratio 4) whose
    initialisation the model follows, and the comparison between connections does not
    depend on the activation; a gated MLP would add a third matrix to every budget.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.out_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)  # residual output

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.gelu(self.fc(h)))  # [B, T, C]


class AttentionBranch(nn.Module):
    """The branch F a connection wraps: attn(norm1(h)). h: [B, T, C] -> [B, T, C]."""

    def __init__(self, cfg: ModelConfig, block_index: int):
        super().__init__()
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg, block_index)

    def forward(self, h, cos, sin, kv_cache=None, start_pos=0):
        return self.attn(self.norm(h), cos, sin, kv_cache=kv_cache, start_pos=start_pos)


class MLPBranch(nn.Module):
    """The branch F a connection wraps: mlp(norm2(h)). h: [B, T, C] -> [B, T, C]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h):
        return self.mlp(self.norm(h))


def _connection_kwargs(cfg: ModelConfig) -> dict:
    """The keyword arguments each connection class accepts (see connections.py)."""
    if cfg.connection == "hc":
        return {"norm_eps": cfg.norm_eps, "check_finite": cfg.check_finite}
    if cfg.connection == "mhc":
        return {
            "sinkhorn_iters": cfg.sinkhorn_iters,
            "norm_eps": cfg.norm_eps,
            "check_finite": cfg.check_finite,
        }
    if cfg.connection != "residual":  # mhc-lite, kromhc, mhc-static-res (connections.successors)
        return {"norm_eps": cfg.norm_eps, "check_finite": cfg.check_finite}
    return {}


class Block(nn.Module):
    """One transformer block: two connections, each owning its branch as a submodule.

    x: [B, T, n, C] -> [B, T, n, C]. The attention connection passes the rotary angles and
    the cache through to its branch (a connection calls branch(aggregated, *args, **kwargs)).
    """

    def __init__(self, cfg: ModelConfig, block_index: int):
        super().__init__()
        n, kw = cfg.n_streams, _connection_kwargs(cfg)
        self.attn = make_connection(
            cfg.connection, cfg.dim, n, 2 * block_index, AttentionBranch(cfg, block_index), **kw
        )
        self.mlp = make_connection(
            cfg.connection, cfg.dim, n, 2 * block_index + 1, MLPBranch(cfg), **kw
        )

    def forward(self, x, cos, sin, kv_cache=None, start_pos=0):
        x = self.attn(x, cos, sin, kv_cache=kv_cache, start_pos=start_pos)  # [B, T, n, C]
        return self.mlp(x)  # [B, T, n, C]


# ---------------------------------------------------------------------------------------------
# The language model
# ---------------------------------------------------------------------------------------------


def recompute_context(cfg: ModelConfig, training: bool, n_blocks: int):
    """Selective recomputation over n_blocks blocks (2 connections each) when enabled.

    A pipeline stage calls this with its own block count, so that recompute groups never
    cross a stage boundary (paper section 4.3). Off in eval mode and for the plain residual.
    """
    if not (cfg.recompute and training and cfg.n_streams > 1):
        return contextlib.nullcontext()
    interval = cfg.recompute_interval or optimal_interval(cfg.n_streams, 2 * n_blocks)
    return recompute_streams(interval)


class LM(nn.Module):
    """Decoder-only LM: embedding, n_layers blocks of connections, final RMSNorm, LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()  # a config mutated after construction is checked again here
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm_f = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 initialisation of the blocks; the connections' own parameters are left alone.

        Linear and embedding weights ~ N(0, init_std); each residual output projection
        (attention out_proj, MLP out_proj) ~ N(0, init_std / sqrt(2 * n_layers)) so the
        variance added to the residual stream over 2L sublayers stays ~ init_std^2.
        The connections' maps and gates keep their own init, which is what makes HC and mHC
        start as the residual network.
        """
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                s = out_std if name.endswith("out_proj") else std
                nn.init.normal_(module.weight, mean=0.0, std=s)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)

    # --- forward --------------------------------------------------------------------------

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        start_pos: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx: LongTensor [B, T] of token ids; targets: [B, T] or None (-1 = ignore).

        With kv_cache, idx holds the tokens at positions [start_pos, start_pos + T) and the
        cache supplies the earlier ones. Returns logits [B, T, V] and the mean cross-entropy
        in nats (None without targets).
        """
        self._check_inputs(idx, targets, kv_cache, start_pos)
        B, T = idx.shape
        cos, sin = rope_angles(start_pos, T, self.cfg.head_dim, self.cfg.rope_base, idx.device)

        h = self.tok_emb(idx)  # [B, T, C]
        x = expand_streams(h, self.cfg.n_streams)  # [B, T, n, C]
        with self.recompute_context(len(self.blocks)) as stats:
            for block in self.blocks:
                x = block(x, cos, sin, kv_cache=kv_cache, start_pos=start_pos)  # [B, T, n, C]
        if stats is not None:
            self.recompute_stats = stats  # bytes kept for backward, for measurements
        h = reduce_streams(x, self.cfg.n_streams)  # [B, T, C]
        logits = self.lm_head(self.norm_f(h))  # [B, T, V]

        if kv_cache is not None:
            kv_cache.pos = start_pos + T
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.float().reshape(B * T, -1), targets.reshape(B * T), ignore_index=-1
            )
        return logits, loss

    def _check_inputs(self, idx, targets, kv_cache, start_pos) -> None:
        """Shape checks (free), and the vocabulary check outside torch.compile (one sync)."""
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2:
            got = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise ValueError(f"LM expects idx as a LongTensor [B, T], got {got}")
        if idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"LM expects integer token ids (int64), got dtype {idx.dtype}")
        B, T = idx.shape
        if T < 1:
            raise ValueError("LM expects at least one token per sequence, got T = 0")
        if start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {start_pos}")
        if start_pos + T > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence too long: start_pos + T = {start_pos} + {T} = {start_pos + T} "
                f"exceeds max_seq_len = {self.cfg.max_seq_len}"
            )
        if targets is not None and tuple(targets.shape) != (B, T):
            raise ValueError(
                f"targets must have idx's shape {(B, T)}, got {tuple(targets.shape)}"
            )
        if kv_cache is not None:
            if kv_cache.batch_size != B:
                raise ValueError(
                    f"kv_cache was made for batch size {kv_cache.batch_size}, idx has B = {B}"
                )
            if start_pos + T > kv_cache.max_len:
                raise ValueError(
                    f"kv_cache holds {kv_cache.max_len} positions, start_pos + T = "
                    f"{start_pos + T}"
                )
            if start_pos > kv_cache.pos:
                raise ValueError(
                    f"start_pos = {start_pos} would leave a gap: the cache holds positions "
                    f"[0, {kv_cache.pos})"
                )
        elif start_pos != 0:
            raise ValueError(f"start_pos = {start_pos} needs a kv_cache holding the earlier tokens")
        if not torch.compiler.is_compiling():
            # An out-of-range id would index past the embedding table (a device assert on GPU).
            if bool(((idx < 0) | (idx >= self.cfg.vocab_size)).any()):
                raise ValueError(
                    f"token ids must lie in [0, {self.cfg.vocab_size}), got values in "
                    f"[{int(idx.min())}, {int(idx.max())}]"
                )

    # --- decoding -------------------------------------------------------------------------

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty cache on the model's device and dtype (max_len defaults to max_seq_len)."""
        max_len = self.cfg.max_seq_len if max_len is None else max_len
        if not 1 <= max_len <= self.cfg.max_seq_len:
            raise ValueError(f"max_len must lie in [1, {self.cfg.max_seq_len}], got {max_len}")
        w = self.tok_emb.weight
        return KVCache(self.cfg.n_layers, batch_size, self.cfg.n_heads, max_len,
                       self.cfg.head_dim, device=w.device, dtype=w.dtype)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> torch.LongTensor:
        """Append max_new_tokens sampled tokens to idx [B, T0]; returns [B, T0 + max_new_tokens].

        temperature == 0 is greedy (argmax). Without the cache each step reruns the context,
        cropped to its last max_seq_len tokens. With the cache each step runs over [B, 1]
        only, and the context never slides: the prompt and every token fed back
        (T0 + max_new_tokens - 1 positions) must fit in max_seq_len, else ValueError.
        Runs inside torch_mhc.frozen_connections(): the connections' parameters and options
        must not change during the call (a hook changing them would go unseen).
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and not 1 <= top_k <= self.cfg.vocab_size:
            raise ValueError(f"top_k must lie in [1, {self.cfg.vocab_size}], got {top_k}")
        if idx.dim() != 2 or idx.shape[1] < 1:
            raise ValueError(
                f"generate expects a prompt [B, T0] with T0 >= 1, got {tuple(idx.shape)}"
            )
        if max_new_tokens == 0:
            return idx
        B, T0 = idx.shape
        needed = T0 + max_new_tokens - 1  # the last sampled token is never fed back
        if use_cache and needed > self.cfg.max_seq_len:
            raise ValueError(
                f"with use_cache=True the prompt and fed-back tokens must fit in max_seq_len: "
                f"T0 + max_new_tokens - 1 = {T0} + {max_new_tokens} - 1 = {needed} > "
                f"{self.cfg.max_seq_len}; shorten the request or pass use_cache=False "
                f"(which crops the context)"
            )
        # the parameters do not change while this call runs: each connection's prepared
        # decoding calls are checked at their first token only
        with frozen_connections():
            if not use_cache:
                for _ in range(max_new_tokens):
                    logits, _ = self(idx[:, -self.cfg.max_seq_len :])  # [B, t, V]
                    nxt = self._sample(logits[:, -1], temperature, top_k, generator)  # [B, 1]
                    idx = torch.cat((idx, nxt), dim=1)
                return idx
            cache = self.new_kv_cache(B, max_len=needed)
            logits, _ = self(idx, kv_cache=cache, start_pos=0)  # prefill: [B, T0, V]
            for step in range(max_new_tokens):
                nxt = self._sample(logits[:, -1], temperature, top_k, generator)  # [B, 1]
                idx = torch.cat((idx, nxt), dim=1)
                if step < max_new_tokens - 1:
                    logits, _ = self(nxt, kv_cache=cache, start_pos=cache.pos)  # [B, 1, V]
            return idx

    @staticmethod
    def _sample(logits, temperature, top_k, generator) -> torch.Tensor:
        """logits [B, V] -> token ids [B, 1]."""
        if temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits.float() / temperature
        if top_k is not None:
            kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, num_samples=1, generator=generator)

    # --- parameter budgets ----------------------------------------------------------------

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (a tied LM head is counted once).

        exclude_embeddings drops the token embedding table (a lookup, no FLOPs); an untied
        LM head is a matmul and stays counted.
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_emb.weight.numel()
        return n

    def recompute_context(self, n_blocks: int):
        """Selective recomputation over this model's blocks when enabled (recompute_context)."""
        return recompute_context(self.cfg, self.training, n_blocks)

    def connections(self) -> list[nn.Module]:
        """The 2 * n_layers connection modules, in layer_index order."""
        return [conn for block in self.blocks for conn in (block.attn, block.mlp)]

    def connection_params(self) -> int:
        """Parameters owned by the connections themselves (maps, gates), not their branches."""
        return sum(p.numel() for c in self.connections() for p in c.parameters(recurse=False))
