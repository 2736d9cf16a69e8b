"""The portable form of a converted checkpoint: an architecture of its own to transformers.

A converted model's config.json is written with model_type "torch_mhc" and an auto_map that
points transformers at the code saved beside the weights (four files of remote/ and three of
torch_mhc.functional), so that

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

loads the converted model where torch-mhc is not installed, and plain transformers without
trust_remote_code refuses the folder (it cannot know model_type "torch_mhc") instead of loading
the base model without its connections. config.json holds:

    model_type: "torch_mhc";  architectures: ["TorchMHCForCausalLM"];  auto_map
    base_model_type: e.g. "llama";  base_config: the base model's config.json, as transformers
        writes it (its architectures name the class to build, e.g. LlamaForCausalLM)
    mhc_conversion: {kind, streams, options, torch_mhc_version}, as convert records it
    mhc_layers: {path: the ModuleList of decoder layers, e.g. "model.layers", specs: each
        layer's norm1, attn, norm2, mlp submodule names and forward's argument names}
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from torch_mhc.integrations.hf.layers import is_converted
from torch_mhc.integrations.hf.remote import FUNCTIONAL_FILES, REMOTE_DIR
from torch_mhc.integrations.hf.remote.checkpoint_torch_mhc import CODE_FILES as _CODE_NAMES
from torch_mhc.integrations.hf.remote.configuration_torch_mhc import MODEL_TYPE, TorchMHCConfig

__all__ = ["CODE_FILES", "MODEL_TYPE", "TorchMHCConfig", "is_portable", "layers_record"]

_FUNCTIONAL = Path(__file__).resolve().parents[2] / "functional"
# the remote code, by its name in the folder: the file to copy there
CODE_FILES = {name: (_FUNCTIONAL if name in FUNCTIONAL_FILES else REMOTE_DIR) / name
              for name in _CODE_NAMES}


def is_portable(config_dict: dict) -> bool:
    return config_dict.get("model_type") == MODEL_TYPE


def layers_record(model: nn.Module) -> dict:
    """mhc_layers: the path of the ModuleList of converted layers and each layer's spec."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) \
                and all(is_converted(layer) for layer in module):
            specs = [layer._mhc_spec for layer in module]
            return {"path": name, "specs": [
                {"norm1": s.norm1, "attn": s.attn, "norm2": s.norm2, "mlp": s.mlp,
                 "arg_names": list(s.arg_names)} for s in specs]}
    raise ValueError(f"{type(model).__name__} has no nn.ModuleList of converted decoder layers")
