"""Configuration of the reference LM of torch-mhc as a Hugging Face model (remote code).

Written into a folder by `mhc export-hf` beside modeling_torch_mhc_lm.py; it needs torch and
transformers only. The field names are the ones transformers and its tools look for
(hidden_size, num_hidden_layers, max_position_embeddings, ...); `mhc_model_config` keeps the
run's own ModelConfig as it was trained, for the record.
"""

from __future__ import annotations

from transformers import PretrainedConfig

CONNECTION_KINDS = ("residual", "hc", "mhc", "mhc-lite", "kromhc", "mhc-static-res")


class TorchMhcLMConfig(PretrainedConfig):
    """Sizes and connection of the byte-level reference LM (torch_mhc.lm.model.ModelConfig)."""

    model_type = "torch_mhc_lm"

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 128,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        intermediate_size: int = 512,
        max_position_embeddings: int = 256,
        connection: str = "mhc",
        streams: int = 4,
        sinkhorn_iters: int = 20,
        norm_eps: float = 1e-6,
        rope_base: float = 10000.0,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        mhc_model_config: dict | None = None,
        **kwargs,
    ):
        if connection not in CONNECTION_KINDS:
            raise ValueError(f"connection must be one of {CONNECTION_KINDS}, got {connection!r}")
        if hidden_size % num_attention_heads or (hidden_size // num_attention_heads) % 2:
            raise ValueError(
                f"hidden_size ({hidden_size}) must split into num_attention_heads "
                f"({num_attention_heads}) heads of an even width (rotary embeddings)"
            )
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.connection, self.streams, self.sinkhorn_iters = connection, streams, sinkhorn_iters
        self.norm_eps, self.rope_base = norm_eps, rope_base
        self.initializer_range = initializer_range
        self.mhc_model_config = mhc_model_config
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def n_streams(self) -> int:
        """Streams actually used: 1 for the plain residual, `streams` otherwise."""
        return 1 if self.connection == "residual" else self.streams
