"""Saving a converted model and loading it back.

    torch_mhc.hf.save_pretrained(model, "out/")     # or model.save_pretrained("out/")
    model = torch_mhc.hf.from_pretrained("out/")    # the same converted model

A converted checkpoint is a transformers checkpoint of the original architecture's weights
(model.safetensors or shards with their index) with a portable config.json (model_type
"torch_mhc", the base model's config inside it, `mhc_conversion` = {"kind", "streams",
"options"}; see portable.py), the code that loads it with transformers alone, and
`mhc_connections.safetensors`: the connections' tensors under the converted model's own
state-dict keys (`model.layers.<i>.mhc_attn.phi` etc.). Loading reads them from that file:
transformers renames keys on save with per-model regexes, and some of them rewrite ours
(Mixtral turns `.mhc_mlp.` into `.mhc.block_sparse_moe.`, its pattern `.mlp.` having
unescaped dots). The weight files hold them too where their keys come through transformers'
save unchanged (every family but Mixtral among those tested), so that tools which load the
weight files back into the model, transformers.Trainer resuming a checkpoint, restore them.
Checkpoints of the earlier formats still load: a config.json of the base architecture
carrying `mhc_conversion`, with the connections in their own file or in the transformers
weight files.

convert() makes a converted model's own save_pretrained (hence transformers.Trainer's
checkpoints and push_to_hub) write this same checkpoint.

Loading checks the recorded options as convert would (before any weight is read), builds the
architecture named in config.json with transformers (its weights, dtype, single-device
device_map handling), converts it with those options, then loads the connections' tensors,
checking that each is present, floating point, finite and of the shape the conversion gives.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from torch_mhc.connections import Connection
from torch_mhc.integrations.hf.convert import (
    CONFIG_KEY,
    ON_CONVERT,
    check_options,
    conversion_of,
    convert,
)
from torch_mhc.integrations.hf.hub import is_repo_id, resolve_folder
from torch_mhc.integrations.hf.layers import is_converted
from torch_mhc.integrations.hf.portable import (
    CODE_FILES,
    TorchMHCConfig,
    is_portable,
    layers_record,
)
from torch_mhc.integrations.hf.remote.checkpoint_torch_mhc import (
    CONNECTIONS_FILE,
    is_connection,
    write_folder,
)
from torch_mhc.integrations.hf.remote.configuration_torch_mhc import (
    LOADING_OPTIONS,
    ignoring_connection_keys,
    task_class,
)

__all__ = ["save_pretrained", "from_pretrained", "push_to_hub"]


class ModelSave:
    """A converted model's own save_pretrained (an attribute of the instance, so that
    transformers' callers, Trainer and push_to_hub, reach it): this module's save_pretrained."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, save_directory, **kwargs):
        return save_pretrained(self.model, save_directory, **kwargs)


def _install_save(model: nn.Module) -> None:
    model.save_pretrained = ModelSave(model)


ON_CONVERT.append(_install_save)


# ------------------------------------------------------------------------------------------
# Saving


def save_pretrained(model: nn.Module, path: str | os.PathLike, **kwargs) -> Path:
    """Save a converted model into the folder `path` (created if missing); returns the path.

    kwargs go to transformers' save_pretrained (max_shard_size, variant, ...). As with
    transformers, files in the folder that the save does not write (a tokenizer, a README)
    stay; the checkpoint's files are replaced, and weight files of an earlier save that this
    one does not overwrite (model*.safetensors, index files, pytorch_model*.bin) are removed.
    is_main_process=False (transformers.Trainer's other processes) writes nothing.

    The checkpoint is first written completely into a temporary folder inside `path` and its
    connection keys read back; only then is each file renamed into `path` (a rename replaces a
    file whole). A failure before that point leaves `path` as it was and removes the temporary
    folder (and `path` itself, if this call created it and it is empty). A crash during the
    renames, a moment, can leave some of the checkpoint's files new and the others old, each
    complete, and stale weight files not yet removed: saving again repairs that. A killed
    process also leaves its hidden `.mhc-save-*` folder in `path`, which loading ignores and
    which can be deleted.
    """
    _check_saveable(model)
    return write_folder(model, path, kwargs, layers_record(model), CODE_FILES)


def _check_saveable(model: nn.Module) -> None:
    if hasattr(model, "peft_config") and hasattr(model, "merge_and_unload"):  # a PeftModel
        raise ValueError(
            f"torch_mhc.hf.save_pretrained expects a converted transformers model, got a PEFT "
            f"{type(model).__name__}: save the adapter with its own save_pretrained (trainable "
            "connections in modules_to_save go with it; load it onto the converted base), or "
            "merge it (model.merge_and_unload()) and save the merged model here"
        )
    if conversion_of(model) is None:
        raise ValueError(
            f"{type(model).__name__} is not converted (its config has no {CONFIG_KEY!r}); "
            "use model.save_pretrained for a plain model"
        )
    if not any(is_converted(m) for m in model.modules()):
        raise ValueError(
            f"{type(model).__name__}'s config records a conversion ({conversion_of(model)}) but "
            "its layers are plain (a config object shared with a model that was converted?); "
            "expected a model converted with torch_mhc.hf.convert"
        )
    # get_peft_model(model, LoraConfig(modules_to_save=[...])) wraps the connections in
    # place: their tensors would be saved under the wrapper's names, which no load accepts
    wrapped = [f"{name}.{attr}" for name, m in model.named_modules() if is_converted(m)
               for attr in ("mhc_attn", "mhc_mlp")
               if not isinstance(getattr(m, attr, None), Connection)]
    if wrapped:
        raise ValueError(
            f"torch_mhc.hf.save_pretrained expects a converted model whose connections are "
            f"torch-mhc connections, got {type(model.get_submodule(wrapped[0])).__name__} at "
            f"{wrapped[0]} (PEFT's modules_to_save wraps them in the model it was given): save "
            "the adapter with the PeftModel's save_pretrained, or merge it "
            "(peft_model.merge_and_unload()) and save the merged model here"
        )


# ------------------------------------------------------------------------------------------
# Loading


def push_to_hub(model: nn.Module, repo_id: str, *, commit_message: str | None = None,
                private: bool | None = None, token: str | None = None,
                revision: str | None = None, **save_kwargs):
    """Upload the converted model's portable folder (exactly what save_pretrained writes) to
    the Hub repository repo_id, created if missing; returns huggingface_hub's commit info."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="mhc-push-") as tmp:
        folder = save_pretrained(model, Path(tmp) / "model", **save_kwargs)
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        return api.upload_folder(
            repo_id=repo_id, folder_path=str(folder), repo_type="model", revision=revision,
            commit_message=commit_message or f"Upload {type(model).__name__} (torch-mhc)",
        )


def from_pretrained(path: str | os.PathLike, **kwargs) -> nn.Module:
    """Load a converted checkpoint written by save_pretrained: a local folder, or a Hub
    repository id ("owner/name", read through huggingface_hub's cache; revision, cache_dir,
    token, local_files_only go to its download).

    The model class is the one the checkpoint was saved from (the architectures of its base
    config).
    kwargs go to transformers' from_pretrained: dtype, a single-device device_map ("cpu",
    "cuda:0", {"": 0}), config attributes (output_hidden_states=True), ... A device_map that
    spreads the model over several devices or offloads it is refused: load it onto one device,
    then dispatch it with accelerate.
    """
    return load_for(None, path, **kwargs)


def load_for(auto_class: str | None, path: str | os.PathLike, **kwargs) -> nn.Module:
    """from_pretrained for transformers' Auto class auto_class (one of TASK_AUTO_CLASSES),
    which builds the base model type's class for its task (a new head where the checkpoint
    holds another); None: the class the checkpoint was saved from."""
    from transformers import AutoConfig

    if "config" in kwargs:
        raise TypeError(
            "torch_mhc.hf.from_pretrained takes no config=: the config is read from the "
            "checkpoint's config.json, which records the conversion; pass config attributes "
            "as keyword arguments (e.g. output_hidden_states=True) or edit config.json"
        )
    if is_repo_id(path):
        path, kwargs = resolve_folder(path, kwargs)
    path = _checkpoint_folder(path)
    saved = _config_dict(path)
    # a reference-LM run exported by `mhc export-hf`: a model of its own with its own code
    from torch_mhc.integrations.hf.remote.configuration_torch_mhc_lm import TorchMhcLMConfig

    if saved.get("model_type") == TorchMhcLMConfig.model_type:
        raise ValueError(
            f"{path} holds a reference-LM run exported by `mhc export-hf` (model_type "
            f"{TorchMhcLMConfig.model_type!r}), not a converted transformers model: load it with "
            f"transformers.AutoModelForCausalLM.from_pretrained({str(path)!r}, "
            "trust_remote_code=True), or the run itself with torch_mhc.lm.load_model")
    tensors = _connection_tensors(path)
    if is_portable(saved):
        config, kwargs = _portable_config(path, kwargs)
    else:
        config = AutoConfig.from_pretrained(path)
    conversion = _conversion_record(config, tensors, path)
    cls = task_class(_model_class(config, path), type(config), auto_class)
    _check_device_map(kwargs.get("device_map"))
    with ignoring_connection_keys(cls):
        model = cls.from_pretrained(path, **kwargs)
    _check_not_dispatched(model, kwargs.get("device_map"))
    delattr(model.config, CONFIG_KEY)  # the plain model is converted now; convert() records it
    name = model.name_or_path  # the folder, which holds the converted model: kept
    convert(model, conversion["kind"], conversion["streams"], **conversion.get("options", {}))
    model.name_or_path = name
    _load_connections(model, tensors, path)
    return model


def _checkpoint_folder(path: str | os.PathLike) -> Path:
    """The folder, if it exists and holds a config.json (else transformers would look for a
    hub repository of that name)."""
    given, path = str(path), Path(path)  # the error names the path as given ("./nope")
    expected = ("a folder written by torch_mhc.hf.save_pretrained (config.json, "
                f"model.safetensors, {CONNECTIONS_FILE}) or the id of a Hub repository "
                "holding one")
    if path.is_file():
        raise NotADirectoryError(
            f"{given} is a file, not a folder; from_pretrained expects {expected}"
            + (f" (here: {path.parent})" if path.name == "config.json" else ""))
    if not path.is_dir():
        raise FileNotFoundError(f"{given}: no such folder; from_pretrained expects {expected}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} has no config.json (it holds {sorted(p.name for p in path.iterdir())}); "
            f"from_pretrained expects {expected}"
        )
    return path


def _config_dict(path: Path) -> dict:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}/config.json cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}/config.json holds {type(config).__name__}, expected an object")
    return config


def _portable_config(path: Path, kwargs: dict) -> tuple:
    """(the base config with the conversion recorded, the kwargs for the base class's
    from_pretrained, config= included): kwargs naming base config attributes set them."""
    import inspect

    from transformers import PreTrainedModel

    config = TorchMHCConfig.from_pretrained(path)
    named = {*inspect.signature(PreTrainedModel.from_pretrained).parameters, *LOADING_OPTIONS}
    try:
        base, unused = config.base(**{k: v for k, v in kwargs.items() if k not in named})
    except ValueError as e:
        raise ValueError(f"{path}/config.json: {e}") from None
    return base, {**{k: v for k, v in kwargs.items() if k in named}, **unused, "config": base}


def _conversion_record(config, tensors: dict[str, torch.Tensor], path: Path) -> dict:
    """config.json's mhc_conversion, checked to hold the kind and the number of streams."""
    conversion = getattr(config, CONFIG_KEY, None)
    if conversion is None and tensors:
        raise ValueError(
            f"{path}: the weights hold connection parameters (e.g. {next(iter(tensors))}) "
            f"but config.json lacks {CONFIG_KEY!r} (kind, streams, options), so the "
            "conversion cannot be rebuilt; torch_mhc.hf.make_portable(folder, base_config, "
            "kind=..., streams=..., **options) writes it with the rest of a portable folder "
            "(for a torchtitan export: "
            "**torch_mhc.integrations.torchtitan.hf_conversion(model_config))"
        )
    if conversion is None:
        raise ValueError(
            f"{path} is not a converted checkpoint: config.json has no {CONFIG_KEY!r}; load it "
            "with transformers' from_pretrained and convert it with torch_mhc.hf.convert"
        )
    if (not isinstance(conversion, dict) or not isinstance(conversion.get("kind"), str)
            or not isinstance(conversion.get("streams"), int)
            or not isinstance(conversion.get("options", {}), dict)):
        raise ValueError(
            f"{path}/config.json: {CONFIG_KEY!r} is damaged: expected {{'kind': str, "
            f"'streams': int, 'options': dict}} as save_pretrained writes it, got {conversion!r}"
        )
    try:  # before the model is loaded: the values every connection constructor checks
        check_options(conversion["kind"], conversion["streams"], conversion.get("options", {}))
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{path}/config.json: {CONFIG_KEY!r} records a conversion that cannot be rebuilt: "
            f"{e} (got {conversion!r})"
        ) from None
    return conversion


def _model_class(config, path: Path) -> type:
    """The transformers class named first in config.json's architectures, which
    model.save_pretrained records: a converted classifier comes back as a classifier."""
    import transformers

    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ValueError(
            f"{path}/config.json: expected 'architectures' to name the transformers model "
            f"class the checkpoint was saved from (e.g. ['LlamaForCausalLM']), got {names!r}, "
            f"which transformers {transformers.__version__} does not provide"
        )
    return cls


def _connection_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The connections' tensors: from their own file, or (earlier format) from the
    transformers weight files, where they were stored under the same keys."""
    from safetensors.torch import load_file

    own = path / CONNECTIONS_FILE
    if own.is_file():
        try:
            return load_file(str(own))
        except Exception as e:
            raise ValueError(f"{own}: expected a safetensors file, cannot read it: {e}") from e
    return weight_file_connections(path)


def weight_file_connections(path: Path) -> dict[str, torch.Tensor]:
    """The connections' tensors stored in the folder's transformers weight files."""
    from safetensors import safe_open

    out = {}
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if is_connection(key):
                    out[key] = st.get_tensor(key)
    return out


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{path}: expected model.safetensors or model.safetensors.index.json (save with "
        f"torch_mhc.hf.save_pretrained), found {sorted(p.name for p in path.iterdir())}"
    )


def _dispatch_error(device_map, placed) -> ValueError:
    # accelerate's hooks keep each layer's forward as it was when they were attached (the plain
    # layer's) and place only the modules that existed then (not the connections).
    return ValueError(
        f"torch_mhc.hf.from_pretrained loads a converted model onto one device; "
        f"device_map={device_map!r} places it on {placed} with accelerate hooks, which would "
        "run the unconverted layers. Load it with no device_map or a single device ('cpu', "
        "'cuda:0', {'': 0}), then dispatch the converted model: accelerate.dispatch_model("
        "model, accelerate.infer_auto_device_map(model, max_memory=..., "
        "no_split_module_classes=list(model._no_split_modules)), offload_dir=...)"
    )


def _check_device_map(device_map) -> None:
    """Refuse before loading what transformers would dispatch with hooks (its own test)."""
    if isinstance(device_map, dict):
        devices = set(device_map.values())
        if len(devices) > 1 or "disk" in devices:
            raise _dispatch_error(device_map, sorted(map(str, devices)))


def _check_not_dispatched(model: nn.Module, device_map) -> None:
    """A device_map strategy ("auto", ...) is resolved while loading: refuse hooks after it."""
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        placed = sorted(set(map(str, getattr(model, "hf_device_map", {}).values())))
        raise _dispatch_error(device_map, placed or "several devices")


def _load_connections(model: nn.Module, tensors: dict[str, torch.Tensor], path: Path) -> None:
    wanted = {k: v for k, v in model.state_dict().items() if is_connection(k)}
    missing = sorted(set(wanted) - set(tensors))
    unexpected = sorted(set(tensors) - set(wanted))
    if missing or unexpected:
        raise ValueError(
            f"{path}: the connection weights do not match the recorded conversion "
            f"{conversion_of(model)}: missing {missing[:4]}{' ...' if len(missing) > 4 else ''}"
            f", unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}"
        )
    for key, target in wanted.items():
        _check_tensor(model, path, key, tensors[key], target)
    with torch.no_grad():
        for key, target in wanted.items():
            target.copy_(tensors[key])


def _check_tensor(model: nn.Module, path: Path, key: str, got: torch.Tensor,
                  target: torch.Tensor) -> None:
    """A loaded connection tensor must be floating point, of the converted model's shape and
    finite: copy_ would cast integers and booleans silently and carry NaN or Inf into every
    forward pass."""
    where = f"{path}/{CONNECTIONS_FILE}" if (path / CONNECTIONS_FILE).is_file() else str(path)
    if not got.is_floating_point():
        raise ValueError(
            f"{where}: {key} has dtype {got.dtype}; expected a floating-point tensor (as "
            f"save_pretrained writes the connections, here {target.dtype})"
        )
    if got.shape != target.shape:
        raise ValueError(
            f"{path}: {key} has shape {tuple(got.shape)}, the recorded conversion "
            f"{conversion_of(model)} expects {tuple(target.shape)}"
        )
    finite = torch.isfinite(got)
    if not bool(finite.all()):
        nan = int(torch.isnan(got).sum())
        raise ValueError(
            f"{where}: {key} holds {nan} NaN and {int((~finite).sum()) - nan} infinite values "
            f"of {got.numel()}; expected finite values (a checkpoint of a diverged run?)"
        )
