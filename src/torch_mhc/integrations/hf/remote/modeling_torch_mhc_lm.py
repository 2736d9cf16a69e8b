"""The reference LM of torch-mhc as a Hugging Face causal LM (remote code).

Written into a folder by `mhc export-hf` with configuration_torch_mhc_lm.py, connections.py
(the connection modules for remote code) and verbatim copies of torch_mhc/functional
(sinkhorn.py, maps.py, successors.py), which hold the maths of every connection; this file
needs torch and transformers only, never torch_mhc. It is torch_mhc/lm/model.py with the
library's connections replaced by those of connections.py, on the plain-torch maths
(the library's fused ops compute the same maps; the two agree to float32 rounding), and
with transformers' conventions around it: a Cache object for decoding, attention_mask for
padded batches, position_ids, labels shifted inside the model.

    h = tok_emb(input_ids)                                 # [B, T, C]
    x = h repeated over n streams                          # [B, T, n, C]  (n = 1: residual)
    for each block: x = attn_conn(x); x = mlp_conn(x)      # each wraps norm + sublayer
    logits = lm_head(norm_f(mean over streams of x))       # [B, T, V]

The parameter names are the run's own (tok_emb.weight, blocks.0.attn.phi, ...), so the
safetensors file holds exactly the run's state dict.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_torch_mhc_lm import TorchMhcLMConfig
from .connections import make_connection

# the output field that carries the cache: "cache" from transformers 5.2x on
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else (
    "past_key_values")


# ---------------------------------------------------------------------------------------------
# Rotary position embeddings (as torch_mhc.lm.model, per sequence for padded batches)
# ---------------------------------------------------------------------------------------------


def rope_angles(positions: torch.Tensor, head_dim: int, base: float):
    """cos and sin of positions [B, T]: [B, 1, T, head_dim / 2] each, in fp32."""
    inv_freq = base ** (
        -torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    )  # [D/2]
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, D/2]
    return angles.cos()[:, None], angles.sin()[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + D/2]) of x [B, H, T, D]; fp32 inside, x's dtype out."""
    d = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :d], xf[..., d:]  # [B, H, T, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Sublayers and the branches the connections wrap
# ---------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE on q and k, through SDPA."""

    def __init__(self, config: TorchMhcLMConfig, block_index: int):
        super().__init__()
        dim = config.hidden_size
        self.n_heads = config.num_attention_heads
        self.head_dim = dim // self.n_heads
        self.block_index = block_index  # this layer's slot in the cache
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, h, cos, sin, cache=None, mask=None):
        B, T, C = h.shape
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv(h).split(C, dim=-1))  # [B, H, T, D] each
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.block_index)  # [B, H, S, D], S = past + T
        if mask is None:  # no padding, and no earlier tokens unless T == 1
            y = F.scaled_dot_product_attention(q, k, v, is_causal=k.shape[2] == T)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))  # [B, T, C]


class MLP(nn.Module):
    """Two-layer MLP with GELU."""

    def __init__(self, config: TorchMhcLMConfig):
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.out_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, h):
        return self.out_proj(F.gelu(self.fc(h)))  # [B, T, C]


class AttentionBranch(nn.Module):
    """attn(norm(h)): [B, T, C] -> [B, T, C]."""

    def __init__(self, config: TorchMhcLMConfig, block_index: int):
        super().__init__()
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config, block_index)

    def forward(self, h, cos, sin, cache=None, mask=None):
        return self.attn(self.norm(h), cos, sin, cache=cache, mask=mask)


class MLPBranch(nn.Module):
    """mlp(norm(h)): [B, T, C] -> [B, T, C]."""

    def __init__(self, config: TorchMhcLMConfig):
        super().__init__()
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, h):
        return self.mlp(self.norm(h))


def make_block_connection(config: TorchMhcLMConfig, layer_index: int, branch: nn.Module):
    """The run's connection around branch (connections.py: the library's names and maths)."""
    options = {"norm_eps": config.norm_eps, "sinkhorn_iters": config.sinkhorn_iters}
    return make_connection(config.connection, config.hidden_size, config.n_streams, layer_index,
                           options, branch)


class Block(nn.Module):
    """Two connections (layer indices 2i and 2i + 1): x [B, T, n, C] -> [B, T, n, C]."""

    def __init__(self, config: TorchMhcLMConfig, block_index: int):
        super().__init__()
        self.attn = make_block_connection(config, 2 * block_index,
                                          AttentionBranch(config, block_index))
        self.mlp = make_block_connection(config, 2 * block_index + 1, MLPBranch(config))

    def forward(self, x, cos, sin, cache=None, mask=None):
        return self.mlp(self.attn(x, cos, sin, cache=cache, mask=mask))


# ---------------------------------------------------------------------------------------------
# The causal LM
# ---------------------------------------------------------------------------------------------


def attention_mask_4d(attention_mask, past: int, T: int, device) -> torch.Tensor | None:
    """The mask SDPA needs, [B or 1, 1, T, past + T] (True = attend), or None where plain
    causal attention is right (no padding, and no earlier tokens unless T == 1)."""
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    S = past + T
    padded = attention_mask is not None and not bool(attention_mask.all())
    if not padded and (past == 0 or T == 1):
        return None
    if attention_mask is not None and attention_mask.shape[-1] != S:
        raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} positions, the "
                         f"cache and input_ids {S}")
    qpos = torch.arange(past, S, device=device)
    kpos = torch.arange(S, device=device)
    mask = (kpos[None, :] <= qpos[:, None])[None, None]  # [1, 1, T, S]
    if padded:
        keys = attention_mask[:, None, None, :].bool()  # [B, 1, 1, S]
        # a padding query sees itself: a row with no key at all would give NaN
        mask = (mask & keys) | (kpos[None, :] == qpos[:, None])
    return mask


class TorchMhcLMForCausalLM(PreTrainedModel, GenerationMixin):
    """The byte-level reference LM of torch-mhc: every sublayer wrapped by a connection."""

    config_class = TorchMhcLMConfig
    base_model_prefix = "torch_mhc_lm"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"lm_head.weight": "tok_emb.weight"}

    def __init__(self, config: TorchMhcLMConfig):
        super().__init__(config)
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm_f = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.tok_emb

    def set_input_embeddings(self, value):
        self.tok_emb = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                past_key_values=None, inputs_embeds=None, labels=None, use_cache=None,
                logits_to_keep=0, return_dict=None, **kwargs):
        """input_ids [B, T] (byte ids) -> CausalLMOutputWithPast with logits [B, T, V]; with a
        cache, input_ids are the tokens after the cached ones. labels [B, T] are shifted
        here (-100 = ignore)."""
        cache = cache if cache is not None else past_key_values
        h = self.tok_emb(input_ids) if inputs_embeds is None else inputs_embeds  # [B, T, C]
        B, T = h.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = self._positions(attention_mask, past, T, h.device)  # [B|1, T]
        cos, sin = rope_angles(position_ids, self.config.hidden_size
                               // self.config.num_attention_heads, self.config.rope_base)
        mask = attention_mask_4d(attention_mask, past, T, h.device)
        n = self.config.n_streams
        x = h.unsqueeze(-2).expand(B, T, n, h.shape[-1]).contiguous()  # [B, T, n, C]
        for block in self.blocks:
            x = block(x, cos, sin, cache=cache, mask=mask)  # [B, T, n, C]
        h = x.mean(dim=-2)  # [B, T, C]
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(self.norm_f(h))  # [B, T', V]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1),
                                   labels[:, 1:].flatten().to(logits.device), ignore_index=-100)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})
        return out if return_dict is not False else out.to_tuple()

    @staticmethod
    def _positions(attention_mask, past: int, T: int, device) -> torch.Tensor:
        """Each token's position: counted from the first unpadded token when a 2D
        attention_mask is given (left padding), else past, past + 1, ..."""
        if attention_mask is not None and attention_mask.dim() == 2:
            pos = attention_mask.long().cumsum(-1) - 1  # [B, S]
            return pos.clamp(min=0)[:, -T:]
        return torch.arange(past, past + T, device=device)[None]
