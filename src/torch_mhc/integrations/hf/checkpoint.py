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

import fnmatch
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch
from torch import nn

from torch_mhc.integrations.hf.convert import (
    CONFIG_KEY,
    ON_CONVERT,
    check_options,
    conversion_of,
    convert,
)
from torch_mhc.integrations.hf.hub import is_repo_id, resolve_folder
from torch_mhc.integrations.hf.layers import is_converted
from torch_mhc.integrations.hf.portable import TorchMHCConfig, is_portable, write_portable
from torch_mhc.integrations.hf.remote.configuration_torch_mhc import (
    LOADING_OPTIONS,
    ignoring_connection_keys,
)
from torch_mhc.runtime.files import fsync_dir

__all__ = ["save_pretrained", "from_pretrained", "push_to_hub"]

CONNECTIONS_FILE = "mhc_connections.safetensors"
_MARK = (".mhc_attn.", ".mhc_mlp.")
# Weight files of an earlier save that the new one does not overwrite: left in place, transformers
# could load them instead of (or mixed with) the new weights.
_STALE = ("model*.safetensors", "model*.safetensors.index*.json", "pytorch_model*.bin",
          "pytorch_model*.bin.index*.json")


def _is_connection(key: str) -> bool:
    return any(m in key for m in _MARK)


# The model whose transformers save_pretrained _write_checkpoint is running in this thread: its
# own save_pretrained (ModelSave) then writes transformers' files only.
_INNER = threading.local()


class ModelSave:
    """A converted model's own save_pretrained (an attribute of the instance, so that
    transformers' callers, Trainer and push_to_hub, reach it): this module's save_pretrained."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, save_directory, **kwargs):
        if getattr(_INNER, "model", None) is self.model:
            return type(self.model).save_pretrained(self.model, save_directory, **kwargs)
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
    _check_saveable(model, kwargs)
    target = Path(path)
    if kwargs.pop("is_main_process", True) is False:  # another process writes the folder
        return target
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"save_pretrained expects a folder path, {target} is a file")
    created = not target.exists()
    target.mkdir(parents=True, exist_ok=True)  # permissions from the umask, as os.makedirs
    # Inside the target, not beside it: the renames stay on one file system even when the
    # target is a mount point, and only the target needs to be writable (e.g. ".").
    tmp = Path(tempfile.mkdtemp(prefix=".mhc-save-", dir=target))
    try:
        _write_checkpoint(model, tmp, kwargs)
        _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created and not any(target.iterdir()):
            target.rmdir()
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    return target


def _check_saveable(model: nn.Module, kwargs: dict) -> None:
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
    if kwargs.get("push_to_hub"):
        raise ValueError(
            "torch_mhc.hf.save_pretrained does not push (transformers would push the temporary "
            "folder): use torch_mhc.hf.push_to_hub(model, repo_id)"
        )


def _write_checkpoint(model: nn.Module, folder: Path, kwargs: dict) -> None:
    """transformers' checkpoint (the connections in it where their keys survive its save),
    and the connections' own file."""
    from safetensors.torch import save_file

    kwargs = dict(kwargs)
    state = kwargs.pop("state_dict", None)
    state = model.state_dict() if state is None else state
    connections = {k: v for k, v in state.items() if _is_connection(k)}
    offloaded = [k for k, v in connections.items() if v.device.type == "meta"]
    if offloaded:
        raise ValueError(
            f"the connection tensors {offloaded[:4]} are on the meta device (offloaded?); "
            "expected a model whose connections are in memory"
        )
    _INNER.model = model
    try:
        # The connections go into transformers' weight files too, under the model's own keys:
        # tools that load those files back into the model (Trainer's resume_from_checkpoint
        # and load_best_model_at_end) then restore them with the rest. Where transformers
        # renamed any of them on the way, they are left out (a model restored with some of
        # its connections would be silently inconsistent): their own file holds them all.
        model.save_pretrained(folder, state_dict=state, **kwargs)
        if not set(connections) <= _written_keys(folder):  # a renamed key is missing
            for f in folder.iterdir():
                if any(fnmatch.fnmatchcase(f.name, pattern) for pattern in _STALE):
                    f.unlink()
            model.save_pretrained(folder, state_dict={k: v for k, v in state.items()
                                                      if k not in connections}, **kwargs)
    finally:
        _INNER.model = None
    write_portable(model, folder)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in connections.items()}
    # one metadata key: safetensors writes the metadata map in no fixed order, and a folder
    # saved twice must be the same bytes (the version is in config.json's mhc_conversion)
    save_file(tensors, str(folder / CONNECTIONS_FILE), metadata={"format": "pt"})
    _check_written(folder, set(connections))


def _written_keys(folder: Path) -> set[str]:
    """The keys of the safetensors weight files transformers wrote into folder (from their
    indexes where sharded; empty where it wrote none, e.g. pytorch_model.bin)."""
    from safetensors import safe_open

    indexes = sorted(folder.glob("model*.safetensors.index*.json"))
    if indexes:
        return {k for i in indexes for k in json.loads(i.read_text())["weight_map"]}
    keys = set()
    for f in sorted(folder.glob("model*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            keys.update(st.keys())
    return keys


def _check_written(folder: Path, expected: set[str]) -> None:
    """Read back the connection keys that reached the disk: every one must be there."""
    from safetensors import safe_open

    with safe_open(str(folder / CONNECTIONS_FILE), framework="pt") as st:
        written = set(st.keys())
    missing = sorted(expected - written)
    if missing:
        raise ValueError(
            f"{CONNECTIONS_FILE} was written without the connection tensors {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''} ({len(written)} of {len(expected)} keys); "
            "nothing was saved"
        )


def _publish(tmp: Path, target: Path) -> None:
    """Rename every file of the complete checkpoint in tmp into target, then drop stale
    weight files; each file's bytes are on disk before its name is."""
    new = sorted(p for p in tmp.iterdir() if p.is_file())
    umask = os.umask(0)
    os.umask(umask)
    for p in new:
        # safetensors writes its files readable by their owner only; a checkpoint gets a plain
        # file's permissions (0o666 minus the umask), as files.atomic_write gives.
        p.chmod(0o666 & ~umask)
        _fsync(p)
    for p in new:
        os.replace(p, target / p.name)
    names = {p.name for p in new}
    for p in target.iterdir():
        if (p.name not in names and p.is_file()
                and any(fnmatch.fnmatchcase(p.name, pattern) for pattern in _STALE)):
            p.unlink()
    fsync_dir(target)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    tensors = _connection_tensors(path)
    if is_portable(_config_dict(path)):
        config, kwargs = _portable_config(path, kwargs)
    else:
        config = AutoConfig.from_pretrained(path)
    conversion = _conversion_record(config, tensors, path)
    cls = _model_class(config, path)
    _check_device_map(kwargs.get("device_map"))
    with ignoring_connection_keys(cls):
        model = cls.from_pretrained(path, **kwargs)
    _check_not_dispatched(model, kwargs.get("device_map"))
    delattr(model.config, CONFIG_KEY)  # the plain model is converted now; convert() records it
    convert(model, conversion["kind"], conversion["streams"], **conversion.get("options", {}))
    _load_connections(model, tensors, path)
    return model


def _checkpoint_folder(path: str | os.PathLike) -> Path:
    """The folder, if it exists and holds a config.json (else transformers would look for a
    hub repository of that name)."""
    path = Path(path)
    expected = ("a folder written by torch_mhc.hf.save_pretrained (config.json, "
                f"model.safetensors, {CONNECTIONS_FILE}) or the id of a Hub repository "
                "holding one")
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such folder; from_pretrained expects {expected}")
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
            "conversion cannot be rebuilt; restore it in config.json"
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
    from safetensors import safe_open
    from safetensors.torch import load_file

    own = path / CONNECTIONS_FILE
    if own.is_file():
        try:
            return load_file(str(own))
        except Exception as e:
            raise ValueError(f"{own}: expected a safetensors file, cannot read it: {e}") from e
    out = {}
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if _is_connection(key):
                    out[key] = st.get_tensor(key)
    return out


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
    wanted = {k: v for k, v in model.state_dict().items() if _is_connection(k)}
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
