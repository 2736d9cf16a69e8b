"""Saving a converted model and loading it back.

    torch_mhc.hf.save_pretrained(model, "out/")     # model.save_pretrained into a temporary
                                                    # folder, then renamed to out/
    model = torch_mhc.hf.from_pretrained("out/")    # the same converted model

A converted checkpoint is an ordinary transformers checkpoint (config.json, safetensors)
whose config carries `mhc_conversion` = {"kind", "streams", "options"} and whose weights
include the connections' parameters (`...layers.<i>.mhc_attn.phi` etc.). Loading builds the
original architecture with transformers (its weights, dtype, device_map handling), converts it
with the recorded options, then loads the connections' tensors, checking that each is present
and has the shape the conversion gives.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from .convert import CONFIG_KEY, conversion_of, convert

__all__ = ["save_pretrained", "from_pretrained"]

CONNECTION_KEY = r"\.mhc_(attn|mlp)\."  # regex on state dict keys of converted layers
_MARK = (".mhc_attn.", ".mhc_mlp.")


def save_pretrained(model: nn.Module, path: str | os.PathLike, **kwargs) -> Path:
    """model.save_pretrained(path, **kwargs), written to a temporary folder beside `path` and
    renamed into place only when complete: a failure leaves `path` as it was."""
    if conversion_of(model) is None:
        raise ValueError(
            f"{type(model).__name__} is not converted (its config has no {CONFIG_KEY!r}); "
            "use model.save_pretrained for a plain model"
        )
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"save_pretrained expects a folder path, {path} is a file")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    old = path.with_name(f".{path.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
    try:
        model.save_pretrained(tmp, **kwargs)
        if path.exists():
            path.rename(old)  # kept until the new folder is in place
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            old.rename(path)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return path


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{path}: expected model.safetensors or model.safetensors.index.json (save with "
        "torch_mhc.hf.save_pretrained), found "
        f"{sorted(p.name for p in path.iterdir()) if path.is_dir() else 'no folder'}"
    )


def _connection_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if any(m in key for m in _MARK):
                    out[key] = st.get_tensor(key)
    return out


def _load_connections(model: nn.Module, tensors: dict[str, torch.Tensor], path: Path) -> None:
    wanted = {k: v for k, v in model.state_dict().items() if any(m in k for m in _MARK)}
    missing = sorted(set(wanted) - set(tensors))
    unexpected = sorted(set(tensors) - set(wanted))
    if missing or unexpected:
        raise ValueError(
            f"{path}: the connection weights do not match the recorded conversion "
            f"{conversion_of(model)}: missing {missing[:4]}{' ...' if len(missing) > 4 else ''}"
            f", unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}"
        )
    for key, target in wanted.items():
        got = tensors[key]
        if got.shape != target.shape:
            raise ValueError(
                f"{path}: {key} has shape {tuple(got.shape)}, the recorded conversion "
                f"{conversion_of(model)} expects {tuple(target.shape)}"
            )
    with torch.no_grad():
        for key, target in wanted.items():
            target.copy_(tensors[key])


def _model_class(config):
    from transformers import AutoModelForCausalLM

    mapping = AutoModelForCausalLM._model_mapping
    if type(config) not in mapping:
        raise ValueError(
            f"expected a checkpoint of a causal LM known to transformers' AutoModelForCausalLM, "
            f"got config {type(config).__name__}"
        )
    return mapping[type(config)]


def from_pretrained(path: str | os.PathLike, **kwargs) -> nn.Module:
    """Load a converted checkpoint (a local folder) written by save_pretrained.

    kwargs go to transformers' from_pretrained (dtype, device_map, ...).
    """
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    conversion = getattr(config, CONFIG_KEY, None)
    tensors = _connection_tensors(path)
    if conversion is None:
        if tensors:
            raise ValueError(
                f"{path}: the weights hold connection parameters (e.g. {next(iter(tensors))}) "
                f"but config.json lacks {CONFIG_KEY!r} (kind, streams, options), so the "
                "conversion cannot be rebuilt; restore it in config.json"
            )
        raise ValueError(
            f"{path} is not a converted checkpoint: config.json has no {CONFIG_KEY!r}; load it "
            "with transformers' from_pretrained and convert it with torch_mhc.hf.convert"
        )
    cls = _model_class(config)
    delattr(config, CONFIG_KEY)  # the plain model is built first; convert() records it again
    # The connection tensors are loaded below, after conversion: transformers must not report
    # them as unexpected. The class attribute is read once, while the model is built.
    had = "_keys_to_ignore_on_load_unexpected" in cls.__dict__
    previous = cls.__dict__.get("_keys_to_ignore_on_load_unexpected")
    inherited = getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or []
    cls._keys_to_ignore_on_load_unexpected = [*inherited, CONNECTION_KEY]
    try:
        model = cls.from_pretrained(path, config=config, **kwargs)
    finally:
        if had:
            cls._keys_to_ignore_on_load_unexpected = previous
        else:
            del cls._keys_to_ignore_on_load_unexpected
    convert(model, conversion["kind"], conversion["streams"], **conversion.get("options", {}))
    _load_connections(model, tensors, path)
    return model
