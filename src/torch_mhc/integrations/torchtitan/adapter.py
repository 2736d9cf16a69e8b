"""HF state-dict conversion that keeps the HC / mHC connections.

torchtitan's llama3 / qwen3 adapters map the keys they know and drop the rest, so an HF export
of a converted model loses every connection. `with_connections(adapter_cls)` is that adapter
plus the connections, named as torch_mhc.hf.convert names them in a transformers model:

    layers.{i}.attention_hc.<param>  <->  model.layers.{i}.mhc_attn.<param>
    layers.{i}.ffn_hc.<param>        <->  model.layers.{i}.mhc_mlp.<param>

Both sides hold the same torch_mhc connection classes (TitanHyperConnection subclasses
HyperConnection, TitanManifoldHyperConnection ManifoldHyperConnection) with the same layer
indices (2 i and 2 i + 1 for block i), the first block expanding the streams and the last one
reducing them (the mean) before the final norm: parameter names, shapes and layouts are
equal, so the mapping renames and never reshapes. `hf_conversion(model_config)` gives the
arguments of torch_mhc.hf.convert that build the matching transformers model.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from torch_mhc.integrations.torchtitan.blocks import HYPER_CONFIGS

# torchtitan connection module -> torch_mhc.hf's attribute on a decoder layer.
HF_NAMES = {"attention_hc": "mhc_attn", "ffn_hc": "mhc_mlp"}
TITAN_NAMES = {v: k for k, v in HF_NAMES.items()}
TITAN_KEY = re.compile(r"layers\.(\d+)\.(attention_hc|ffn_hc)\.([A-Za-z_]\w*)")
HF_KEY = re.compile(r"model\.layers\.(\d+)\.(mhc_attn|mhc_mlp)\.([A-Za-z_]\w*)")


def titan_to_hf_key(key: str) -> str | None:
    """The HF name of a connection key (None for any other key)."""
    m = TITAN_KEY.fullmatch(key)
    return None if m is None else f"model.layers.{m[1]}.{HF_NAMES[m[2]]}.{m[3]}"


def hf_to_titan_key(key: str) -> str | None:
    """The torchtitan name of an HF connection key (None for any other key)."""
    m = HF_KEY.fullmatch(key)
    return None if m is None else f"layers.{m[1]}.{TITAN_NAMES[m[2]]}.{m[3]}"


def hf_conversion(model_config) -> dict | None:
    """{"kind", "streams", **options}: the arguments of torch_mhc.hf.convert(model, ...)
    whose connections match this torchtitan model's; None for an unconverted model.
    The converter converts every block alike; anything else is refused."""
    layers = list(getattr(model_config, "layers", None) or [])
    hyper = [layer for layer in layers if isinstance(layer, HYPER_CONFIGS)]
    if not hyper:
        return None
    settings = {(layer.hc_kind, layer.hc_streams, repr(sorted(layer.hc_options.items())))
                for layer in hyper}
    if len(hyper) != len(layers) or len(settings) != 1:
        raise ValueError(
            f"HF conversion needs every block converted alike; got {len(hyper)} of "
            f"{len(layers)} blocks converted with settings {sorted(settings)}"
        )
    first = hyper[0]
    return {"kind": first.hc_kind, "streams": first.hc_streams, **first.hc_options}


class ConnectionAdapterMixin:
    """Put before a torchtitan StateDictAdapter class: its to_hf / from_hf plus the
    connection keys (renamed, values untouched). A model without connections converts as
    with the plain adapter."""

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        connections = {k: v for k, v in state_dict.items() if TITAN_KEY.fullmatch(k)}
        rest = {k: v for k, v in state_dict.items() if k not in connections}
        hf = super().to_hf(rest)
        mapping = getattr(self, "fqn_to_index_mapping", None)
        for key, value in connections.items():
            hf_key = titan_to_hf_key(key)
            hf[hf_key] = value
            if mapping is not None and hf_key not in mapping:
                mapping[hf_key] = _file_index(mapping, hf_key)
        return hf

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        connections = {k: v for k, v in hf_state_dict.items() if HF_KEY.fullmatch(k)}
        rest = {k: v for k, v in hf_state_dict.items() if k not in connections}
        if connections and hf_conversion(self.model_config) is None:
            # torchtitan's model load is not strict: they would be dropped without a word.
            raise ValueError(
                f"the HF state dict holds HC / mHC connections ({len(connections)} tensors, "
                f"e.g. {min(connections)!r}) but the torchtitan model has none: convert it "
                "with MhcConverter (kind and streams as the checkpoint's) before loading"
            )
        state_dict = super().from_hf(rest)
        state_dict.update({hf_to_titan_key(k): v for k, v in connections.items()})
        return state_dict


def _file_index(mapping: dict[str, int], hf_key: str) -> int:
    """The safetensors file of the layer's input norm: with an index file from the HF assets,
    torch's HF writer needs a file for every key, and a connection belongs with its layer."""
    layer = hf_key.split(".")[2]
    for neighbour in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        index = mapping.get(f"model.layers.{layer}.{neighbour}")
        if index is not None:
            return index
    return max(mapping.values(), default=1)


@functools.cache
def with_connections(adapter_cls: type) -> type:
    """adapter_cls (a torchtitan StateDictAdapter class) keeping the connections; a class
    that already keeps them is returned unchanged."""
    if issubclass(adapter_cls, ConnectionAdapterMixin):
        return adapter_cls
    cls = type(f"Hyper{adapter_cls.__name__}", (ConnectionAdapterMixin, adapter_cls), {})
    cls.__module__ = __name__
    return cls


def _named(base_module: str, base_name: str) -> type:
    import importlib

    return with_connections(getattr(importlib.import_module(base_module), base_name))


HyperLlama3StateDictAdapter = _named("torchtitan.models.llama3.state_dict_adapter",
                                     "Llama3StateDictAdapter")
HyperQwen3StateDictAdapter = _named("torchtitan.models.qwen3.state_dict_adapter",
                                    "Qwen3StateDictAdapter")
