"""accelerate_deepseek_v4(): run a transformers DeepseekV4ForCausalLM's mHC on torch-mhc's ops.

Every `DeepseekV4HyperConnection` (attn_hc, ffn_hc of each decoder layer) is replaced by a
`DeepseekV4Connection`: a ManifoldHyperConnection in DeepSeek-V4 compatibility mode
(torch_mhc.integrations.deepseek_v4 explains the maps and the layout) that holds the replaced
module's own `fn`, `base` and `scale` Parameter objects, not copies, and derives phi, alpha and
the biases from them at each call (a permutation and views: gradients reach fn, base, scale;
without autograd, as in decoding, the permuted copy is made once per version of fn and kept
beside the module: one more copy of fn per connection).
The `DeepseekV4HyperHead` becomes a `DeepseekV4StreamHead` the same way (hc_fn, hc_base,
hc_scale). So the state dict keeps its keys and tensors, an optimizer built before keeps
working, save_pretrained writes an ordinary DeepSeek-V4 checkpoint, and collect_gains() sees
every layer's H_res.

transformers 5.8.0's DeepSeek-V4 module differs from DeepSeek's official maths (fixed in
5.8.1); its checkpoints' behaviour is not what this mode reproduces, so it is refused.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from torch_mhc.connections import Connection, ManifoldHyperConnection
from torch_mhc.connections.stream_head import StreamHead
from torch_mhc.integrations.deepseek_v4 import column_order, norm_epsilon
from torch_mhc.integrations.hf.convert import with_no_split
from torch_mhc.integrations.hf.layers import ConversionError
from torch_mhc.runtime import param_updates

__all__ = ["accelerate_deepseek_v4", "DeepseekV4Connection", "DeepseekV4StreamHead"]

_REFUSED = {"5.8.0"}

# id(DeepseekV4Connection) -> (fn, (fn's data_ptr, version), phi's permuted copy) for its
# decoding calls; outside the module, whose copies and pickles need not carry it.
_PHI_COPIES: dict[int, tuple] = {}


def check_transformers_version(version: str | None = None) -> None:
    """Refuse transformers versions whose DeepSeek-V4 maths is not DeepSeek's."""
    import transformers

    version = transformers.__version__ if version is None else version
    if version.split("+")[0] in _REFUSED:
        raise RuntimeError(
            f"transformers {version}'s DeepSeek-V4 hyper-connections differ from DeepSeek's "
            "official maths (fixed in 5.8.1); accelerate_deepseek_v4 expects transformers "
            ">= 5.8.1: pip install -U 'transformers>=5.8.1'"
        )


class DeepseekV4Connection(ManifoldHyperConnection):
    """ManifoldHyperConnection on a DeepseekV4HyperConnection's fn, base, scale (shared)."""

    def __init__(self, hf_module: nn.Module, layer_index: int, branch, impl: str = "auto"):
        n = int(hf_module.hc_mult)
        # ManifoldHyperConnection.__init__ would create phi, alpha, b_*: only the shared
        # checks and the branch are wanted, and the parameters are the module's own.
        Connection.__init__(self, hf_module.fn.shape[1] // n, n, branch, impl=impl)
        self.layer_index, self.sinkhorn_iters = layer_index, int(hf_module.hc_sinkhorn_iters)
        self.norm_eps = norm_epsilon(hf_module.input_norm)
        self.pre_eps = self.sinkhorn_eps = float(hf_module.hc_eps)
        self.fn, self.base, self.scale = hf_module.fn, hf_module.base, hf_module.scale
        self.register_buffer("column_order", column_order(n), persistent=False)

    def map_args(self, x: torch.Tensor) -> tuple:
        return self._map_args(x, self.fn.t().index_select(1, self.column_order))

    def decode_args(self, x: torch.Tensor) -> tuple:
        """map_args with phi's permuted copy made once per version of fn. The prepared
        decoding calls are kept while their arguments are the same tensors at the same
        versions: a fresh copy at each call made them again at every token (176 us a call
        against 24 at C = 32, n = 4, one thread). The copy is kept while fn is the same
        tensor, storage and version and no optimizer has stepped (as the prepared calls' own
        copies are: a fused optimizer bumps no version; a write into `fn.data`, which torch
        does not count, goes unseen until torch_mhc.parameters_changed(); or write under
        torch.no_grad()), and is an ordinary tensor
        even under inference_mode, so that later calls can use it."""
        fn = self.fn
        try:
            mark = (fn.data_ptr(), fn._version, param_updates.current())
        except RuntimeError:  # an inference tensor has no version: nothing to key a copy by
            return self.map_args(x)
        kept = _PHI_COPIES.get(id(self))
        if kept is None or kept[0] is not fn or kept[1] != mark:
            if kept is None:
                weakref.finalize(self, _PHI_COPIES.pop, id(self), None)
            with torch.no_grad(), torch.inference_mode(False):
                kept = (fn, mark, fn.t().index_select(1, self.column_order))
            _PHI_COPIES[id(self)] = kept
        return self._map_args(x, kept[2])

    def _map_args(self, x: torch.Tensor, phi: torch.Tensor) -> tuple:
        n = self.streams  # phi [n*C, n*n + 2n]: fn's rows in this library's column order
        b_res = self.base[2 * n:].view(n, n).t()  # H_res = comb^T
        return (
            x, phi, self.scale, self.base[:n], self.base[n:2 * n], b_res,
            self.sinkhorn_iters, self.norm_eps, self.sinkhorn_eps, self.pre_eps,
        )

    def no_weight_decay(self) -> set[str]:
        return {"base", "scale"}


class DeepseekV4StreamHead(StreamHead):
    """StreamHead on a DeepseekV4HyperHead's hc_fn, hc_base, hc_scale (shared)."""

    def __init__(self, hf_head: nn.Module):
        nn.Module.__init__(self)  # StreamHead.__init__ would create new parameters
        n = int(hf_head.hc_mult)
        self.dim, self.streams = hf_head.hc_fn.shape[1] // n, n
        self.norm_eps, self.eps = norm_epsilon(hf_head.input_norm), float(hf_head.eps)
        self.hc_fn, self.hc_base, self.hc_scale = hf_head.hc_fn, hf_head.hc_base, hf_head.hc_scale

    def parameters_as_phi_alpha_b(self):
        return self.hc_fn.t(), self.hc_scale, self.hc_base

    def reset_parameters(self) -> None:
        """Nothing: the parameters are the HF head's own, which transformers initialises."""

    def no_weight_decay(self) -> set[str]:
        return {"hc_base", "hc_scale"}


def _mhc_attn_branch(self, h: torch.Tensor, **kwargs) -> torch.Tensor:
    return self.self_attn(self.input_layernorm(h), **kwargs)[0]


def _mhc_mlp_branch(self, h: torch.Tensor, input_ids=None) -> torch.Tensor:
    return self.mlp(self.post_attention_layernorm(h), input_ids=input_ids)


def _forward(self, hidden_states: torch.Tensor, input_ids=None, **kwargs) -> torch.Tensor:
    """DeepseekV4DecoderLayer.forward with its two mHC updates run as connections."""
    x = self.attn_hc(hidden_states, **kwargs)  # [B, S, n, C]
    return self.ffn_hc(x, input_ids=input_ids)


_CLASSES: dict[type, type] = {}


def _reduce_ex(self, protocol: int):
    # The generated class is in no module until acceleration in this process builds it:
    # pickle the (importable) base class and rebuild the subclass from it, as hf.layers does.
    return _unpickle_accelerated, (type(self).__bases__[0],), self.__getstate__()


def _unpickle_accelerated(base: type) -> nn.Module:
    cls = _accelerated_class(base)
    return cls.__new__(cls)


def _accelerated_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"MHC{cls.__name__}", (cls,), {
            "forward": _forward, "_mhc_attn_branch": _mhc_attn_branch,
            "_mhc_mlp_branch": _mhc_mlp_branch, "__reduce_ex__": _reduce_ex,
            "__module__": __name__,
        })
    return _CLASSES[cls]


def _v4_base(model: nn.Module) -> nn.Module:
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    base = getattr(model, "base_model", model)
    if not isinstance(base, v4.DeepseekV4Model):
        raise ConversionError(
            f"accelerate_deepseek_v4 expects a transformers DeepseekV4ForCausalLM or "
            f"DeepseekV4Model, got {type(model).__name__}"
        )
    if any(isinstance(m, DeepseekV4Connection) for m in base.modules()):
        raise ValueError(f"{type(model).__name__} is already accelerated")
    for i, layer in enumerate(base.layers):
        for name in ("attn_hc", "ffn_hc"):
            if not isinstance(getattr(layer, name, None), v4.DeepseekV4HyperConnection):
                raise ConversionError(
                    f"accelerate_deepseek_v4: layer {i}.{name} is "
                    f"{type(getattr(layer, name, None)).__name__}, expected "
                    "DeepseekV4HyperConnection"
                )
    return base


def accelerate_deepseek_v4(model: nn.Module, impl: str = "auto") -> nn.Module:
    """Replace the hyper-connections and the HyperHead of a DeepSeek-V4 model in place
    (sharing their parameters); returns the model. impl chooses torch_mhc's op implementation."""
    check_transformers_version()
    base = _v4_base(model)
    for i, layer in enumerate(base.layers):
        layer.__class__ = _accelerated_class(type(layer))
        layer.attn_hc = DeepseekV4Connection(layer.attn_hc, 2 * i, layer._mhc_attn_branch, impl)
        layer.ffn_hc = DeepseekV4Connection(layer.ffn_hc, 2 * i + 1, layer._mhc_mlp_branch, impl)
    base.hc_head = DeepseekV4StreamHead(base.hc_head)
    if len(base.layers):  # the layers' class is the accelerated one now
        model._no_split_modules = with_no_split(model, type(base.layers[0]).__name__)
    return model
