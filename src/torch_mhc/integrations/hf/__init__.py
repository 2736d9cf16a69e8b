"""Hugging Face transformers integration (needs `pip install -e ".[hf]"`).

    import torch_mhc.hf
    model = transformers.AutoModelForCausalLM.from_pretrained("path/or/name")
    torch_mhc.hf.convert(model, kind="mhc", streams=4)      # same logits as before
    ...                                                     # fine-tune (transformers.Trainer)
    torch_mhc.hf.save_pretrained(model, "out/")             # safetensors + config.json
    model = torch_mhc.hf.from_pretrained("out/")            # the same converted model
    torch_mhc.hf.make_portable("export/", "base/config.json", kind="mhc", streams=4)
                                                            # another trainer's weights

    torch_mhc.hf.accelerate_deepseek_v4(v4_model)           # DeepSeek-V4's mHC on our ops

Importing torch_mhc does not import this package (nor transformers); importing this one does.
"""

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "torch_mhc.hf needs the transformers package: pip install -e '.[hf]' in the torch-mhc "
        "checkout"
    ) from e

from torch_mhc.integrations.hf.accelerate import accelerate_deepseek_v4
from torch_mhc.integrations.hf.auto import TorchMHCForCausalLM, register
from torch_mhc.integrations.hf.checkpoint import from_pretrained, push_to_hub, save_pretrained
from torch_mhc.integrations.hf.convert import (
    CONFIG_KEY,
    connection_parameters,
    convert,
    train_only_connections,
)
from torch_mhc.integrations.hf.layers import ConversionError
from torch_mhc.integrations.hf.portable import TorchMHCConfig
from torch_mhc.integrations.hf.training import exclude_from_weight_decay
from torch_mhc.integrations.hf.weights_only import make_portable

__all__ = [
    "CONFIG_KEY",
    "ConversionError",
    "accelerate_deepseek_v4",
    "connection_parameters",
    "convert",
    "exclude_from_weight_decay",
    "from_pretrained",
    "make_portable",
    "push_to_hub",
    "save_pretrained",
    "train_only_connections",
    "TorchMHCConfig",
    "TorchMHCForCausalLM",
]

register()  # AutoConfig / AutoModelForCausalLM read a portable checkpoint without remote code
