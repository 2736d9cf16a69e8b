"""Shared pieces of the torchtitan tests: the skip condition and small model builders.

The tests run where torchtitan 0.3.0 and torch >= 2.14 are installed (CI builds a separate
environment for them: .ci/run); elsewhere they are skipped with the reason.
"""

from __future__ import annotations

import importlib.util

import torch

TORCH_OK = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)
TITAN_OK = importlib.util.find_spec("torchtitan") is not None
SKIP_REASON = (
    "torchtitan tests need torchtitan 0.3.0 and torch >= 2.14 "
    f"(found torch {torch.__version__}, torchtitan {'present' if TITAN_OK else 'absent'}); "
    "install with pip install -e '.[torchtitan]' in the torch-mhc checkout, in a separate "
    "environment"
)
AVAILABLE = TORCH_OK and TITAN_OK

SEED = 0
BATCH, SEQ = 2, 64


def model_config(family: str = "llama3", kind: str | None = "mhc", streams: int = 4,
                 flavor: str = "debugmodel", fp32: bool = True):
    """torchtitan's debug model config of `family`, converted when kind is not None, with
    causal SDPA as inner attention: FlexAttention has no backward on the CPU, and for
    unpacked sequences (positions 0..T-1) SDPA's causal mask is flex's block-causal one."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    from torch_mhc.integrations.torchtitan import convert_model_config

    if family == "llama3":
        from torchtitan.models.llama3 import llama3_configs as configs
    else:
        from torchtitan.models.qwen3 import qwen3_configs as configs
    cfg = configs[flavor](attn_backend="flex")
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg if kind is None else convert_model_config(cfg, kind, streams, fp32=fp32)


def build(cfg, seed: int = SEED):
    """Meta-device build, then to_empty and init_states on the CPU, as torchtitan does."""
    with torch.device("meta"):
        model = cfg.build()
    model.verify_module_protocol()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    return model


def tokens(vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of tokens [B, T] and its positions [B, T]."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    return tok, torch.arange(SEQ).expand(BATCH, SEQ)


def logits(model, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return model(tok, pos, None)  # [B, T, vocab]; SDPA: causal, no mask object


def hf_twin(family: str, cfg):
    """An fp32 transformers causal LM (random weights) with the torchtitan debug config's
    shapes, rotary embedding and norm eps: llama3's "llama" rope scaling, qwen3's q/k norms
    and tied embeddings."""
    attn, ffn = cfg.layers[0].attention, cfg.layers[0].feed_forward
    rope = attn.rope
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=ffn.w1.out_features,
        num_hidden_layers=len(cfg.layers), num_attention_heads=attn.n_heads,
        num_key_value_heads=attn.n_kv_heads or attn.n_heads, rms_norm_eps=cfg.norm.eps,
        max_position_embeddings=rope.max_seq_len, tie_word_embeddings=cfg.enable_weight_tying,
        attn_implementation="eager",
    )
    if family == "llama3":
        from transformers import LlamaConfig, LlamaForCausalLM

        rope_parameters = {
            "rope_type": "llama3", "rope_theta": float(rope.theta),
            "factor": rope.scaling_factor, "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }
        config = LlamaConfig(rope_parameters=rope_parameters, **common)
        model = LlamaForCausalLM(config)
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(head_dim=attn.head_dim, rope_parameters={
            "rope_type": "default", "rope_theta": float(rope.theta)}, **common)
        model = Qwen3ForCausalLM(config)
    return model.float().eval()
