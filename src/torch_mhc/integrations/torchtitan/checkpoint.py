"""Checks between a checkpoint and a model that may or may not carry connections.

torchtitan loads a DCP checkpoint with the model's own keys as the plan: a checkpoint of a
converted (HC / mHC) model loads into an unconverted model without complaint, the connections'
parameters silently left behind, and a converted model asked to load an unconverted
checkpoint stops on the first connection key with DCP's bare "Missing key". Call
`check_checkpoint_keys` before loading (e.g. before `CheckpointManager.load`) for one clear
error either way.
"""

from __future__ import annotations

import os

from torch import nn

# Names of the connection modules a converted block adds (blocks.py).
CONNECTION_MODULES = ("attention_hc", "ffn_hc")


def _connection_keys(keys) -> list[str]:
    return sorted(k for k in keys if any(f".{m}." in f".{k}" for m in CONNECTION_MODULES))


def checkpoint_keys(checkpoint_dir: str | os.PathLike) -> set[str]:
    """The tensor keys stored in a DCP checkpoint folder (read from its metadata only)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(os.fspath(checkpoint_dir)).read_metadata()
    return set(metadata.state_dict_metadata)


def check_checkpoint_keys(checkpoint_dir: str | os.PathLike, model: nn.Module | list) -> None:
    """Raise a ValueError if checkpoint and model disagree on having connections.

    model: the model or its pipeline parts (a list); keys are compared as torchtitan stores
    them (the model's state-dict keys, possibly under a "model." prefix in older layouts).
    """
    parts = model if isinstance(model, list | tuple) else [model]
    model_keys = {k for part in parts for k in part.state_dict()}
    stored = checkpoint_keys(checkpoint_dir)
    stored_conn = _connection_keys(stored)
    model_conn = _connection_keys(model_keys)
    if stored_conn and not model_conn:
        raise ValueError(
            f"checkpoint {os.fspath(checkpoint_dir)!r} holds HC / mHC connection parameters "
            f"({len(stored_conn)} tensors, e.g. {stored_conn[0]!r}) but the model has no "
            "connections: convert the model with the same MhcConverter settings before "
            "loading, or its function changes"
        )
    if model_conn and not stored_conn:
        raise ValueError(
            f"the model has HC / mHC connections (e.g. {model_conn[0]!r}) but checkpoint "
            f"{os.fspath(checkpoint_dir)!r} holds none: it was saved by an unconverted model. "
            "Load it into the unconverted model, or start the converted model from it with "
            "its connections freshly initialised (a model-only load that skips their keys)"
        )
