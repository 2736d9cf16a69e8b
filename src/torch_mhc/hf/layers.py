"""Finding a transformers model's pre-norm decoder layers and running them as connections.

A pre-norm decoder layer (Llama, Mistral, Qwen2, Qwen3, GPT-2, ...) computes

    h = h + attn(norm1(h), **kwargs)
    h = h + mlp(norm2(h))

Each of the two sublayers is a branch F of a torch-mhc connection, so that the converted layer
computes, on streams x [B, T, n, C],

    x = conn_attn(x, **kwargs)     # branch: h -> attn(norm1(h), **kwargs)[0]
    x = conn_mlp(x)                # branch: h -> mlp(norm2(h))

The layers are recognised by what their `forward` does, not by a list of class names: its
source must call exactly four of the layer's submodules, in the order norm, attention, norm,
MLP (a GPT-2 block's cross-attention counts only when the block has one). Anything else
(sandwich norms, dropout modules on the residual path, parallel attention and MLP) is refused,
because its residual arithmetic is not the one the connection would replace.

A converted layer keeps its class as a base: it becomes an instance of a subclass whose
`forward` runs the connections, so `isinstance` checks (output recording, gradient
checkpointing, which transformers attaches per class) keep working.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

import torch
from torch import nn

from ..connections import expand_streams, reduce_streams

__all__ = ["LayerSpec", "find_decoder_layers", "converted_class", "ConversionError"]


class ConversionError(TypeError):
    """The model (or one of its layers) does not have the structure convert() handles."""


@dataclass(frozen=True)
class LayerSpec:
    """The attribute names of one layer class's four sublayers, in call order."""

    norm1: str
    attn: str
    norm2: str
    mlp: str
    arg_names: tuple[str, ...]  # forward's parameters after hidden_states, for positional args


_EXPECTED = (
    "a causal LM whose base model holds an nn.ModuleList of pre-norm decoder layers, each "
    "layer's forward calling exactly norm -> attention -> norm -> MLP "
    "(h = h + attn(norm(h)); h = h + mlp(norm(h)), like LlamaDecoderLayer or GPT2Block)"
)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "norm" in type(module).__name__.lower()


def _called_submodules(layer: nn.Module) -> list[str]:
    """Names of the layer's child modules that its forward's source calls as self.<name>(...),
    in source order."""
    forward = inspect.unwrap(type(layer).forward)
    try:
        source = textwrap.dedent(inspect.getsource(forward))
    except (OSError, TypeError) as e:
        raise ConversionError(
            f"cannot read the source of {type(layer).__name__}.forward: {e}"
        ) from None
    calls = []
    for node in ast.walk(ast.parse(source)):
        f = node.func if isinstance(node, ast.Call) else None
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                and f.value.id == "self" and isinstance(getattr(layer, f.attr, None), nn.Module)):
            calls.append((f.lineno, f.col_offset, f.attr))
    return [name for *_, name in sorted(calls)]


def layer_spec(layer: nn.Module) -> LayerSpec:
    """The sublayer names of a pre-norm decoder layer, or ConversionError saying what differs."""
    cls = type(layer).__name__
    calls = _called_submodules(layer)
    if len(calls) != 4:
        raise ConversionError(
            f"{cls}.forward calls the submodules {calls}; expected exactly four: "
            "norm, attention, norm, MLP"
        )
    norm1, attn, norm2, mlp = calls
    for role, name in (("first", norm1), ("third", norm2)):
        if not _is_norm(getattr(layer, name)):
            raise ConversionError(
                f"{cls}.forward's {role} submodule call is self.{name} "
                f"({type(getattr(layer, name)).__name__}); expected a norm (pre-norm layer)"
            )
    if len({norm1, attn, norm2, mlp}) != 4 or _is_norm(getattr(layer, attn)):
        raise ConversionError(f"{cls}.forward calls {calls}; expected norm, attention, norm, MLP")
    params = list(inspect.signature(inspect.unwrap(type(layer).forward)).parameters)
    return LayerSpec(norm1, attn, norm2, mlp, tuple(params[2:]))  # drop self, hidden_states


def find_decoder_layers(model: nn.Module) -> tuple[nn.ModuleList, LayerSpec]:
    """The base model's ModuleList of decoder layers and their spec."""
    base = getattr(model, "base_model", model)
    candidates = [
        m for m in base.children()
        if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(x) for x in m}) == 1
    ]
    reasons = []
    for layers in candidates:
        try:
            return layers, layer_spec(layers[0])
        except ConversionError as e:
            reasons.append(str(e))
    found = "; ".join(reasons) if reasons else "no nn.ModuleList of identical layers found"
    raise ConversionError(
        f"torch_mhc.hf cannot convert {type(model).__name__}: expected {_EXPECTED}; {found}"
    )


# ------------------------------------------------------------------------------------------
# The converted layer


def _attn_branch(self, h: torch.Tensor, **kwargs) -> torch.Tensor:
    """norm1 + attention: [B, T, C] -> [B, T, C] (attention modules return (out, weights))."""
    out = getattr(self, self._mhc_spec.attn)(getattr(self, self._mhc_spec.norm1)(h), **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _mlp_branch(self, h: torch.Tensor) -> torch.Tensor:
    """norm2 + MLP: [B, T, C] -> [B, T, C]."""
    return getattr(self, self._mhc_spec.mlp)(getattr(self, self._mhc_spec.norm2)(h))


def _converted_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The layer as two connections; the first layer expands, the last reduces the streams."""
    names = self._mhc_spec.arg_names
    if len(args) > len(names):
        raise TypeError(f"{type(self).__name__}.forward takes at most {len(names) + 1} positional "
                        f"arguments, got {len(args) + 1}")
    kwargs.update(zip(names[: len(args)], args, strict=True))  # positional arguments by name
    for name in ("encoder_hidden_states", "encoder_attention_mask"):
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"a torch_mhc-converted {type(self).__name__} takes no {name}")
    x = hidden_states
    if self._mhc_first:
        x = expand_streams(x, self.mhc_attn.streams)  # [B, T, C] -> [B, T, n, C]
    x = self.mhc_attn(x, **kwargs)  # [B, T, n, C]
    x = self.mhc_mlp(x)
    return reduce_streams(x) if self._mhc_last else x  # the final norm receives [B, T, C]


_CLASSES: dict[type, type] = {}


def converted_class(cls: type) -> type:
    """The subclass of a decoder layer class whose forward runs the connections (one per class,
    so that transformers' per-class wrappers, e.g. gradient checkpointing, apply to it)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            f"MHC{cls.__name__}", (cls,),
            {
                "forward": _converted_forward,
                "_mhc_attn_branch": _attn_branch,
                "_mhc_mlp_branch": _mlp_branch,
                "__module__": __name__,
            },
        )
    return _CLASSES[cls]


def is_converted(module: nn.Module) -> bool:
    return type(module) in _CLASSES.values() or hasattr(module, "_mhc_spec")
