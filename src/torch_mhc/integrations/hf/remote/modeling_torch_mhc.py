"""A model converted by torch-mhc, loaded by transformers alone (trust_remote_code=True).

    model = AutoModelForCausalLM.from_pretrained(folder_or_repo, trust_remote_code=True)

builds the base model named in config.json's base_config (e.g. LlamaForCausalLM) with
transformers, converts its decoder layers as torch_mhc.hf.convert does and loads the
connections from mhc_connections.safetensors. AutoModelForSequenceClassification,
AutoModelForTokenClassification and AutoModelForQuestionAnswering build the base model type's
class for their task instead (e.g. LlamaForSequenceClassification; a head the folder does not
hold starts new, as from a plain folder). The model returned is an instance of the base
class whose decoder layers run two connections each (mhc_attn around norm1 + attention,
mhc_mlp around norm2 + MLP); the first layer expands the hidden states to n streams, the last
one reduces them (the mean) before the final norm. The connections here compute their maps
with torch-mhc's plain-torch reference (maps.py, sinkhorn.py, successors.py, copied verbatim
from torch_mhc.functional), under the same parameter names as the library's modules, so the
logits equal the library's up to float rounding. The option `impl` is ignored (there is only
the reference here) and `check_finite` checks the maps and the branch outputs.

The model's own save_pretrained (Trainer's checkpoints, push_to_hub) writes the folder in
the same form, this code beside it (checkpoint_torch_mhc.py): it loads again as the converted
model, not as the base model that transformers' own save would describe.

Loading refuses, with one line, a conversion record or option out of range and connection
tensors that are missing, extra, of another shape, not floating point or not finite.
"""

from __future__ import annotations

import inspect
import math
import numbers
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from torch import nn
from transformers import PreTrainedModel

from .checkpoint_torch_mhc import CODE_FILES, CONNECTIONS_FILE, is_connection, write_folder
from .configuration_torch_mhc import (
    LOADING_OPTIONS,
    TorchMHCConfig,
    ignoring_connection_keys,
    task_class,
)
from .connections import MAX_LITE_STREAMS, make_connection

_IMPLS = ("auto", "reference", "cpu", "triton", "inductor")

# ------------------------------------------------------------------------------------------
# Checking the recorded conversion (the checks torch-mhc's connection constructors make)


def _real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


_CHECKS = {
    "count": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an int >= 1"),
    "real": (_real, "a finite number"),
    "positive": (lambda v: _real(v) and v > 0, "a finite number > 0"),
    "nonneg": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
    "flag": (lambda v: isinstance(v, bool), "True or False"),
    "impl": (lambda v: v in _IMPLS, f"one of {_IMPLS}"),
    "diag": (lambda v: v is None or (_real(v) and 0 < v < 1), "None or a number in (0, 1)"),
}
_COMMON = {"norm_eps": "positive", "check_finite": "flag", "impl": "impl"}
_SUCCESSOR = {"gate_init": "real", **_COMMON}
OPTIONS = {
    "residual": {"check_finite": "flag", "impl": "impl"},
    "hc": {"dynamic": "flag", **_COMMON},
    "mhc": {"sinkhorn_iters": "count", "gate_init": "real", "res_init_diag": "diag",
            "pre_eps": "nonneg", "sinkhorn_eps": "nonneg", **_COMMON},
    "mhc-lite": _SUCCESSOR,
    "kromhc": _SUCCESSOR,
    "mhc-static-res": _SUCCESSOR,
}


def check_conversion(conversion) -> tuple[str, int, dict]:
    """(kind, streams, options) of config.json's mhc_conversion, else a one-line ValueError."""
    if (not isinstance(conversion, dict) or not isinstance(conversion.get("kind"), str)
            or not isinstance(conversion.get("options", {}), dict)):
        raise ValueError(f"mhc_conversion must be {{'kind': str, 'streams': int, 'options': "
                         f"dict}}, got {conversion!r}")
    kind, n, options = conversion["kind"], conversion.get("streams"), conversion.get("options", {})
    if kind not in OPTIONS:
        raise ValueError(f"unknown connection kind {kind!r}; expected one of {tuple(OPTIONS)}")
    if not _CHECKS["count"][0](n) or (kind == "residual" and n != 1):
        raise ValueError(f"mhc_conversion's streams must be an int >= 1 (1 for the residual), "
                         f"got {n!r}")
    if kind == "mhc-lite" and n > MAX_LITE_STREAMS:
        raise ValueError(f"mhc-lite supports n <= {MAX_LITE_STREAMS} streams, got {n}")
    if kind == "kromhc" and n & (n - 1):
        raise ValueError(f"kromhc needs n a power of two, got {n}")
    for name, value in options.items():
        if name not in OPTIONS[kind]:
            raise ValueError(f"unknown option {name!r} for kind {kind!r}; expected one of "
                             f"{sorted(OPTIONS[kind])}")
        ok, want = _CHECKS[OPTIONS[kind][name]]
        if not ok(value):
            raise ValueError(f"mhc_conversion option {name} must be {want}, got {value!r}")
    return kind, n, options


def check_layers(record, count: int) -> tuple[str, list[dict]]:
    """(path, specs) of config.json's mhc_layers, else a one-line ValueError."""
    fields = ("norm1", "attn", "norm2", "mlp")
    specs = record.get("specs") if isinstance(record, dict) else None
    good = isinstance(specs, list) and isinstance(record.get("path"), str) and all(
        isinstance(s, dict) and all(isinstance(s.get(f), str) for f in fields)
        and isinstance(s.get("arg_names"), list) for s in specs)
    if not good:
        raise ValueError(f"mhc_layers must be {{'path': str, 'specs': [{{'norm1', 'attn', "
                         f"'norm2', 'mlp': str, 'arg_names': list}}, ...]}}, got {record!r}")
    if count is not None and len(specs) != count:
        raise ValueError(f"mhc_layers has {len(specs)} layer specs, the model has {count} layers")
    return record["path"], specs


# ------------------------------------------------------------------------------------------
# The converted decoder layer


def _mhc_attn_branch(self, h, **kwargs):
    spec = self._mhc_spec
    out = getattr(self, spec["attn"])(getattr(self, spec["norm1"])(h), **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _mhc_mlp_branch(self, h):
    spec = self._mhc_spec
    out = getattr(self, spec["mlp"])(getattr(self, spec["norm2"])(h))
    return out[0] if isinstance(out, tuple) else out


def _converted_forward(self, hidden_states, *args, **kwargs):
    names = self._mhc_spec["arg_names"]
    if len(args) > len(names):
        raise TypeError(f"{type(self).__name__}.forward takes at most {len(names) + 1} positional "
                        f"arguments, got {len(args) + 1}")
    kwargs.update(zip(names[: len(args)], args, strict=True))
    for name in ("encoder_hidden_states", "encoder_attention_mask"):
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"a torch_mhc-converted {type(self).__name__} takes no {name}")
    x = hidden_states
    if self._mhc_first:  # [B, T, C] -> [B, T, n, C], every stream a copy
        x = x.unsqueeze(-2).expand(*x.shape[:-1], self.mhc_attn.streams, x.shape[-1])
    x = self.mhc_attn(x, branch=self._mhc_attn_branch, **kwargs)
    x = self.mhc_mlp(x, branch=self._mhc_mlp_branch)
    return x.mean(dim=-2) if self._mhc_last else x


def _reduce_ex(self, protocol: int):
    # pickle finds a class by its module and name, and the generated class is in no module
    # until a load in this process builds it: pickle the (importable) base class and rebuild
    # the subclass from it.
    return _unpickle_converted, (type(self)._mhc_base,), self.__getstate__()


def _unpickle_converted(base: type) -> nn.Module:
    cls = converted_class(base)
    return cls.__new__(cls)


_CLASSES: dict = {}


def converted_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"MHC{cls.__name__}", (cls,), {
            "forward": _converted_forward, "_mhc_attn_branch": _mhc_attn_branch,
            "_mhc_mlp_branch": _mhc_mlp_branch, "_mhc_base": cls,
            "__reduce_ex__": _reduce_ex, "__module__": __name__})
    return _CLASSES[cls]


def convert(model: nn.Module, conversion: dict, layers_record: dict) -> nn.Module:
    """Put the recorded connections into model's decoder layers (the checkpoint's tensors
    then replace every initial value)."""
    kind, n, options = check_conversion(conversion)
    path, _ = check_layers(layers_record, None)
    try:
        layers = model.get_submodule(path)
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"mhc_layers' path {path!r} is no nn.ModuleList of "
                         f"{type(model).__name__}")
    _, specs = check_layers(layers_record, len(layers))
    dim = int(model.config.get_text_config().hidden_size)
    for i, (layer, spec) in enumerate(zip(layers, specs, strict=True)):
        absent = [spec[f] for f in ("norm1", "attn", "norm2", "mlp")
                  if not isinstance(getattr(layer, spec[f], None), nn.Module)]
        if absent:
            raise ValueError(f"layer {i} ({type(layer).__name__}) has no submodules {absent} "
                             "that mhc_layers names")
        p = next(layer.parameters())
        layer.__class__ = converted_class(type(layer))
        layer._mhc_spec, layer._mhc_first, layer._mhc_last = spec, i == 0, i == len(layers) - 1
        for j, name in enumerate(("mhc_attn", "mhc_mlp")):
            conn = make_connection(kind, dim, n, 2 * i + j, options)
            setattr(layer, name, conn.to(device=p.device, dtype=p.dtype))
    names = {type(layer).__name__ for layer in layers}
    current = getattr(model, "_no_split_modules", None) or []
    model._no_split_modules = {*current, *names} if isinstance(current, set) \
        else [*current, *sorted(names)]
    return model


# ------------------------------------------------------------------------------------------
# Loading


def load_connections(model: nn.Module, file: str) -> None:
    """Copy the connections' tensors from file into model, each checked first."""
    with safe_open(file, framework="pt") as st:
        tensors = {k: st.get_tensor(k) for k in st.keys()}
    wanted = {k: v for k, v in model.state_dict().items() if is_connection(k)}
    missing, extra = sorted(set(wanted) - set(tensors)), sorted(set(tensors) - set(wanted))
    if missing or extra:
        raise ValueError(f"{file}: the connection tensors do not match the recorded conversion "
                         f"{model.config.mhc_conversion}: missing {missing[:4]}, unexpected "
                         f"{extra[:4]}")
    for key, target in wanted.items():
        got = tensors[key]
        if not got.is_floating_point():
            raise ValueError(f"{file}: {key} has dtype {got.dtype}; expected a floating-point "
                             "tensor")
        if got.shape != target.shape:
            raise ValueError(f"{file}: {key} has shape {tuple(got.shape)}, the recorded "
                             f"conversion expects {tuple(target.shape)}")
        if not bool(torch.isfinite(got).all()):
            raise ValueError(f"{file}: {key} holds NaN or infinite values")
    with torch.no_grad():
        for key, target in wanted.items():
            target.copy_(tensors[key])


_HUB = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision",
        "subfolder")


def _base_class(config: TorchMHCConfig) -> type:
    names = (config.base_config or {}).get("architectures") or []
    cls = getattr(transformers, names[0], None) if names else None
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise ValueError(f"base_config's architectures must name a transformers model class, "
                         f"got {names!r} (transformers {transformers.__version__})")
    return cls


def load(path, config: TorchMHCConfig | None, model_args: tuple, kwargs: dict,
         auto_class: str | None = None) -> nn.Module:
    """The converted model saved in path (a folder or a Hub repository): the class it was
    saved from, or auto_class's for its base model type (configuration's task_class)."""
    from transformers.utils import cached_file

    hub = {k: kwargs[k] for k in _HUB if k in kwargs}
    if config is None:
        config = TorchMHCConfig.from_pretrained(path, **hub)
    check_conversion(config.mhc_conversion)  # before any weight is read
    check_layers(config.mhc_layers, None)
    saved = _base_class(config)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("trust_remote_code", "code_revision")}
    params = {*inspect.signature(saved.from_pretrained).parameters, *LOADING_OPTIONS}
    named = {k: v for k, v in kwargs.items() if k in params}
    base_config, unused = config.base(**{k: v for k, v in kwargs.items() if k not in params})
    cls = task_class(saved, type(base_config), auto_class)
    file = cached_file(path, CONNECTIONS_FILE, **hub)
    with ignoring_connection_keys(cls):
        model = cls.from_pretrained(path, *model_args, config=base_config, **named, **unused)
    convert(model, config.mhc_conversion, config.mhc_layers)
    load_connections(model, file)
    model.save_pretrained = PortableSave(model, config.mhc_layers)
    return model


class PortableSave:
    """The loaded model's own save_pretrained (an attribute of the instance, so that
    transformers' callers, Trainer's checkpoints and push_to_hub, reach it): the folder in the
    form it was loaded from, with this code beside it, so that it loads again as the converted
    model (transformers' own save would write the base model's config, which loads as the base
    model without its connections)."""

    def __init__(self, model: nn.Module, layers: dict):
        self.model, self.layers = model, layers

    def __call__(self, save_directory, **kwargs):
        here = Path(__file__).resolve().parent
        return write_folder(self.model, save_directory, kwargs, self.layers,
                            {name: here / name for name in CODE_FILES})


class _TorchMHCAuto(PreTrainedModel):
    """Loads the converted base model for auto_class (see the module docstring); it is never
    built itself."""

    config_class = TorchMHCConfig
    base_model_prefix = "model"
    auto_class = "AutoModelForCausalLM"

    def __init__(self, config, *args, **kwargs):
        raise TypeError(f"a torch-mhc converted model is built from its checkpoint: "
                        f"{self.auto_class}.from_pretrained(path, trust_remote_code=True)")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        return load(pretrained_model_name_or_path, config, model_args, kwargs, cls.auto_class)

    @classmethod
    def _from_config(cls, config, **kwargs):
        cls(config)


# config.json's auto_map names these (configuration's AUTO_MAP)
class TorchMHCForCausalLM(_TorchMHCAuto):
    auto_class = "AutoModelForCausalLM"


class TorchMHCForSequenceClassification(_TorchMHCAuto):
    auto_class = "AutoModelForSequenceClassification"


class TorchMHCForTokenClassification(_TorchMHCAuto):
    auto_class = "AutoModelForTokenClassification"


class TorchMHCForQuestionAnswering(_TorchMHCAuto):
    auto_class = "AutoModelForQuestionAnswering"
