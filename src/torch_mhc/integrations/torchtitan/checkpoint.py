"""Checks between a checkpoint and a model that may or may not carry connections.

torchtitan loads a DCP checkpoint with the model's own keys as the plan: a checkpoint of a
converted (HC / mHC) model loads into an unconverted model without complaint, the connections'
parameters silently left behind, and a converted model asked to load an unconverted
checkpoint stops on the first connection key with DCP's bare "Missing key"; HC against mHC, or
other stream counts, stop on a missing key or a size mismatch.

`MhcCheckpointManager` is torchtitan's CheckpointManager that compares the connections first
(kind, streams, layers) and refuses a mismatch with one line, for DCP and HF checkpoints, and
that exports and imports HF checkpoints with the connections (adapter.py): an HF export
(`last_save_in_hf`) is made a portable folder (config.json from the HF assets' base config,
the code, the connections' own file) that transformers loads as the converted model. The
ready configs (config_registry) use it; `convert_trainer_config` or the `mhc_checkpoint`
override put it into any other configuration. `check_checkpoint_keys` is the same comparison
by hand.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch
from torch import nn
from torchtitan.components.checkpoint import OPTIMIZER, AsyncMode, CheckpointManager
from torchtitan.config.override import override
from torchtitan.tools.logging import logger

from torch_mhc.integrations.torchtitan.adapter import (
    ConnectionAdapterMixin,
    hf_conversion,
    hf_to_titan_key,
    with_connections,
)

# Names of the connection modules a converted block adds (blocks.py).
CONNECTION_MODULES = ("attention_hc", "ffn_hc")
# A model-level connection tensor (optimizer states, stored under longer keys, excluded);
# older layouts stored the model under a "model." prefix.
CONNECTION_KEY = re.compile(r"(?:model\.)?(layers\.(\d+)\.(?:attention_hc|ffn_hc)\.(\w+))")


def connection_shapes(shapes: Mapping[str, tuple]) -> dict[str, tuple]:
    """{key without a "model." prefix: shape} of the connection tensors among `shapes`."""
    out = {}
    for key, shape in shapes.items():
        m = CONNECTION_KEY.fullmatch(key)
        if m is not None:
            out[m[1]] = tuple(shape)
    return out


def describe(connections: Mapping[str, tuple]) -> str:
    """"mHC, n = 4, 12 connections": the kind and stream count the parameters imply."""
    names = {key.rsplit(".", 1)[1]: shape for key, shape in connections.items()}
    if "phi" in names:
        kind, n = "mHC", names.get("b_pre", (0,))[0]
    elif "static_res" in names:
        kind = "HC (dynamic)" if "w" in names else "HC (static)"
        n = names["static_pre"][0] if "static_pre" in names else 0
    else:
        kind, n = "unknown connections", 0
    count = len({key.rsplit(".", 1)[0] for key in connections})
    return f"{kind}, n = {n}, {count} connections"


def compare_connections(stored: Mapping[str, tuple], model: Mapping[str, tuple],
                        source: str) -> None:
    """Raise a one-line ValueError unless checkpoint (`stored`) and model hold the same
    connection tensors with the same shapes (both from connection_shapes)."""
    stored, model = dict(stored), dict(model)
    if stored and not model:
        raise ValueError(
            f"checkpoint {source} holds HC / mHC connection parameters ({len(stored)} tensors, "
            f"e.g. {min(stored)!r}: {describe(stored)}) but the model has no connections: "
            "convert the model with the same MhcConverter settings before loading, or its "
            "function changes"
        )
    if model and not stored:
        raise ValueError(
            f"the model has HC / mHC connections (e.g. {min(model)!r}: {describe(model)}) but "
            f"checkpoint {source} holds none: it was saved by an unconverted model. Load it "
            "into the unconverted model, or start the converted model from it with its "
            "connections freshly initialised (MhcCheckpointManager.Config(fresh_connections="
            "True), a model-only load)"
        )
    if stored != model:
        diff = sorted(set(stored) ^ set(model)) or sorted(
            k for k in stored if stored[k] != model[k])
        key = diff[0]
        raise ValueError(
            f"checkpoint {source} holds other HC / mHC connections than the model: checkpoint "
            f"{describe(stored)}, model {describe(model)} (first difference {key!r}: "
            f"checkpoint {stored.get(key, 'absent')}, model {model.get(key, 'absent')}); "
            "convert the model with the checkpoint's MhcConverter settings"
        )


def model_shapes(state_dict: Mapping) -> dict[str, tuple]:
    """{key: global shape} of the tensors of a (flattened) model state dict."""
    return {k: tuple(v.shape) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}


def stored_shapes(metadata) -> dict[str, tuple]:
    """{key: shape} of the tensors a checkpoint's DCP Metadata lists."""
    return {k: tuple(md.size) for k, md in metadata.state_dict_metadata.items()
            if hasattr(md, "size")}


def checkpoint_keys(checkpoint_dir: str | os.PathLike) -> set[str]:
    """The tensor keys stored in a DCP checkpoint folder (read from its metadata only)."""
    return set(_dcp_metadata(checkpoint_dir).state_dict_metadata)


def _dcp_metadata(checkpoint_dir):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(os.fspath(checkpoint_dir)).read_metadata()


def check_checkpoint_keys(checkpoint_dir: str | os.PathLike, model: nn.Module | list) -> None:
    """Raise a ValueError if checkpoint and model disagree on their connections (present or
    not, kind, streams, layers).

    model: the model or its pipeline parts (a list); keys are compared as torchtitan stores
    them (the model's state-dict keys, possibly under a "model." prefix in older layouts).
    """
    parts = model if isinstance(model, list | tuple) else [model]
    shapes = {k: v for part in parts for k, v in model_shapes(part.state_dict()).items()}
    stored = stored_shapes(_dcp_metadata(checkpoint_dir))
    compare_connections(connection_shapes(stored), connection_shapes(shapes),
                        repr(os.fspath(checkpoint_dir)))


class MhcCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager; every load first compares the checkpoint's
    connections with the model's (compare_connections), and the HF adapter keeps them."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        fresh_connections: bool = False
        """A model-only load of a checkpoint without connections (an unconverted model's)
        into a converted model: the connections keep their initial values, so the converted
        model starts from the checkpoint's function. Otherwise such a load is refused."""

    def __init__(self, config: Config, *, sd_adapter=None, **kwargs):
        self.fresh_connections = config.fresh_connections
        if sd_adapter is not None and not isinstance(sd_adapter, ConnectionAdapterMixin):
            sd_adapter = with_connections(type(sd_adapter))(sd_adapter.model_config,
                                                            sd_adapter.hf_assets_path)
        super().__init__(config, sd_adapter=sd_adapter, **kwargs)

    def dcp_save(self, state_dict, checkpoint_id: str, async_mode,
                 enable_garbage_collection: bool = False, to_hf: bool = False):
        """torchtitan's save; an HF export (to_hf) of a converted model is then made a
        portable folder (portable_export)."""
        result = super().dcp_save(state_dict, checkpoint_id, async_mode,
                                  enable_garbage_collection=enable_garbage_collection,
                                  to_hf=to_hf)
        if to_hf:
            portable_export(self.sd_adapter, checkpoint_id, async_mode)
        return result

    def dcp_load(self, state_dict, checkpoint_id, from_hf: bool, from_quantized: bool) -> None:
        model = connection_shapes(model_shapes(state_dict))
        stored = self._stored_connections(checkpoint_id, from_hf, from_quantized)
        if self.fresh_connections and model and not stored and OPTIMIZER not in state_dict:
            logger.info(f"Checkpoint {checkpoint_id} has no HC / mHC connections: the "
                        f"model's {len(model)} connection tensors keep their initial values.")
            state_dict = {k: v for k, v in state_dict.items() if k not in model}
        else:
            compare_connections(stored, model, repr(checkpoint_id))
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)

    def _stored_connections(self, checkpoint_id, from_hf: bool, from_quantized: bool):
        if from_hf:
            reader = self.sd_adapter.get_hf_storage_reader(checkpoint_id, from_quantized)
            shapes = stored_shapes(reader.read_metadata())
            return {hf_to_titan_key(k): s for k, s in shapes.items() if hf_to_titan_key(k)}
        return connection_shapes(stored_shapes(_dcp_metadata(checkpoint_id)))


def portable_export(sd_adapter, checkpoint_id: str, async_mode=AsyncMode.DISABLED) -> bool:
    """Make the HF export in checkpoint_id a folder that transformers loads as the converted
    model (torch_mhc.hf.make_portable), with the base config.json of the adapter's
    hf_assets_path; True if it did. Rank 0 writes, every rank waits for it. Where that cannot
    be done (no config.json there, transformers missing, weights that do not match), the
    export keeps its weights and a warning says how to finish it by hand."""
    try:
        conversion = hf_conversion(sd_adapter.model_config)
    except ValueError as e:  # blocks converted differently: no HF model matches
        logger.warning(f"HF export {checkpoint_id} is weights only: {e}")
        return False
    if conversion is None:
        return False
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    done = False
    if not dist or torch.distributed.get_rank() == 0:
        done = _make_portable(sd_adapter, checkpoint_id, async_mode, conversion)
    if dist:
        torch.distributed.barrier()
    return done


def _make_portable(sd_adapter, checkpoint_id: str, async_mode, conversion: dict) -> bool:
    assets = sd_adapter.hf_assets_path
    config = os.path.join(assets, "config.json") if assets else None
    arguments = ", ".join(f"{k}={v!r}" for k, v in conversion.items())
    by_hand = (f"torch_mhc.hf.make_portable({os.path.abspath(checkpoint_id)!r}, "
               f"'path/to/the/base/config.json', {arguments})")
    if async_mode != AsyncMode.DISABLED:
        reason = "it was saved asynchronously (its files may not be complete yet)"
    elif config is None or not os.path.isfile(config):
        reason = (f"the HF assets folder {assets!r} has no config.json of the base model" if assets
                  else "no HF assets folder (hf_assets_path) gives the base model's config.json")
    else:
        try:
            import torch_mhc.hf

            _check_scalars(sd_adapter.model_config, config)
            torch_mhc.hf.make_portable(checkpoint_id, config, **conversion)
            logger.info(f"HF export {checkpoint_id} is portable: transformers loads it with "
                        "its connections (trust_remote_code=True), torch_mhc.hf."
                        "from_pretrained too")
            return True
        except ImportError as e:
            reason = f"{e}"
        except Exception as e:  # the weights are written; the other ranks wait at a barrier
            reason = f"with the base config {config}: {type(e).__name__}: {e}"
    logger.warning(
        f"HF export {checkpoint_id} holds the weights with the HC / mHC connections but was not "
        f"made portable, {reason}. A base model's config.json put beside the weights would "
        f"load in transformers without the connections. To make it load with them: {by_hand}")
    return False


# torchtitan's rotary scaling -> transformers' rope_type, and the parameters both name
_ROPE_TYPES = {"none": "default", "llama": "llama3", "yarn": "yarn"}
_LLAMA3_ROPE = (("scaling_factor", "factor"), ("low_freq_factor", "low_freq_factor"),
                ("high_freq_factor", "high_freq_factor"),
                ("original_max_position_embeddings", "original_max_position_embeddings"))


def _check_scalars(model_config, config_file: str) -> None:
    """The base config.json against the torchtitan model on what the weights' shapes do not
    show (the rotary base, its scaling, the final norm's epsilon): a ValueError naming the
    first difference. Values one side does not give are not compared."""
    import json

    with open(config_file) as f:
        hf = json.load(f)
    rope = getattr(getattr(model_config.layers[0], "attention", None), "rope", None)
    norm = getattr(model_config, "norm", None)
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    titan_type = _ROPE_TYPES.get(getattr(rope, "scaling", None))
    pairs = [("rope theta", getattr(rope, "theta", None), params.get("rope_theta",
                                                                      hf.get("rope_theta"))),
             ("norm eps", getattr(norm, "eps", None), hf.get("rms_norm_eps"))]
    if titan_type is not None and titan_type != rope_type:
        raise ValueError(f"its rope type is {rope_type!r}, the torchtitan model's rotary "
                         f"scaling {rope.scaling!r} is transformers' {titan_type!r}")
    if titan_type == "llama3":
        pairs += [(f"rope {hf_name}", getattr(rope, titan_name, None), params.get(hf_name))
                  for titan_name, hf_name in _LLAMA3_ROPE]
    for what, titan, base in pairs:
        if titan is not None and base is not None and float(titan) != float(base):
            raise ValueError(f"its {what} is {base}, the torchtitan model's {titan}")


def mhc_checkpoint_config(config, fresh_connections: bool | None = None):
    """`config` (a CheckpointManager.Config) as an MhcCheckpointManager.Config, every field
    kept; fresh_connections set when given."""
    if not isinstance(config, MhcCheckpointManager.Config):
        if type(config) is not CheckpointManager.Config:
            raise TypeError(
                "the HC / mHC checkpoint checks extend torchtitan's CheckpointManager; got "
                f"{type(config).__qualname__}"
            )
        values = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
        config = MhcCheckpointManager.Config(**values)
    if fresh_connections is not None:
        config.fresh_connections = bool(fresh_connections)
    return config


@override(target=CheckpointManager.Config,
          description="connection checks on load, HF export with the connections")
def mhc_checkpoint(config, fresh_connections: bool = False):
    """MhcCheckpointManager as a torchtitan override (`--override.imports`), to pair with
    mhc_override on an unchanged configuration."""
    return mhc_checkpoint_config(config, fresh_connections)
