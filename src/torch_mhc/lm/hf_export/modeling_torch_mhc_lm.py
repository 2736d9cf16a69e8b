"""The reference LM of torch-mhc as a Hugging Face causal LM (remote code).

Written into a folder by `mhc export-hf` with configuration_torch_mhc_lm.py and verbatim
copies of torch_mhc/functional (sinkhorn.py, maps.py, successors.py), which hold the maths
of every connection; this file needs torch and transformers only, never torch_mhc. It is
torch_mhc/lm/model.py with the library's connections replaced by that plain-torch maths
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

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_torch_mhc_lm import TorchMhcLMConfig
from .maps import hc_maps, mhc_maps, post_merge, pre_aggregate, read_write_maps
from .successors import kromhc_res, kronecker_pattern, mhc_lite_res, permutation_matrices

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


# ---------------------------------------------------------------------------------------------
# Connections: parameters as in torch_mhc.connections, maths from maps.py and successors.py.
# Their initial values (used only by a model built from a config, never by a loaded one)
# are the library's: every kind starts as the residual network.
# ---------------------------------------------------------------------------------------------


def pre_bias(n: int, layer_index: int) -> torch.Tensor:
    """b_pre with sigmoid(b_pre) = e_{k mod n} / 2 + 1 / (2n)."""
    p = torch.full((n,), 0.5 / n, dtype=torch.float64)
    p[layer_index % n] += 0.5
    return torch.logit(p.clamp(max=0.99)).float()


class Residual(nn.Module):
    """x + F(x) on one stream: x [..., 1, C]."""

    def __init__(self, branch: nn.Module):
        super().__init__()
        self.branch = branch

    def forward(self, x, *args, **kwargs):
        return x + self.branch(x.squeeze(-2), *args, **kwargs).unsqueeze(-2)


class StreamConnection(nn.Module):
    """out = H_res x + H_post^T F(H_pre x), x [..., n, C]; subclasses define `maps`."""

    def __init__(self, dim: int, streams: int, layer_index: int, branch: nn.Module,
                 norm_eps: float):
        super().__init__()
        self.dim, self.streams, self.layer_index = dim, streams, layer_index
        self.branch, self.norm_eps = branch, norm_eps

    def forward(self, x, *args, **kwargs):
        h_pre, h_post, h_res = self.maps(x)
        f = self.branch(pre_aggregate(x, h_pre), *args, **kwargs)  # [..., C]
        return post_merge(x, f, h_post, h_res)  # [..., n, C]


class HyperConnection(StreamConnection):
    """HC (dynamic): static maps plus tanh terms; w [C, 2 + n], scales s_alpha, s_beta [1]."""

    def __init__(self, dim, streams, layer_index, branch, norm_eps):
        super().__init__(dim, streams, layer_index, branch, norm_eps)
        n = streams
        self.static_pre = nn.Parameter(torch.eye(n)[layer_index % n])
        self.static_post = nn.Parameter(torch.ones(n))
        self.static_res = nn.Parameter(torch.eye(n))
        self.w = nn.Parameter(torch.zeros(dim, 2 + n))
        self.s_alpha = nn.Parameter(torch.full((1,), 0.01))
        self.s_beta = nn.Parameter(torch.full((1,), 0.01))

    def maps(self, x):
        return hc_maps(x, self.w, self.s_alpha.view(()), self.s_beta.view(()), self.static_pre,
                       self.static_post, self.static_res, self.norm_eps)


class ManifoldHyperConnection(StreamConnection):
    """mHC: phi [n*C, n*n + 2n], gates alpha [3], biases b_pre, b_post [n], b_res [n, n]."""

    def __init__(self, dim, streams, layer_index, branch, norm_eps, sinkhorn_iters):
        super().__init__(dim, streams, layer_index, branch, norm_eps)
        n, self.sinkhorn_iters = streams, sinkhorn_iters
        diag = 0.5 + 0.5 / n  # sinkhorn(b_res) = I / 2 + J / (2n)
        self.phi = nn.Parameter(torch.zeros(n * dim, n * n + 2 * n))
        self.alpha = nn.Parameter(torch.full((3,), 0.01))
        self.b_pre = nn.Parameter(pre_bias(n, layer_index))
        self.b_post = nn.Parameter(torch.zeros(n))
        self.b_res = nn.Parameter(torch.zeros(1, 1) if n == 1 else
                                  torch.eye(n) * math.log(diag * (n - 1) / (1.0 - diag)))

    def maps(self, x):
        return mhc_maps(x, self.phi, self.alpha, self.b_pre, self.b_post, self.b_res,
                        self.sinkhorn_iters, self.norm_eps)


class MhcResVariant(StreamConnection):
    """mHC's read and write maps with another H_res from R logits: mhc-lite (R = n!, a
    softmax mixture of permutations), kromhc (R = log2 n Kronecker factors) or
    mhc-static-res (R = 0, H_res = I). phi [n*C, 2n + R], alpha [3] ([2] when R = 0)."""

    def __init__(self, kind, dim, streams, layer_index, branch, norm_eps):
        super().__init__(dim, streams, layer_index, branch, norm_eps)
        n, self.kind = streams, kind
        r = {"mhc-lite": math.factorial(n), "kromhc": n.bit_length() - 1}.get(kind, 0)
        self.phi = nn.Parameter(torch.zeros(n * dim, 2 * n + r))
        self.alpha = nn.Parameter(torch.full((3 if r else 2,), 0.01))
        self.b_pre = nn.Parameter(pre_bias(n, layer_index))
        self.b_post = nn.Parameter(torch.zeros(n))
        if r:
            self.b_res = nn.Parameter(self._res_bias(r))
        self._constants: dict = {}  # the permutations or the Kronecker pattern, per device

    def _res_bias(self, r: int) -> torch.Tensor:
        if self.kind == "kromhc":
            return torch.full((r,), math.log(3.0))  # each factor I / 2 + J / 4
        top = torch.tensor(math.log(r + 1), dtype=torch.float32)  # the identity's weight 1/2
        return torch.cat([top[None], (top.double() - math.log(r + 1)).float().expand(r - 1)])

    def maps(self, x):
        h_pre, h_post, rest = read_write_maps(x, self.phi, self.alpha, self.b_pre, self.b_post,
                                              self.norm_eps)
        z = rest + self.b_res.to(rest.dtype) if hasattr(self, "b_res") else rest
        # built in float64 and rounded once, as the library does (MPS has no float64)
        wide = torch.float32 if z.device.type == "mps" else torch.float64
        return h_pre, h_post, self.res_map(z.to(wide)).to(z.dtype)

    def res_map(self, z: torch.Tensor) -> torch.Tensor:
        """H_res [..., n, n] from the biased res logits z [..., R]."""
        n = self.streams
        if self.kind == "mhc-static-res":
            return torch.eye(n, dtype=z.dtype, device=z.device).expand(*z.shape[:-1], n, n)
        if z.device not in self._constants:
            make = permutation_matrices if self.kind == "mhc-lite" else kronecker_pattern
            self._constants[z.device] = make(n).to(z.device)
        res = mhc_lite_res if self.kind == "mhc-lite" else kromhc_res
        return res(z, self._constants[z.device])


def make_connection(config: TorchMhcLMConfig, layer_index: int, branch: nn.Module):
    kind, dim, n, eps = config.connection, config.hidden_size, config.n_streams, config.norm_eps
    if kind == "residual":
        return Residual(branch)
    if kind == "hc":
        return HyperConnection(dim, n, layer_index, branch, eps)
    if kind == "mhc":
        return ManifoldHyperConnection(dim, n, layer_index, branch, eps, config.sinkhorn_iters)
    return MhcResVariant(kind, dim, n, layer_index, branch, eps)


class Block(nn.Module):
    """Two connections (layer indices 2i and 2i + 1): x [B, T, n, C] -> [B, T, n, C]."""

    def __init__(self, config: TorchMhcLMConfig, block_index: int):
        super().__init__()
        self.attn = make_connection(config, 2 * block_index, AttentionBranch(config, block_index))
        self.mlp = make_connection(config, 2 * block_index + 1, MLPBranch(config))

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
