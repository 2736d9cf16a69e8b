"""The model-config converter: torchtitan's dense decoder blocks -> HC / mHC blocks.

    from torch_mhc.integrations.torchtitan import MhcConverter
    spec = torchtitan.models.llama3.model_registry(
        "debugmodel", converters=[MhcConverter.Config(kind="mhc", streams=4)])

or, on the command line of an unchanged configuration, the equivalent override:

    --override.imports \
        torch_mhc.integrations.torchtitan.converter.mhc_override='{"streams": 4}' \
        torch_mhc.integrations.torchtitan.checkpoint.mhc_checkpoint

The converter runs on the config tree before the model is built (as torchtitan's Float8 and
LoRA converters do), so meta-device construction, parallelisation, initialisation and
checkpointing all see the converted model. It sees only the model config: the checkpoint
manager that checks connections on load and the HF adapter that keeps them are set on the
trainer config, by `convert_trainer_config` (or `with_connection_checkpoints` after
converting), by the ready configs, or by the `mhc_checkpoint` override.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torchtitan.config.override import override
from torchtitan.models.common.decoder import Decoder
from torchtitan.protocols.model import ModelConfigConverter

from torch_mhc.connections import make_connection
from torch_mhc.integrations.torchtitan.adapter import with_connections
from torch_mhc.integrations.torchtitan.blocks import CONVERTIBLE, HYPER_CONFIGS
from torch_mhc.integrations.torchtitan.checkpoint import mhc_checkpoint_config

KINDS = ("hc", "mhc")


class MhcConverter(ModelConfigConverter):
    """Wrap the attention and feed-forward sublayers of every block in HC / mHC connections.

    kind: "mhc" (Manifold-Constrained Hyper-Connections) or "hc" (Hyper-Connections);
    streams: n >= 1 (n >= 2 for mHC); options: keyword arguments of the connection class (e.g.
    sinkhorn_iters, gate_init for mHC; dynamic for HC); fp32: each connection an FSDP unit
    with float32 parameters (blocks.py; set False with torchtitan's per-block compile).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        kind: str = "mhc"
        streams: int = 4
        options: dict = field(default_factory=dict)
        fp32: bool = True

    def __init__(self, config: Config):
        check_settings(config.kind, config.streams, config.options)
        self.config = config

    def convert(self, model_config):
        c = self.config
        return convert_model_config(model_config, c.kind, c.streams, c.options, c.fp32)


def check_settings(kind, streams, options) -> None:
    if kind not in KINDS:
        raise ValueError(f"MhcConverter: kind must be one of {KINDS}, got {kind!r}")
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ValueError(f"MhcConverter: streams must be an integer >= 1, got {streams!r}")
    if not isinstance(options, dict):
        raise TypeError(f"MhcConverter: options must be a dict, got {type(options).__name__}")
    try:  # the options' names and values, now rather than when the model is built
        make_connection(kind, 8, streams, 0, lambda h: h, **options)
    except (TypeError, ValueError) as e:
        raise type(e)(f"MhcConverter: {e}") from None


def convert_model_config(model_config, kind: str = "mhc", streams: int = 4,
                         options: dict | None = None, fp32: bool = True):
    """Replace each block config of a torchtitan Decoder config (in place); return it."""
    options = dict(options or {})
    check_settings(kind, streams, options)
    if not isinstance(model_config, Decoder.Config):
        raise TypeError(
            "MhcConverter expects a torchtitan decoder config (Decoder.Config, e.g. "
            f"Llama3Model.Config), got {type(model_config).__name__}"
        )
    layers = model_config.layers
    for i, layer in enumerate(layers):
        _check_block(i, layer)
    n_layers = len(layers)
    for i, layer in enumerate(layers):
        values = {f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)}
        layers[i] = CONVERTIBLE[type(layer)](
            **values, hc_kind=kind, hc_streams=streams, hc_layer=i, hc_first=i == 0,
            hc_last=i == n_layers - 1, hc_options=dict(options), hc_fp32=fp32,
        )
    return model_config


def convert_trainer_config(config, kind: str = "mhc", streams: int = 4,
                           options: dict | None = None, fp32: bool = True,
                           fresh_connections: bool | None = None):
    """A torchtitan Trainer.Config made HC / mHC, in place: its model converted
    (convert_model_config), then with_connection_checkpoints; returns it."""
    convert_model_config(config.model_spec.model, kind, streams, options, fp32)
    return with_connection_checkpoints(config, fresh_connections)


def with_connection_checkpoints(config, fresh_connections: bool | None = None):
    """A Trainer.Config whose HF state-dict adapter keeps the connections (adapter.py) and
    whose checkpoint manager compares them on every load (MhcCheckpointManager), in place;
    fresh_connections: see MhcCheckpointManager.Config. Returns it."""
    spec = config.model_spec
    if spec.state_dict_adapter is not None:
        spec.state_dict_adapter = with_connections(spec.state_dict_adapter)
    config.checkpoint = mhc_checkpoint_config(config.checkpoint, fresh_connections)
    return config


def _check_block(i: int, layer) -> None:
    if isinstance(layer, HYPER_CONFIGS):
        raise ValueError(
            f"MhcConverter: layers[{i}] is already converted ({type(layer).__qualname__}); "
            "apply the converter (or the override) once (a Trainer.Config whose model the "
            "converter already converted needs with_connection_checkpoints(config) only, "
            "not convert_trainer_config)"
        )
    if getattr(layer, "moe", None) is not None:
        raise NotImplementedError(
            f"MhcConverter: layers[{i}] is a mixture-of-experts block; only dense blocks "
            "(attention + feed_forward) are supported so far"
        )
    if type(layer) not in CONVERTIBLE:
        names = ", ".join(c.__qualname__ for c in CONVERTIBLE)
        raise TypeError(
            f"MhcConverter: layers[{i}] is a {type(layer).__qualname__}; supported block "
            f"configs: {names}"
        )


@override(target=Decoder.Config, description="HC / mHC connections around every sublayer")
def mhc_override(model_config, kind: str = "mhc", streams: int = 4,
                 options: dict | None = None, fp32: bool = True):
    """The converter as a torchtitan override (`--override.imports`): same settings."""
    return convert_model_config(model_config, kind, streams, options, fp32)
