"""A folder of a converted model's weights, written by another tool, made portable in place.

Another trainer's Hugging Face export (torchtitan's, through the connection-keeping adapter
of torch_mhc.integrations.torchtitan) writes transformers' weight files of the base
architecture with the connections' tensors among them (`model.layers.<i>.mhc_attn.phi`, ...),
and nothing else. Put the base model's config.json beside them and plain transformers loads
the base model, listing the connections as unexpected keys: the wrong function, without an
error. `make_portable` adds what torch_mhc.hf.save_pretrained writes beside the weights:

    config.json                    the portable config (portable.py): model_type "torch_mhc",
                                   the base config inside, the conversion, the layers' record
    mhc_connections.safetensors    the connections' tensors, read from the weight files
    the remote code                so that transformers alone (trust_remote_code=True) loads
                                   the converted model, and refuses the folder without it

    torch_mhc.hf.make_portable("outputs/checkpoint/step-1000", "assets/hf/Llama-3.1-8B",
                               kind="mhc", streams=4)

The weight files are read (their headers, and the connections' tensors), never rewritten.
Before anything is written, the model that config.json and the conversion describe is built
on the meta device and compared with the weight files: every connection tensor there and of
its shape, every other tensor of the base model's shape, none missing but tied copies. The
new files are written into a hidden folder inside the target first, then each renamed into
place, so a failure leaves the folder as it was. A config.json already there is replaced,
unless it is a portable one recording another conversion (the options, which the weights
cannot show, would change): that is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from torch_mhc.integrations.hf.checkpoint import weight_file_connections, weight_files
from torch_mhc.integrations.hf.convert import check_options, convert
from torch_mhc.integrations.hf.portable import CODE_FILES, is_portable, layers_record
from torch_mhc.integrations.hf.remote.checkpoint_torch_mhc import (
    is_connection,
    write_beside_weights,
    write_staged,
)
from torch_mhc.integrations.hf.remote.configuration_torch_mhc import CONVERSION_KEY

__all__ = ["make_portable"]

# safetensors' dtype names -> config.json's "dtype"
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def make_portable(folder: str | os.PathLike, base_config, *, kind: str, streams: int,
                  **options) -> Path:
    """Make `folder` (weight files of a converted model, the connections among them) a
    checkpoint that torch_mhc.hf.from_pretrained and transformers (trust_remote_code=True)
    load as the converted model; returns the folder.

    base_config: the base model's transformers config: a PretrainedConfig, its config.json,
        or a folder holding one (e.g. torchtitan's hf_assets_path).
    kind, streams, options: the conversion the weights were trained with, as
        torch_mhc.hf.convert takes them (for a torchtitan model,
        `**torch_mhc.integrations.torchtitan.hf_conversion(model_config)`).
    Raises (nothing written) ValueError where the weights do not match that model or the
    folder records another conversion, FileNotFoundError / NotADirectoryError for a path
    that is not a folder of weight files or a config, TypeError for a base_config of
    another type.
    """
    folder = _weights_folder(folder)
    config = _base_config(base_config)
    check_options(kind, streams, options)
    model = _meta_model(config, kind, streams, options)
    record = json.loads(model.config.to_json_string(use_diff=True))
    record["architectures"] = [type(model).__name__]
    _check_recorded(folder, model.config.mhc_conversion, record)
    stored = _stored(folder)
    _compare(folder, model, stored)
    tensors = _connection_tensors(folder)
    dtypes = {dtype for key, (_, dtype, _) in stored.items() if not is_connection(key)}
    if len(dtypes) == 1 and next(iter(dtypes)) in _DTYPES:
        record["dtype"] = _DTYPES[next(iter(dtypes))]
    layers = layers_record(model)
    # the weight files stay as they were written
    write_staged(folder, lambda tmp: write_beside_weights(tmp, record, layers, CODE_FILES,
                                                          tensors), drop_stale=False)
    return folder


def _weights_folder(folder) -> Path:
    given, path = str(folder), Path(folder)
    if path.is_file():
        raise NotADirectoryError(f"{given} is a file; make_portable expects the folder of "
                                 "transformers weight files it belongs to")
    if not path.is_dir():
        raise FileNotFoundError(
            f"{given}: no such folder; make_portable expects a folder of transformers weight "
            "files (model.safetensors, or shards with model.safetensors.index.json)")
    if not any((path / name).is_file()
               for name in ("model.safetensors", "model.safetensors.index.json")):
        raise FileNotFoundError(
            f"{given} holds no model.safetensors or model.safetensors.index.json (it holds "
            f"{sorted(p.name for p in path.iterdir())}); make_portable expects transformers "
            "weight files")
    return path


# base config keys that differ between two saves of one model (not its function)
_VOLATILE = {"attn_implementation", "experts_implementation", "transformers_version", "dtype",
             "torch_dtype", "architectures", "_name_or_path", "model_type"}


def _check_recorded(folder: Path, conversion: dict, base: dict) -> None:
    """A folder already portable records the conversion and base config it was saved with:
    refuse others (the options, such as sinkhorn_iters, and settings such as the rotary
    base are not in the weights to be checked).
    conversion, base: what convert records for the arguments given, and the base config."""
    try:
        record = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return  # none, or not JSON: replaced
    if not (isinstance(record, dict) and is_portable(record)):
        return
    recorded = record.get(CONVERSION_KEY) or {}
    keys = ("kind", "streams", "options")
    if [recorded.get(k) for k in keys] != [conversion[k] for k in keys]:
        raise ValueError(
            f"{folder}/config.json already records the conversion {recorded!r}; got "
            f"{ {k: conversion[k] for k in keys}!r}: pass the recorded kind, streams and "
            "options (or remove config.json if it is wrong)")
    old = record.get("base_config") or {}
    differ = sorted(k for k in set(old) & set(base) - _VOLATILE - {CONVERSION_KEY}
                    if old[k] != base[k])
    if differ:
        raise ValueError(
            f"{folder}/config.json already records another base config: {differ[0]} is "
            f"{old[differ[0]]!r} there, {base[differ[0]]!r} in the one given"
            f"{f' (and {len(differ) - 1} more)' if len(differ) > 1 else ''}; pass the "
            "recorded base config (or remove config.json if it is wrong)")


def _base_config(base_config):
    """A PretrainedConfig from a config, a config.json or a folder holding one."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(base_config, PretrainedConfig):
        return base_config
    if not isinstance(base_config, str | os.PathLike):
        raise TypeError(
            f"base_config must be a transformers PretrainedConfig, the path of the base "
            f"model's config.json or of a folder holding one; got {type(base_config).__name__}")
    path = Path(base_config)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"{base_config}: expected the base model's config.json or a folder holding one "
            "(e.g. torchtitan's hf_assets_path), found "
            + ("a folder without config.json" if path.is_dir() else "no such file"))
    try:
        config_dict = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} cannot be read as JSON: {e}") from None
    if not isinstance(config_dict, dict) or "model_type" not in config_dict:
        raise ValueError(f"{file}: expected a transformers config.json (an object with a "
                         "model_type)")
    if is_portable(config_dict):
        raise ValueError(f"{file} is a converted checkpoint's config; expected the base "
                         "model's")
    return AutoConfig.from_pretrained(file.parent if file.name == "config.json" else file)


def _meta_model(config, kind: str, streams: int, options: dict) -> nn.Module:
    """The converted model config and conversion describe, on the meta device (no memory)."""
    import transformers

    names = list(getattr(config, "architectures", None) or [])
    cls = getattr(transformers, names[0], None) if names else None
    with torch.device("meta"):
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            model = cls(config)
        else:  # a config.json without architectures: the causal LM of its model type
            try:
                model = transformers.AutoModelForCausalLM.from_config(config)
            except ValueError as e:
                raise ValueError(
                    f"the base config names no transformers model class (architectures "
                    f"{names!r}) and its model_type {config.model_type!r} has no causal LM: "
                    f"{e}") from None
    return convert(model, kind, streams, **options)


def _stored(folder: Path) -> dict[str, tuple[tuple, str, Path]]:
    """{key: (shape, safetensors dtype, file)} of the folder's weight files (headers only)."""
    from safetensors import safe_open

    out = {}
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt") as st:
            for key in st.keys():
                piece = st.get_slice(key)
                out[key] = (tuple(piece.get_shape()), piece.get_dtype(), file)
    return out


def _compare(folder: Path, model: nn.Module, stored: dict) -> None:
    """Refuse weights that are not the model's: the connections and the base tensors."""
    conversion = model.config.mhc_conversion
    what = f"{type(model).__name__} converted with kind={conversion['kind']!r}, " \
           f"streams={conversion['streams']}"
    state = model.state_dict(keep_vars=True)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    mine = {k for k in shapes if is_connection(k)}
    theirs = {k for k in stored if is_connection(k)}
    if mine and not theirs:
        raise ValueError(
            f"{folder}: the weight files hold no connection tensors (keys such as "
            "'model.layers.0.mhc_attn.phi'): an unconverted model's weights, or an export "
            "that dropped them (torchtitan: use with_connection_checkpoints or "
            "MhcCheckpointManager)")
    present = {id(state[k]) for k in stored if k in state}
    untied = {k for k in set(shapes) - set(stored) if id(state[k]) not in present}
    problems = [f"missing {key}" for key in sorted(mine - theirs)]
    problems += [f"unexpected {key}" for key in sorted(set(stored) - set(shapes))]
    problems += [f"{key} has shape {stored[key][0]}, expected {shapes[key]}"
                 for key in sorted(set(stored) & set(shapes)) if stored[key][0] != shapes[key]]
    problems += [f"missing {key}" for key in sorted(untied - mine)]
    if problems:
        held = ""
        if theirs:
            module = min(theirs).rsplit(".", 1)[0]
            held = "; the weights' {} holds {}".format(module, ", ".join(
                f"{k.rsplit('.', 1)[1]} {stored[k][0]}" for k in sorted(theirs)
                if k.rsplit(".", 1)[0] == module))
        raise ValueError(
            f"{folder}: the weight files are not those of {what} (from the base config): "
            + "; ".join(problems[:6])
            + (f" (and {len(problems) - 6} more)" if len(problems) > 6 else "")
            + f"{held}. Pass the base config and the conversion the model was trained with")


def _connection_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = weight_file_connections(folder)
    bad = sorted(k for k, v in tensors.items()
                 if not v.is_floating_point() or not bool(torch.isfinite(v).all()))
    if bad:
        raise ValueError(f"{folder}: the connection tensors {bad[:4]} are not finite floating "
                         "point values (a checkpoint of a diverged run?)")
    return tensors
