"""convert(): put HC / mHC (any connection kind) into a transformers causal LM, in place.

    model = AutoModelForCausalLM.from_pretrained("...")
    torch_mhc.hf.convert(model, kind="mhc", streams=4)

Every decoder layer's attention and MLP sublayers become the branches of two connections
(layer_index 2 i and 2 i + 1 for decoder layer i, as in torch_mhc.lm.model), the first layer
expands its input to n streams and the last one reduces them (reduce_streams, the mean) before
the model's final norm. An initialised connection computes the Pre-Norm residual network built
from its branches, so the converted model computes the original model's function: same logits
(up to float rounding), same greedy generations.

The conversion is recorded in `model.config.mhc_conversion` ({"kind", "streams", "options"}),
which save_pretrained writes to config.json and torch_mhc.hf.from_pretrained reads back. The
record goes into a copy of the config that the converted model owns (_own_config), never into
a config object other models may share.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator

from torch import nn

from torch_mhc import __version__
from torch_mhc.connections import Connection, connection_options, make_connection
from torch_mhc.connections.factory import option_hints
from torch_mhc.integrations.hf.layers import (
    ConversionError,
    branches,
    converted_class,
    find_decoder_layers,
    is_converted,
)
from torch_mhc.integrations.hf.remote.configuration_torch_mhc import CONVERSION_KEY, REFUSED

__all__ = ["convert", "connection_parameters", "train_only_connections", "CONFIG_KEY"]

CONFIG_KEY = CONVERSION_KEY  # the attribute of model.config that records the conversion
# Called with every converted model: checkpoint.py adds the hook that makes the model's own
# save_pretrained write the portable checkpoint (it imports this module, so not the reverse).
ON_CONVERT: list = []


def _check_model(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    if not isinstance(model, nn.Module) or config is None:
        raise ConversionError(
            f"torch_mhc.hf.convert expects a transformers PreTrainedModel (a causal LM with a "
            f".config), got {type(model).__name__}"
        )
    if any(is_converted(m) for m in model.modules()):
        done = getattr(config, CONFIG_KEY, None)
        raise ValueError(
            f"{type(model).__name__} is already converted ({done}); convert a model once "
            "(load a fresh copy to convert it differently)"
        )
    if getattr(config, CONFIG_KEY, None) is not None:
        raise ValueError(
            f"{type(model).__name__}'s config records a conversion ({getattr(config, CONFIG_KEY)})"
            " but its layers are plain: it was loaded from a converted checkpoint without "
            "conversion; load it with torch_mhc.hf.from_pretrained(path)"
        )
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention",
                                                                 False):
        raise ConversionError(
            f"torch_mhc.hf cannot convert {type(model).__name__}: expected a decoder-only "
            "causal LM, got a model with cross-attention"
        )
    _check_not_dispatched(model)


def _check_not_dispatched(model: nn.Module) -> None:
    """accelerate's dispatch (a device_map over several devices, or offloading) replaces each
    hooked module's forward on the instance, which would keep running the old layer, and
    leaves offloaded weights on the meta device, where the connections would be put."""
    hooked = next((name or "the model" for name, m in model.named_modules()
                   if hasattr(m, "_hf_hook") or hasattr(m, "_old_forward")), None)
    if hooked is not None:
        raise ConversionError(
            f"torch_mhc.hf cannot convert {type(model).__name__}: it was dispatched by "
            f"accelerate (hooks on {hooked}, as a device_map over several devices or with "
            "offloading puts them); expected a model that is not dispatched: convert before "
            "dispatching (load it without device_map, convert it, then dispatch it, e.g. with "
            "accelerate.dispatch_model)"
        )


def check_options(kind: str, streams: int, options: dict) -> None:
    """Raise a ValueError or TypeError unless convert(model, kind, streams, **options) would
    build its connections (every constructor check, on a probe of width 8)."""
    if not isinstance(streams, int) or isinstance(streams, bool) or streams < 1:
        raise ValueError(f"streams must be an int >= 1, got {streams!r}")
    try:
        json.dumps(options)
    except TypeError as e:
        raise ValueError(
            f"connection options must be JSON values (they are saved in config.json), got "
            f"{options!r}: {e}"
        ) from None
    # A connection built without options checks kind with make_connection's own error (and
    # the streams); a second one, with them, checks their values.
    make_connection(kind, 8, streams, 0, lambda h: h)
    known = set(connection_options(kind))
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"unknown connection option(s) {unknown}{option_hints(unknown, sorted(known))} "
            f"for kind {kind!r}; expected {sorted(known) if known else 'none'}"
        )
    make_connection(kind, 8, streams, 0, lambda h: h, **options)


def convert(model: nn.Module, kind: str = "mhc", streams: int = 4, **connection_kwargs):
    """Convert a transformers causal LM in place; returns the model.

    kind: any kind torch_mhc.make_connection knows ("residual", "hc", "mhc", ...).
    streams: n >= 1, n >= 2 for mHC and its successors (ignored by "residual", which has one
    stream).
    connection_kwargs: passed to every connection (e.g. sinkhorn_iters=20, impl="cpu");
    they must be JSON values, since they are saved in the config.
    The connections take the device and dtype of the layer they are put in.
    """
    _check_model(model)
    check_options(kind, streams, connection_kwargs)
    layers, specs = find_decoder_layers(model)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    dim = int(config.hidden_size)
    n = 1 if kind == "residual" else streams
    for i, (layer, spec) in enumerate(zip(layers, specs, strict=True)):
        p = next(layer.parameters())
        layer.__class__ = converted_class(type(layer))
        layer._mhc_spec, layer._mhc_first, layer._mhc_last = spec, i == 0, i == len(layers) - 1
        attn_branch, mlp_branch = branches(layer)
        attn = make_connection(kind, dim, n, 2 * i, attn_branch, **connection_kwargs)
        mlp = make_connection(kind, dim, n, 2 * i + 1, mlp_branch, **connection_kwargs)
        layer.mhc_attn = attn.to(device=p.device, dtype=p.dtype)
        layer.mhc_mlp = mlp.to(device=p.device, dtype=p.dtype)
    # device_map="auto" must not split a layer from its connections (names, not classes).
    for name in sorted({type(layer).__name__ for layer in layers}):
        model._no_split_modules = with_no_split(model, name)
    _own_config(model)
    _mark_unsaved(model, kind, n)
    setattr(model.config, CONFIG_KEY, {
        "kind": kind, "streams": n, "options": dict(connection_kwargs),
        "torch_mhc_version": __version__,
    })
    for hook in ON_CONVERT:
        hook(model)
    return model


def _own_config(model: nn.Module) -> None:
    """Give the model a copy of its config before the conversion is recorded in it.

    Models built from one config object share it (transformers keeps the object it is given),
    so the record written into it would mark the other models converted too: their save would
    write a checkpoint that from_pretrained refuses. Inside the model every module that held
    the config (or one of its sub-configs, e.g. a text_config) gets the copy, so a setting
    changed on model.config still reaches them all.
    """
    from transformers import PretrainedConfig

    memo: dict[int, object] = {}
    new = copy.deepcopy(model.config, memo)
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, PretrainedConfig) and id(value) in memo:
                setattr(module, name, memo[id(value)])
    model.config = new


def _mark_unsaved(model: nn.Module, kind: str, n: int) -> None:
    """Make the model's name_or_path a sentence that no loader accepts, saying how to load it.

    transformers sets name_or_path to what from_pretrained loaded, and PEFT records it in an
    adapter's config as the base model (`base_model_name_or_path`), from which
    AutoPeftModelForCausalLM builds the base: after a conversion in this process that is the
    plain checkpoint, and the adapter's connections would be dropped without a word. With the
    sentence it stops on "Repo id must use alphanumeric chars ...: 'refused by torch-mhc: ...'".
    The config's `_name_or_path` (model cards, pipelines' tokenizers) stays. from_pretrained
    of a converted folder sets the folder back: that folder holds the converted model.
    """
    name = vars(model).get("name_or_path")
    if not isinstance(name, str) or not name:
        return  # not a transformers model, or built from a config: nothing to load instead
    model.name_or_path = (
        f"{REFUSED} {name} converted to {kind} with {n} streams in this process; "
        "no folder holds it: save it with torch_mhc.hf.save_pretrained and load that folder"
    )


def with_no_split(model: nn.Module, name: str):
    """model._no_split_modules plus name, in the container type transformers gave it."""
    current = getattr(model, "_no_split_modules", None) or set()
    return {*current, name} if isinstance(current, set) else [*current, name]


def connection_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of every connection in the model (maps, gates, static biases)."""
    seen = set()
    for mod_name, module in model.named_modules():
        if isinstance(module, Connection):
            for name, p in module.named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{mod_name}.{name}" if mod_name else name), p


def train_only_connections(model: nn.Module) -> list[nn.Parameter]:
    """Freeze every parameter except the connections' (requires_grad=False); returns the
    trainable ones. torch_mhc.param_groups(model) then groups only these, since it skips
    frozen parameters."""
    keep = {id(p) for _, p in connection_parameters(model)}
    if not keep:
        raise ValueError(
            f"{type(model).__name__} has no connection parameters: convert it first "
            "(torch_mhc.hf.convert) with a kind that has parameters (not 'residual')"
        )
    trainable = []
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
        if id(p) in keep:
            trainable.append(p)
    return trainable


def conversion_of(model: nn.Module) -> dict | None:
    """The recorded conversion of a converted model, else None."""
    return getattr(getattr(model, "config", None), CONFIG_KEY, None)
