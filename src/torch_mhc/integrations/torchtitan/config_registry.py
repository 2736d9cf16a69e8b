"""Ready torchtitan configurations with mHC connections (`--module ... --config NAME`).

    torchrun --nproc-per-node 8 -m torchtitan.train \
        --module torch_mhc.integrations.torchtitan --config llama3_8b_mhc

Each is torchtitan's own configuration of the same name without the suffix, its model spec
rebuilt with `MhcConverter` (mHC, n = 4 streams, the paper's settings), its checkpoints
handled by MhcCheckpointManager (connections compared on every load, kept by the HF export);
everything else (optimizer, schedule, parallelism, checkpoint policy) is torchtitan's. The
command line overrides any field as usual.
"""

from __future__ import annotations

from torchtitan.models.llama3 import config_registry as _llama3
from torchtitan.models.llama3 import model_registry as _llama3_model
from torchtitan.models.qwen3 import config_registry as _qwen3
from torchtitan.models.qwen3 import model_registry as _qwen3_model

from torch_mhc.integrations.torchtitan.converter import MhcConverter, with_connection_checkpoints

STREAMS = 4  # the paper's n


def mhc_converters(kind: str = "mhc", streams: int = STREAMS, **options) -> list:
    return [MhcConverter.Config(kind=kind, streams=streams, options=options)]


def llama3_debugmodel_mhc():
    """torchtitan's llama3 debug model (6 layers, dim 256) with mHC connections."""
    config = _llama3.llama3_debugmodel()
    config.model_spec = _llama3_model("debugmodel", converters=mhc_converters())
    return with_connection_checkpoints(config)


def llama3_debugmodel_hc():
    """The same debug model with (dynamic) Hyper-Connections, the baseline."""
    config = _llama3.llama3_debugmodel()
    config.model_spec = _llama3_model("debugmodel", converters=mhc_converters("hc"))
    return with_connection_checkpoints(config)


def llama3_8b_mhc():
    """Llama 3 8B (32 layers, dim 4096) with mHC connections: 64 connections of
    4 * 4096 * 24 + 27 parameters each (about 25.2 M in all, 0.3 % of the model)."""
    config = _llama3.llama3_8b()
    config.model_spec = _llama3_model("8B", converters=mhc_converters())
    return with_connection_checkpoints(config)


def qwen3_debugmodel_mhc():
    """torchtitan's dense qwen3 debug model with mHC connections."""
    config = _qwen3.qwen3_debugmodel()
    config.model_spec = _qwen3_model("debugmodel", converters=mhc_converters())
    return with_connection_checkpoints(config)
