"""torchtitan integration: train HC / mHC models with PyTorch's own large-scale trainer.

    pip install -e ".[torchtitan]"           # torchtitan 0.3.0, torch >= 2.14
    torchrun --nproc-per-node 8 -m torchtitan.train \
        --module torch_mhc.integrations.torchtitan --config llama3_8b_mhc

Pieces: connection (HC / mHC as torchtitan modules), blocks (dense llama3 / qwen3 blocks with
connections around attention and feed-forward), converter (MhcConverter and the equivalent
override, convert_trainer_config), config_registry (ready configurations), checkpoint
(MhcCheckpointManager: connections compared on every load; check_checkpoint_keys by hand),
adapter (HF state-dict conversion keeping the connections, named as torch_mhc.hf names them).
Importing torch_mhc never imports this package.
"""

from torch_mhc.integrations.torchtitan.adapter import (
    HyperLlama3StateDictAdapter,
    HyperQwen3StateDictAdapter,
    hf_conversion,
    with_connections,
)
from torch_mhc.integrations.torchtitan.blocks import HyperLlama3Block, HyperQwen3Block
from torch_mhc.integrations.torchtitan.checkpoint import (
    MhcCheckpointManager,
    check_checkpoint_keys,
    mhc_checkpoint,
)
from torch_mhc.integrations.torchtitan.connection import (
    TitanHyperConnection,
    TitanManifoldHyperConnection,
)
from torch_mhc.integrations.torchtitan.converter import (
    MhcConverter,
    convert_model_config,
    convert_trainer_config,
    mhc_override,
    with_connection_checkpoints,
)

__all__ = [
    "HyperLlama3Block",
    "HyperLlama3StateDictAdapter",
    "HyperQwen3Block",
    "HyperQwen3StateDictAdapter",
    "MhcCheckpointManager",
    "MhcConverter",
    "TitanHyperConnection",
    "TitanManifoldHyperConnection",
    "check_checkpoint_keys",
    "convert_model_config",
    "convert_trainer_config",
    "hf_conversion",
    "mhc_checkpoint",
    "mhc_override",
    "with_connection_checkpoints",
    "with_connections",
]
