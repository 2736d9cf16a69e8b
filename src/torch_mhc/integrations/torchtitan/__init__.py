"""torchtitan integration: train HC / mHC models with PyTorch's own large-scale trainer.

    pip install 'torch-mhc[torchtitan]'      # torchtitan 0.3.0, torch >= 2.14
    torchrun --nproc-per-node 8 -m torchtitan.train \
        --module torch_mhc.integrations.torchtitan --config llama3_8b_mhc

Pieces: connection (HC / mHC as torchtitan modules), blocks (dense llama3 / qwen3 blocks with
connections around attention and feed-forward), converter (MhcConverter and the equivalent
override), config_registry (ready configurations), checkpoint (key checks between converted
and unconverted models). Importing torch_mhc never imports this package.
"""

from torch_mhc.integrations.torchtitan.blocks import HyperLlama3Block, HyperQwen3Block
from torch_mhc.integrations.torchtitan.checkpoint import check_checkpoint_keys
from torch_mhc.integrations.torchtitan.connection import (
    TitanHyperConnection,
    TitanManifoldHyperConnection,
)
from torch_mhc.integrations.torchtitan.converter import (
    MhcConverter,
    convert_model_config,
    mhc_override,
)

__all__ = [
    "HyperLlama3Block",
    "HyperQwen3Block",
    "MhcConverter",
    "TitanHyperConnection",
    "TitanManifoldHyperConnection",
    "check_checkpoint_keys",
    "convert_model_config",
    "mhc_override",
]
