"""Writing a converted model's portable folder, for torch-mhc and for this folder's own code.

torch_mhc.hf.save_pretrained writes a converted model with `write_folder`; so does the
save_pretrained of a model loaded from such a folder by transformers alone
(trust_remote_code=True), which Trainer's checkpoints and push_to_hub call: what either saves
loads again as the converted model, never as the base model without its connections.

A folder holds transformers' weight files of the base architecture (the connections in them
too where transformers' save keeps their keys: Mixtral's renaming rewrites `.mhc_mlp.`, and
its files are written without them), config.json in the portable form (portable_config), the
connections' own file under the model's state-dict keys, and the code that loads it.

The checkpoint is first written completely into a temporary folder inside the target and its
connection keys read back; only then is each file renamed into the target (a rename replaces a
file whole), and weight files of an earlier save that this one does not overwrite are removed.
A failure before the renames leaves the target as it was.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import tempfile
from pathlib import Path

import safetensors.torch
from safetensors import safe_open
from torch import nn

from .configuration_torch_mhc import CONNECTION_MODULES, portable_config

CONNECTIONS_FILE = "mhc_connections.safetensors"
MARK = tuple(f".{name}." for name in CONNECTION_MODULES)  # in the connections' state-dict keys
# The code a folder carries: this folder's modules and the maths they import
CODE_FILES = ("configuration_torch_mhc.py", "modeling_torch_mhc.py", "connections.py",
              "checkpoint_torch_mhc.py", "sinkhorn.py", "maps.py", "successors.py")
# Weight files of an earlier save that the new one does not overwrite: left in place, transformers
# could load them instead of (or mixed with) the new weights.
STALE = ("model*.safetensors", "model*.safetensors.index*.json", "pytorch_model*.bin",
         "pytorch_model*.bin.index*.json")


def is_connection(key: str) -> bool:
    return any(m in key for m in MARK)


def write_folder(model: nn.Module, path, kwargs: dict, layers: dict, code_files: dict) -> Path:
    """Save the converted model into the folder path (created if missing); returns it.

    kwargs: transformers' save_pretrained's (state_dict, max_shard_size, ...);
    is_main_process=False writes nothing. layers: config.json's mhc_layers (portable_config).
    code_files: {name in the folder: the file to copy there}."""
    kwargs = dict(kwargs)
    target = Path(path)
    if kwargs.pop("is_main_process", True) is False:  # another process writes the folder
        return target
    if kwargs.get("push_to_hub"):
        raise ValueError(
            "save_pretrained does not push (transformers would push its own files before the "
            "converted model's): use model.push_to_hub(repo_id) (or torch_mhc.hf.push_to_hub), "
            "which uploads the whole saved folder"
        )
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"save_pretrained expects a folder path, {target} is a file")
    created = not target.exists()
    target.mkdir(parents=True, exist_ok=True)  # permissions from the umask, as os.makedirs
    try:
        write_staged(target, lambda tmp: _write(model, tmp, kwargs, layers, code_files))
    except BaseException:
        if created and not any(target.iterdir()):
            target.rmdir()
        raise
    return target


def write_staged(target: Path, write, drop_stale: bool = True) -> None:
    """write(tmp) into a hidden temporary folder inside target, then publish_files(tmp,
    target, drop_stale); the temporary folder is removed whatever happens. Inside the target,
    not beside it: the renames stay on one file system even when the target is a mount
    point, and only the target needs to be writable (e.g. ".")."""
    tmp = Path(tempfile.mkdtemp(prefix=".mhc-save-", dir=target))
    try:
        write(tmp)
        publish_files(tmp, target, drop_stale)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write(model: nn.Module, folder: Path, kwargs: dict, layers: dict,
           code_files: dict) -> None:
    given = kwargs.pop("state_dict", None)
    state = model.state_dict() if given is None else given
    connections = {k: v for k, v in state.items() if is_connection(k)}
    if given is not None:
        _check_given_state(model, connections)
    offloaded = [k for k, v in connections.items() if v.device.type == "meta"]
    if offloaded:
        raise ValueError(
            f"the connection tensors {offloaded[:4]} are on the meta device (offloaded?); "
            "expected a model whose connections are in memory"
        )
    # The class's save_pretrained: the instance's own (this save) would call back here.
    # The connections go into its weight files too, under the model's own keys: tools that
    # load those files back into the model (Trainer's resume_from_checkpoint and
    # load_best_model_at_end) then restore them with the rest. Where transformers renamed any
    # of them on the way, they are left out (a model restored with some of its connections
    # would be silently inconsistent): their own file holds them all.
    # (Each save gets a dict of its own: transformers pops the entries of the one it is given.)
    save = type(model).save_pretrained
    save(model, folder, state_dict=dict(state), **kwargs)
    written = _written_keys(folder)
    if written and not set(connections) <= written:  # a renamed key is missing
        for f in folder.iterdir():
            if any(fnmatch.fnmatchcase(f.name, pattern) for pattern in STALE):
                f.unlink()
        save(model, folder, state_dict={k: v for k, v in state.items()
                                        if k not in connections}, **kwargs)
    base = json.loads((folder / "config.json").read_text())
    write_beside_weights(folder, base, layers, code_files, connections)


def write_beside_weights(folder: Path, base: dict, layers: dict, code_files: dict,
                         connections: dict) -> None:
    """What a portable folder holds beside its weight files: config.json from the base
    model's (the conversion recorded) and the layers' record, the code, and the connections'
    own file, its keys read back."""
    (folder / "config.json").write_text(
        json.dumps(portable_config(base, layers), indent=2, sort_keys=True) + "\n")
    for name, source in code_files.items():
        shutil.copyfile(source, folder / name)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in connections.items()}
    # one metadata key: safetensors writes the metadata map in no fixed order, and a folder
    # saved twice must be the same bytes (the version is in config.json's mhc_conversion)
    safetensors.torch.save_file(tensors, str(folder / CONNECTIONS_FILE),
                                metadata={"format": "pt"})
    check_written(folder, set(connections))


# wrappers whose names appear in module paths but not in a saved state dict's keys (DDP's
# "module." as a prefix only)
_WRAPPERS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def _check_given_state(model: nn.Module, connections: dict) -> None:
    """A state_dict= given to save_pretrained must hold every tensor of every connection, and
    no other under a connection's name (else the folder saved would not load). Read from the
    module tree, not from model.state_dict(): under FSDP that gathers across processes, and
    only the main process saves."""
    expected = set()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in CONNECTION_MODULES:
            continue
        for wrapper in _WRAPPERS:
            name = name.replace(wrapper, "")
        skip = getattr(module, "_non_persistent_buffers_set", set())
        tensors = [*module.named_parameters(), *((k, b) for k, b in module.named_buffers()
                                                 if k.rsplit(".", 1)[-1] not in skip)]
        expected.update(f"{name.removeprefix('module.')}.{k}" for k, _ in tensors)
    missing, extra = sorted(expected - set(connections)), sorted(set(connections) - expected)
    if missing or extra:
        raise ValueError(
            f"the state_dict passed to save_pretrained does not hold the model's connection "
            f"tensors: {len(missing)} of {len(expected)} missing (e.g. {missing[:2]}), "
            f"{len(extra)} not the model's (e.g. {extra[:2]}); expected the converted model's "
            "whole state dict; nothing was saved")


def _written_keys(folder: Path) -> set[str]:
    """The keys of the safetensors weight files transformers wrote into folder (from their
    indexes where sharded; empty where it wrote none, e.g. a distributed checkpoint)."""
    indexes = sorted(folder.glob("model*.safetensors.index*.json"))
    if indexes:
        return {k for i in indexes for k in json.loads(i.read_text())["weight_map"]}
    keys = set()
    for f in sorted(folder.glob("model*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            keys.update(st.keys())
    return keys


def check_written(folder: Path, expected: set[str]) -> None:
    """Read back the connection keys that reached the disk: every one must be there."""
    with safe_open(str(folder / CONNECTIONS_FILE), framework="pt") as st:
        written = set(st.keys())
    missing = sorted(expected - written)
    if missing:
        raise ValueError(
            f"{CONNECTIONS_FILE} was written without the connection tensors {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''} ({len(written)} of {len(expected)} keys); "
            "nothing was saved"
        )


def publish_files(tmp: Path, target: Path, drop_stale: bool = True) -> None:
    """Rename every file of the complete checkpoint in tmp into target, then (drop_stale)
    remove weight files it does not hold; each file's bytes are on disk before its name is."""
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
    for p in target.iterdir() if drop_stale else ():
        if (p.name not in names and p.is_file()
                and any(fnmatch.fnmatchcase(p.name, pattern) for pattern in STALE)):
            p.unlink()
    _fsync_dir(target)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Make the renames inside path durable, where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
