"""The configuration of a model converted by torch-mhc (Manifold-Constrained Hyper-Connections).

A converted model is an architecture of its own to transformers (model_type "torch_mhc"): this
config records the model it was converted from (base_model_type, and base_config as that
model's config.json holds it) and the conversion (mhc_conversion: kind, streams, options;
mhc_layers: where the decoder layers are and which of each layer's submodules are the two
branches). modeling_torch_mhc builds the base model from base_config and converts it.
"""

from __future__ import annotations

import contextlib

from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

MODEL_TYPE = "torch_mhc"
# the keys this config adds to a transformers config
CONVERSION_KEY = "mhc_conversion"  # the base config's attribute that records the conversion
OWN_KEYS = ("base_model_type", "base_config", CONVERSION_KEY, "mhc_layers")
# settings a load may pass (AutoModel puts them on this config), with their defaults: a value
# other than the default reaches the base config
PASSED_ON = {"output_hidden_states": False, "return_dict": True, "output_attentions": False,
             # a task head's labels (num_labels=5 sets both maps), for the task Auto classes
             "id2label": {0: "LABEL_0", 1: "LABEL_1"}, "label2id": {"LABEL_0": 0, "LABEL_1": 1},
             "problem_type": None}
# Loading options the base class's from_pretrained takes in its **kwargs: passed to it, not set
# on the base config (dtype="auto" there breaks the load; attn_implementation is lost there)
LOADING_OPTIONS = ("dtype", "torch_dtype", "attn_implementation")
# The Auto classes that load a converted folder: AutoModelForCausalLM the class it was saved
# from, whatever it is; the others the base model type's class for their task (a causal LM
# saved, a sequence classifier asked for: the classifier, its head new, as transformers does
# for a plain folder). Their classes in modeling_torch_mhc are named by entry_class_name.
TASK_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForSequenceClassification",
                     "AutoModelForTokenClassification", "AutoModelForQuestionAnswering")


def entry_class_name(auto_class: str) -> str:
    """The name of auto_class's entry class for a converted folder ("AutoModelForCausalLM":
    "TorchMHCForCausalLM"), in modeling_torch_mhc and in the library's registration."""
    return "TorchMHC" + auto_class[len("AutoModel"):]


# where transformers finds this folder's code (config.json's auto_map)
AUTO_MAP = {
    "AutoConfig": "configuration_torch_mhc.TorchMHCConfig",
    **{auto: f"modeling_torch_mhc.{entry_class_name(auto)}" for auto in TASK_AUTO_CLASSES},
}


def task_class(saved: type, config_class: type, auto_class: str | None) -> type:
    """The class a load builds: the one the folder was saved from (auto_class None or
    AutoModelForCausalLM), or the base model type's class for auto_class's task (one of
    TASK_AUTO_CLASSES), as transformers builds a plain folder's model for the Auto class
    asked. A ValueError where that class cannot take the folder's decoder and connections as
    they are stored: a model type without the task's class, a class keeping its decoder under
    another name, a folder of the bare decoder (stored without the heads' prefix)."""
    if auto_class is None or auto_class == "AutoModelForCausalLM":
        return saved
    if auto_class not in TASK_AUTO_CLASSES:
        raise ValueError(f"expected one of {TASK_AUTO_CLASSES}, got {auto_class!r}")
    import transformers

    mapping = getattr(transformers, auto_class)._model_mapping
    cls = mapping[config_class] if config_class in mapping else None
    if cls is None:
        why = f"transformers has no {auto_class} class for model type {config_class.model_type!r}"
    elif cls is saved:
        return cls
    elif transformers.AutoModel._model_mapping.get(config_class, None) is saved:
        why = (f"{auto_class} builds {cls.__name__}; this folder holds the bare decoder "
               f"{saved.__name__}, whose connections are stored without the prefix "
               f"{cls.base_model_prefix!r} that {cls.__name__} gives them")
    elif cls.base_model_prefix != saved.base_model_prefix:
        # (transformers itself loads none of such a folder's weights, without a word)
        why = (f"{auto_class} builds {cls.__name__}, which keeps its decoder under "
               f"{cls.base_model_prefix!r}; the {saved.__name__} this folder holds keeps it "
               f"under {saved.base_model_prefix!r}, so none of the folder's weights would load")
    else:
        return cls
    raise ValueError(f"{why}: load it as the {saved.__name__} it was saved as, with "
                     f"AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True) "
                     f"or torch_mhc.hf.from_pretrained(folder)")


# The base architecture's own class reads the folder's base_config: transformers' config
# classes adopt a nested dict of their model_type (PEFT reads the base vocabulary so), and
# LlamaForCausalLM.from_pretrained(folder) would build the base model and load the weights
# without their connections, only listing their keys as unexpected. An attention and an
# experts implementation that no model accepts stop that build with a ValueError that quotes
# them: every model checks both when it is built, dense ones too. Two, because a keyword of
# the call replaces the config's value, and `attn_implementation="sdpa"` is an everyday one.
# TorchMHCConfig.base() drops any such value starting with REFUSED (so that its wording may
# change). (transformers never writes either key into config.json.)
REFUSED = "refused by torch-mhc:"
NOT_THE_BASE_MODEL = (f"{REFUSED} this folder holds a converted model; load it with "
                      "AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True) "
                      "(the class it was saved as; for a task's head, AutoModelFor"
                      "SequenceClassification, TokenClassification or QuestionAnswering) or "
                      "torch_mhc.hf.from_pretrained(folder), "
                      "not with its base class (where "
                      "torch_mhc.hf.from_pretrained itself stops here, the installed torch-mhc "
                      "is older than the folder: update torch-mhc)")
# the implementations a load may choose: they carry the sentence in base_config, and a
# caller's own choice (passed_on) replaces it
IMPLEMENTATION_KEYS = ("attn_implementation", "experts_implementation")


def portable_config(base: dict, layers: dict) -> dict:
    """config.json of a converted model from its base model's config.json as transformers
    writes it (with the conversion recorded, under CONVERSION_KEY) and the layers' record
    (mhc_layers)."""
    base = dict(base)
    for key in IMPLEMENTATION_KEYS:
        base[key] = NOT_THE_BASE_MODEL
    conversion = base.pop(CONVERSION_KEY)
    config = {
        "model_type": MODEL_TYPE,
        "architectures": ["TorchMHCForCausalLM"],
        "auto_map": dict(AUTO_MAP),
        "base_model_type": base["model_type"],
        "base_config": base,
        CONVERSION_KEY: conversion,
        "mhc_layers": layers,
    }
    for key in ("dtype", "transformers_version"):
        if key in base:
            config[key] = base[key]
    return config


# the connections' names in a converted decoder layer, and their state-dict keys
# (model.layers.<i>.mhc_attn.phi, ...) as a regex
CONNECTION_MODULES = ("mhc_attn", "mhc_mlp")
CONNECTION_KEY = r"\.(" + "|".join(CONNECTION_MODULES) + r")\."


@contextlib.contextmanager
def ignoring_connection_keys(cls: type):
    """The weight files may hold the connections' tensors too (under the converted model's
    keys, for tools that load them back into a converted model); the base class, built before
    the conversion, must not report them as unexpected: they are loaded after it. The class
    attribute is read once, while the model is built."""
    had = "_keys_to_ignore_on_load_unexpected" in cls.__dict__
    previous = cls.__dict__.get("_keys_to_ignore_on_load_unexpected")
    inherited = getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or []
    cls._keys_to_ignore_on_load_unexpected = [*inherited, CONNECTION_KEY]
    try:
        yield
    finally:
        if had:
            cls._keys_to_ignore_on_load_unexpected = previous
        else:
            del cls._keys_to_ignore_on_load_unexpected


class TorchMHCConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, base_model_type=None, base_config=None, mhc_conversion=None,
                 mhc_layers=None, **kwargs):
        self.base_model_type = base_model_type
        self.base_config = base_config
        self.mhc_conversion = mhc_conversion
        self.mhc_layers = mhc_layers
        super().__init__(**kwargs)

    def passed_on(self) -> dict:
        """What a load put on this config for the base model (AutoModel does, from the
        kwargs of its from_pretrained), as those kwargs: the PASSED_ON settings that differ
        from their defaults, and the attention and experts implementations."""
        given = {key: getattr(self, key) for key, default in PASSED_ON.items()
                 if getattr(self, key, default) != default}
        for key in IMPLEMENTATION_KEYS:
            chosen = getattr(self, f"_{key}_internal", None)
            if chosen is not None:
                given[key] = chosen
        return given

    def base(self, **kwargs):
        """(the base model's config with the conversion recorded, kwargs it did not take).

        kwargs that name attributes of the base config set them, as transformers'
        from_pretrained does with its config's kwargs."""
        if (not isinstance(self.base_config, dict) or self.base_model_type not in CONFIG_MAPPING
                or self.base_config.get("model_type") != self.base_model_type):
            raise ValueError(
                f"config.json of model_type {MODEL_TYPE!r} needs base_model_type (a model type "
                f"transformers knows) and base_config (a dict of that model type), got "
                f"{self.base_model_type!r} and {type(self.base_config).__name__}"
            )
        config_class = CONFIG_MAPPING[self.base_model_type]
        base = {k: v for k, v in self.base_config.items()
                if not (k in IMPLEMENTATION_KEYS and str(v).startswith(REFUSED))}
        config, unused = config_class.from_dict(base, return_unused_kwargs=True,
                                                **{**self.passed_on(), **kwargs})
        config.mhc_conversion = self.mhc_conversion
        return config, unused
