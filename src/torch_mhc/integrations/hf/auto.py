"""transformers' Auto classes know a portable checkpoint once torch_mhc.hf is imported.

    import torch_mhc.hf
    model = AutoModelForCausalLM.from_pretrained("out/")    # no trust_remote_code needed

AutoConfig reads config.json (model_type "torch_mhc") as a TorchMHCConfig and
AutoModelForCausalLM hands the folder to torch_mhc.hf.from_pretrained, which returns the
converted base model on torch-mhc's connections and ops (e.g. a LlamaForCausalLM instance), the
same model torch_mhc.hf.from_pretrained(path) returns, with or without trust_remote_code=True
(transformers prefers a registered class to the code saved in the folder; that code, with the
plain-torch reference connections, runs where torch-mhc is not imported).
AutoModelForSequenceClassification, AutoModelForTokenClassification and
AutoModelForQuestionAnswering load the base model type's class for their task (e.g.
LlamaForSequenceClassification), as the folder's own code does.
"""

from __future__ import annotations

import transformers
from transformers import AutoConfig, PreTrainedModel

from torch_mhc.integrations.hf.checkpoint import load_for
from torch_mhc.integrations.hf.portable import MODEL_TYPE, TorchMHCConfig
from torch_mhc.integrations.hf.remote.configuration_torch_mhc import (
    TASK_AUTO_CLASSES,
    entry_class_name,
)

__all__ = ["TorchMHCForCausalLM", "register"]

# what the Auto classes add to the kwargs of the class's from_pretrained
_AUTO_ONLY = ("trust_remote_code", "adapter_kwargs", "code_revision")


class TorchMHCForCausalLM(PreTrainedModel):
    """The Auto classes' entry for model_type "torch_mhc" (this one AutoModelForCausalLM's;
    the other tasks' are its subclasses, made by register); it is never built itself."""

    config_class = TorchMHCConfig
    base_model_prefix = "model"
    auto_class = "AutoModelForCausalLM"

    def __init__(self, config, *args, **kwargs):
        raise TypeError(f"a torch-mhc converted model is built from its checkpoint: "
                        f"torch_mhc.hf.from_pretrained(path) or "
                        f"{self.auto_class}.from_pretrained(path)")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        if model_args:
            raise TypeError(f"{cls.__name__}.from_pretrained takes no positional model "
                            f"arguments, got {len(model_args)}")
        kwargs = {k: v for k, v in kwargs.items() if k not in _AUTO_ONLY}
        if isinstance(config, TorchMHCConfig):  # what AutoModel put on the config it read
            kwargs = {**config.passed_on(), **kwargs}
        return load_for(cls.auto_class, pretrained_model_name_or_path, **kwargs)

    @classmethod
    def _from_config(cls, config, **kwargs):
        return cls(config)


def _entry(auto_class: str) -> type:
    if auto_class == TorchMHCForCausalLM.auto_class:
        return TorchMHCForCausalLM
    return type(entry_class_name(auto_class), (TorchMHCForCausalLM,),
                {"auto_class": auto_class, "__module__": __name__})


def register() -> None:
    AutoConfig.register(MODEL_TYPE, TorchMHCConfig, exist_ok=True)
    for auto_class in TASK_AUTO_CLASSES:
        getattr(transformers, auto_class).register(TorchMHCConfig, _entry(auto_class),
                                                   exist_ok=True)
