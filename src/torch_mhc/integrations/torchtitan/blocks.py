"""torchtitan's dense decoder blocks with HC / mHC connections around their two sublayers.

A converted block keeps the original block's children under their names (`attention`,
`attention_norm`, `feed_forward`, `ffn_norm`: every existing parameter name is kept) and adds
two connections, `attention_hc` and `ffn_hc`. Its forward, on streams x [B, T, n, C]:

    x = attention_hc(x, branch = attention(attention_norm(.), masks, positions))
    x = ffn_hc(x,       branch = feed_forward(ffn_norm(.)))

The first block expands [B, T, C] -> [B, T, n, C] on entry and the last reduces on exit, so the
model keeps torchtitan's top-level modules (tok_embeddings, layers, norm, lm_head) and a
pipeline split still cuts between blocks ([B, T, n, C] travels between stages). At
initialisation every connection is the plain residual x + F(x) on equal streams, so the
converted model computes the unconverted model's function.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.models.qwen3.model import Qwen3TransformerBlock

from torch_mhc.connections import expand_streams, reduce_streams
from torch_mhc.integrations.torchtitan.connection import TITAN_CONNECTIONS


class _HyperBlock:
    """Mixed into a torchtitan block class; its Config carries the `hc_*` fields below."""

    def _add_connections(self, config) -> None:
        cls = TITAN_CONNECTIONS[config.hc_kind]
        dim = config.attention_norm.normalized_shape
        n, k = config.hc_streams, config.hc_layer
        # layer_index 2k and 2k + 1: consecutive connections read consecutive streams.
        self.attention_hc = cls(dim, n, 2 * k, **config.hc_options)
        self.ffn_hc = cls(dim, n, 2 * k + 1, **config.hc_options)
        norm_sharding = config.attention_norm.sharding_config
        if norm_sharding is not None:  # set by update_from_config (torchtitan's trainer)
            layout = norm_sharding.state_shardings["weight"]
            self.attention_hc.declare_replicated(layout)
            self.ffn_hc.declare_replicated(layout)
        self.hc_streams, self.hc_first, self.hc_last = n, config.hc_first, config.hc_last
        self.hc_fp32 = config.hc_fp32

    def parallelize(self, parallel_dims) -> None:
        """torchtitan's parallelisation of the block's modules (TP placements), then each
        connection as an FSDP unit of its own with float32 parameters: FSDP casts the
        parameters of a unit to one dtype, and in bf16 the connections' biases round (b_pre
        = logit(0.625) by 3e-4), so the initial maps would no longer add F(x) exactly once.
        The block's own unit, applied later by torchtitan, leaves them to these units.
        torchtitan's per-block compile (fullgraph) cannot trace FSDP hooks inside a block:
        with --compile.enable, convert with fp32=False (the connections then share their
        block's FSDP dtype)."""
        super().parallelize(parallel_dims)
        if self.hc_fp32:
            fp32_fsdp_units(parallel_dims, [self.attention_hc, self.ffn_hc])
            self.hc_units = True

    def _attention_branch(self, h, attention_masks, positions):
        return self.attention(self.attention_norm(h), attention_masks, positions)

    def _ffn_branch(self, h):
        return self.feed_forward(self.ffn_norm(h))

    hc_units = False  # the connections are float32 FSDP units (parallelize)

    def forward(self, x: torch.Tensor, attention_masks, positions: torch.Tensor | None = None):
        if self.hc_units and torch.compiler.is_compiling():
            raise RuntimeError(
                "a block whose HC / mHC connections are float32 FSDP units cannot be compiled "
                "(Dynamo does not trace FSDP hooks); convert with MhcConverter.Config("
                "fp32=False) when torchtitan compiles blocks (--compile.enable)"
            )
        if self.hc_first:
            x = expand_streams(x, self.hc_streams)  # [B, T, C] -> [B, T, n, C]
        x = self.attention_hc(x, self._attention_branch, attention_masks, positions)
        x = self.ffn_hc(x, self._ffn_branch)
        return reduce_streams(x) if self.hc_last else x  # [B, T, C] after the last block


def fp32_fsdp_units(parallel_dims, modules) -> None:
    """fully_shard each module on torchtitan's data-parallel mesh, parameters kept float32
    (gathered, computed and reduced in float32; activations keep their dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if parallel_dims.spmd_backend in ("full_dtensor", "spmd_types"):
        from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh

        mesh, mesh_dims = resolve_fsdp_mesh(parallel_dims)
    else:  # the DTensor backend: torchtitan's own choice of mesh (parallelize_llama)
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        mesh, mesh_dims = parallel_dims.get_mesh(names), None
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                  cast_forward_inputs=False)
    extra = {} if mesh_dims is None else {"dp_mesh_dims": mesh_dims}
    for module in modules:
        # Kept gathered from forward to backward (a few small tensors): a re-gather inside
        # a region that activation checkpointing recomputes is an op the recomputation
        # did not see in the forward, which selective AC refuses.
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=False,
                    **extra)


def _hyper_config(base: type, owner: str) -> type:
    """`base` (a block's Config) plus the `hc_*` fields, as the Config of class `owner`.

    The fields (set by the converter): connection kind and streams, the block's index, whether
    it expands / reduces the streams, keyword arguments of the connection class, and float32
    FSDP units or not. A fresh @dataclass(kw_only=True, slots=True) per block class, as
    torchtitan requires of each Config (a shared slotted base cannot be mixed in).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(base):
        hc_kind: str = "mhc"
        hc_streams: int = 4
        hc_layer: int = 0
        hc_first: bool = False
        hc_last: bool = False
        hc_options: dict = field(default_factory=dict)
        hc_fp32: bool = True

    Config.__qualname__ = f"{owner}.Config"  # where pickle and torchtitan's logs find it
    return Config


class HyperLlama3Block(_HyperBlock, Llama3TransformerBlock):
    """Llama3TransformerBlock with HC / mHC connections."""

    Config = _hyper_config(Llama3TransformerBlock.Config, "HyperLlama3Block")

    def __init__(self, config: Config):
        Llama3TransformerBlock.__init__(self, config)
        self._add_connections(config)

    forward = _HyperBlock.forward


class HyperQwen3Block(_HyperBlock, Qwen3TransformerBlock):
    """Qwen3TransformerBlock (dense: no MoE) with HC / mHC connections."""

    Config = _hyper_config(Qwen3TransformerBlock.Config, "HyperQwen3Block")

    def __init__(self, config: Config):
        Qwen3TransformerBlock.__init__(self, config)
        self._add_connections(config)

    forward = _HyperBlock.forward


# The block configs a converter accepts, each with the converted class's Config.
CONVERTIBLE = {
    Llama3TransformerBlock.Config: HyperLlama3Block.Config,
    Qwen3TransformerBlock.Config: HyperQwen3Block.Config,
}
HYPER_CONFIGS = tuple(CONVERTIBLE.values())
