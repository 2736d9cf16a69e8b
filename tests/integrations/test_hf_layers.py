"""torch_mhc.hf: which decoder layers convert() accepts, and what a converted layer can do.

A layer converts only if its forward computes h = x + attn(norm1(x)); h + mlp(norm2(h)) with
plain residual additions; these tests give it layers that almost do (real transformers families
and small LlamaDecoderLayer subclasses) and check the refusal names the class and the line.
Models are built from tiny configs (hidden 32) with random weights; nothing is downloaded.
"""

from __future__ import annotations

import copy
import inspect
import io
import re
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

import torch_mhc.hf as mhc_hf  # noqa: E402
from tests.helpers.hf_cases import COMMON, REL, V  # noqa: E402
from tests.helpers.hf_cases import batch as _batch  # noqa: E402
from tests.helpers.hf_cases import logits as _logits  # noqa: E402
from tests.helpers.hf_cases import perturb_connections as _perturb_connections  # noqa: E402
from tests.helpers.hf_cases import rel as _rel  # noqa: E402


def _llama(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval()


def _check_converted(model, ids, mask, ref):
    """The converted model keeps the original logits ref, and its connections matter: moving
    them moves the logits."""
    assert _rel(_logits(model, ids, mask), ref) <= REL
    _perturb_connections(model)
    assert _rel(_logits(model, ids, mask), ref) > 1e-2


def _with_layers(cls: type, **submodules):
    """The tiny Llama with every decoder layer's class replaced by cls (same weights)."""
    model = _llama()
    for layer in model.model.layers:
        layer.__class__ = cls
        for name, module in submodules.items():
            setattr(layer, name, module)
    return model


def _line_of(cls: type, text: str) -> int:
    """The file line number of the first line of cls.forward that contains text."""
    lines, first = inspect.getsourcelines(cls.forward)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _is_plain(model) -> bool:
    return not any(".mhc_" in n for n, _ in model.named_parameters())


# ------------------------------------------------------------------------------------------
# Layers written differently that compute the pre-norm update: accepted


class _Nested(LlamaDecoderLayer):
    """Each sublayer in one nested expression: the norm runs first though written last."""

    def forward(self, hidden_states, **kwargs):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states),
                                                       **kwargs)[0]
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class _Swapped(LlamaDecoderLayer):
    """The residual on the right of the +, and +=."""

    def forward(self, hidden_states, **kwargs):
        residual = hidden_states
        out, _ = self.self_attn(self.input_layernorm(hidden_states), **kwargs)
        hidden_states = out + residual
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        hidden_states += residual
        return hidden_states


@pytest.mark.parametrize("cls", [_Nested, _Swapped])
def test_plain_residual_updates_written_differently_convert(cls):
    model = _with_layers(cls)
    ids, mask = _batch()
    ref = _logits(model, ids, mask)
    assert _rel(ref, _logits(_llama(), ids, mask)) <= REL  # the same function as Llama's layer
    mhc_hf.convert(model, "mhc", streams=4)
    spec = model.model.layers[0]._mhc_spec
    assert (spec.norm1, spec.attn, spec.norm2, spec.mlp) == (
        "input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    assert _rel(_logits(model, ids, mask), ref) <= REL


# ------------------------------------------------------------------------------------------
# Layers with something else on the residual path: refused, naming the class and the line


class _ScaledBranch(LlamaDecoderLayer):
    def forward(self, hidden_states, **kwargs):
        h = hidden_states + 0.5 * self.self_attn(self.input_layernorm(hidden_states), **kwargs)[0]
        return h + self.mlp(self.post_attention_layernorm(h))


class _ScaledResidual(LlamaDecoderLayer):
    def forward(self, hidden_states, **kwargs):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), **kwargs)[0]
        return 2 * h + self.mlp(self.post_attention_layernorm(h))


class _DropoutOnResidual(LlamaDecoderLayer):
    def forward(self, hidden_states, **kwargs):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), **kwargs)[0]
        h = torch.nn.functional.dropout(h, 0.1, self.training)
        return h + self.mlp(self.post_attention_layernorm(h))


class _InPlace(LlamaDecoderLayer):
    def forward(self, hidden_states, **kwargs):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), **kwargs)[0]
        h.mul_(2)
        return h + self.mlp(self.post_attention_layernorm(h))


@pytest.mark.parametrize("cls, text, reason", [
    (_ScaledBranch, "0.5 *", "scaled residual: a residual update multiplies the residual or a "
                             "sublayer output"),
    (_ScaledResidual, "2 * h", "scaled residual"),
    (_DropoutOnResidual, "dropout(h", "dropout on the residual path"),
    (_InPlace, "h.mul_(2)", "an in-place op changes the hidden states on the residual path"),
])
def test_arithmetic_on_the_residual_path_is_refused(cls, text, reason):
    model = _with_layers(cls)
    line = _line_of(cls, text)
    e = _refusal(model)
    assert str(e).startswith(f"torch_mhc.hf cannot convert LlamaForCausalLM: {reason}"), str(e)
    assert str(e).endswith(f" ({cls.__name__}.forward, test_hf_layers.py:{line})"), str(e)
    assert f"{cls.__name__}.forward (test_hf_layers.py line {line}: `" in e.details
    assert text in e.details.split(f"line {line}: ")[1].split("`")[1]  # that line's source
    assert "puts something else on the residual path; " in e.details
    assert "expected each residual update to be exactly `residual + <sublayer output>`" \
           in e.details


def _refusal(model) -> mhc_hf.ConversionError:
    """convert's refusal of model: one line under 200 characters, the long story in details;
    the model is left as it was."""
    with pytest.raises(mhc_hf.ConversionError) as e:
        mhc_hf.convert(model, "mhc", streams=4)
    assert "\n" not in str(e.value) and len(str(e.value)) < 200, str(e.value)
    assert len(e.value.details) > 100
    assert _is_plain(model)
    return e.value


class _ResidualAfterNorm(LlamaDecoderLayer):
    """Plain additions, but the residual is the normed input (MiniMax's order)."""

    def forward(self, hidden_states, **kwargs):
        hidden_states = self.input_layernorm(hidden_states)
        h = hidden_states + self.self_attn(hidden_states, **kwargs)[0]
        return h + self.mlp(self.post_attention_layernorm(h))


def test_residual_taken_after_the_norm_is_refused():
    e = _refusal(_with_layers(_ResidualAfterNorm))
    line = _line_of(_ResidualAfterNorm, "hidden_states = self.input_layernorm")
    assert str(e) == ("torch_mhc.hf cannot convert LlamaForCausalLM: residual taken after the "
                      "norm: self.input_layernorm's output is added (_ResidualAfterNorm.forward, "
                      f"test_hf_layers.py:{line})")
    ret = _line_of(_ResidualAfterNorm, "return h +")
    assert re.search(rf"_ResidualAfterNorm.forward \(test_hf_layers.py line {ret}: "
                     r"`return h \+ .*`\) returns \(\(self.input_layernorm\(hidden_states"
                     r"\) \+ self.self_attn\(self.input_layernorm\(hidden_states\)\)\[0\]"
                     r"\) \+ self.mlp", e.details), e.details


class _ReturnsTuple(LlamaDecoderLayer):
    def forward(self, hidden_states, **kwargs):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), **kwargs)[0]
        return h + self.mlp(self.post_attention_layernorm(h)), None


class _ExtraCall(LlamaDecoderLayer):
    def forward(self, hidden_states, **kwargs):
        h = hidden_states + self.drop(self.self_attn(self.input_layernorm(hidden_states),
                                                     **kwargs)[0])
        return h + self.mlp(self.post_attention_layernorm(h))


def test_tuple_returns_and_extra_calls_are_refused():
    line = _line_of(_ReturnsTuple, "return h")
    e = _refusal(_with_layers(_ReturnsTuple))
    assert str(e) == ("torch_mhc.hf cannot convert LlamaForCausalLM: the layer returns a tuple, "
                      "not the hidden states alone (_ReturnsTuple.forward, "
                      f"test_hf_layers.py:{line})")
    assert re.search(rf"_ReturnsTuple.forward \(test_hf_layers.py line {line}: .*\) returns a "
                     "tuple; expected forward to return the hidden states alone", e.details)
    # the calls are listed in the order they run, not the order they are written
    e = _refusal(_with_layers(_ExtraCall, drop=torch.nn.Dropout(0.1)))
    line = _line_of(_ExtraCall, "self.drop(")
    assert str(e) == ("torch_mhc.hf cannot convert LlamaForCausalLM: self.drop is applied to "
                      "self.self_attn's output before the residual add (_ExtraCall.forward, "
                      f"test_hf_layers.py:{line})")
    assert "_ExtraCall.forward calls the submodules ['input_layernorm', 'self_attn', 'drop', " \
           "'post_attention_layernorm', 'mlp']; expected exactly four" in e.details


def _granite():
    return transformers.GraniteForCausalLM(transformers.GraniteConfig(
        **COMMON, residual_multiplier=0.5))


def _granite_moe():
    return transformers.GraniteMoeForCausalLM(transformers.GraniteMoeConfig(
        **COMMON, residual_multiplier=0.5, num_local_experts=2, num_experts_per_tok=1))


def _minimax():
    return transformers.MiniMaxForCausalLM(transformers.MiniMaxConfig(
        **COMMON, num_local_experts=2, num_experts_per_tok=1, head_dim=8,
        layer_types=["linear_attention", "full_attention"]))


def _bloom():
    return transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=V, hidden_size=32, n_head=4, n_layer=2))


def _falcon():
    return transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        new_decoder_architecture=False, parallel_attn=False, num_kv_heads=4))


@pytest.mark.parametrize("build, message, details", [
    (_granite, r"scaled residual: .* \(GraniteDecoderLayer.forward, modeling_granite.py:\d+\)",
     r"GraniteDecoderLayer.forward \(modeling_granite.py line \d+: `hidden_states = residual \+ "
     r"hidden_states \* self.residual_multiplier`\) puts something else on the residual path"),
    (_granite_moe, r"scaled residual: .* \(GraniteMoeDecoderLayer.forward, "
                   r"modeling_granitemoe.py:\d+\)",
     r"GraniteMoeDecoderLayer.forward \(modeling_granitemoe.py line \d+: "
     r"`hidden_states = residual \+ hidden_states \* self.residual_multiplier"),
    (_minimax, r"scaled residual: .* \(MiniMaxDecoderLayer.forward, modeling_minimax.py:\d+\)",
     r"MiniMaxDecoderLayer.forward \(modeling_minimax.py line \d+: `hidden_states = "
     r"residual \* self.attn_alpha_factor \+ hidden_states \* self.attn_beta_factor`\)"
     r" puts something else on the residual path"),
    # Bloom's attention and MLP add the residual themselves
    (_bloom, r"self.self_attention is also given `residual`, which carries the hidden states "
             r"\(BloomBlock.forward, modeling_bloom.py:\d+\)",
     r"BloomBlock.forward \(modeling_bloom.py line \d+: .*\): expected a sublayer to receive "
     r"only its normed input"),
    (_falcon, r"the layer returns a tuple, not the hidden states alone \(FalconDecoderLayer"
              r".forward, modeling_falcon.py:\d+\)",
     r"FalconDecoderLayer.forward \(modeling_falcon.py line \d+: `return output, "
     r"attn_weights`\) returns a tuple"),
])
def test_families_with_another_residual_are_refused(build, message, details):
    torch.manual_seed(0)
    model = build().eval()
    e = _refusal(model)
    name = type(model).__name__
    assert re.fullmatch(rf"torch_mhc.hf cannot convert {name}: {message}", str(e)), str(e)
    assert re.search(details, e.details), e.details


# ------------------------------------------------------------------------------------------
# Families that convert since each layer is read on its own and MLP tuples are unpacked


def test_layers_of_one_class_with_different_sublayers():
    """Qwen3-Next: linear attention in three layers, full attention in the fourth."""
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **{**COMMON, "num_hidden_layers": 4}, head_dim=8, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"])).eval()
    ids, mask = _batch()
    ids, mask = ids[1:], mask[1:]  # no left padding: the linear attention runs over it as tokens
    ref = _logits(model, ids, mask)
    mhc_hf.convert(model, "mhc", streams=4)
    assert [layer._mhc_spec.attn for layer in model.model.layers] == \
        ["linear_attn"] * 3 + ["self_attn"]
    _check_converted(model, ids, mask, ref)


def test_layers_of_different_classes():
    """Jamba: Mamba layers and attention layers, of two classes, in one ModuleList."""
    torch.manual_seed(0)
    model = transformers.JambaForCausalLM(transformers.JambaConfig(
        **{**COMMON, "num_hidden_layers": 4}, attn_layer_offset=1, attn_layer_period=2,
        expert_layer_offset=1, expert_layer_period=2, num_experts=2, num_experts_per_tok=1,
        mamba_d_state=8, mamba_expand=2)).eval()
    ids, mask = _batch()
    ids, mask = ids[1:], mask[1:]  # no left padding: the Mamba layers run over it as tokens
    ref = _logits(model, ids, mask)
    mhc_hf.convert(model, "mhc", streams=4)
    layers = model.model.layers
    assert [type(layer).__name__ for layer in layers] == [
        "MHCJambaMambaDecoderLayer", "MHCJambaAttentionDecoderLayer"] * 2
    assert [layer._mhc_spec.attn for layer in layers] == ["mamba", "self_attn"] * 2
    assert {"MHCJambaMambaDecoderLayer", "MHCJambaAttentionDecoderLayer"} <= set(
        model._no_split_modules)
    _check_converted(model, ids, mask, ref)


def test_mlp_returning_a_tuple():
    """gpt-oss's MoE block returns (hidden states, router scores)."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **COMMON, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
        layer_types=["sliding_attention", "full_attention"])).eval()
    with torch.no_grad():
        for p in model.parameters():  # its experts start at zero: make the MLP matter
            p.normal_(0, 0.2)
    assert isinstance(model.model.layers[0].mlp(torch.randn(1, 3, 32)), tuple)
    ids, mask = _batch()
    ref = _logits(model, ids, mask)
    mhc_hf.convert(model, "mhc", streams=4)
    _check_converted(model, ids, mask, ref)


# ------------------------------------------------------------------------------------------
# Dispatched models, pickling, options


def test_a_dispatched_model_is_refused_and_converting_first_works(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    _llama().save_pretrained(tmp_path / "plain")
    ids, mask = _batch()
    offloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "plain", device_map="auto", max_memory={"cpu": "30KB"},
        offload_folder=str(tmp_path / "offload"))
    assert any(hasattr(m, "_hf_hook") for m in offloaded.modules())
    with pytest.raises(mhc_hf.ConversionError,
                       match=r"cannot convert LlamaForCausalLM: it was dispatched by accelerate.*"
                             r"convert before dispatching \(load it without device_map, "
                             r"convert it, then dispatch it, e.g. with "
                             r"accelerate.dispatch_model\)"):
        mhc_hf.convert(offloaded, "mhc", streams=4)
    assert _is_plain(offloaded)

    # what the message says: load, convert, then dispatch (layer 1 offloaded to disk)
    model = mhc_hf.convert(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain"),
                           "mhc", streams=4)
    _perturb_connections(model)
    ref = _logits(model, ids, mask)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    accelerate.dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path / "o2"))
    assert model.model.layers[1].mhc_attn.phi.device.type == "meta"  # really offloaded
    assert torch.equal(_logits(model, ids, mask), ref)


def test_a_deep_copied_connection_calls_the_model_s_layer():
    """A connection copied alone (as PEFT's modules_to_save copies it) runs the model's own
    layer, so a change to the layer's sublayers reaches it; a copied model runs its copy."""
    model = mhc_hf.convert(_llama(), "mhc", streams=4)
    ids, mask = _batch()
    layer = model.model.layers[0]
    twin = copy.deepcopy(layer.mhc_attn)
    assert twin.branch.layer is layer and twin.phi is not layer.mhc_attn.phi
    whole = copy.deepcopy(model)
    assert whole.model.layers[0].mhc_attn.branch.layer is whole.model.layers[0]
    layer.mhc_attn = twin
    ref = _logits(model, ids, mask)
    assert torch.equal(_logits(whole, ids, mask), ref)
    with torch.no_grad():
        layer.self_attn.o_proj.weight.mul_(2)  # seen by the copied connection
    assert _rel(_logits(model, ids, mask), ref) > 1e-2
    assert torch.equal(_logits(whole, ids, mask), ref)  # the copied model keeps its own layer


def test_converted_model_pickles(tmp_path):
    model = mhc_hf.convert(_llama(), "mhc", streams=4)
    _perturb_connections(model)
    ids, mask = _batch()
    ref = _logits(model, ids, mask)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded.model.layers[0]) is type(model.model.layers[0])
    layer = loaded.model.layers[1]
    assert layer.mhc_mlp.branch.layer is layer  # the branch is this layer's, not a copy's
    assert torch.equal(_logits(loaded, ids, mask), ref)

    # in a fresh interpreter, where no conversion has built the layer class yet
    torch.save({"model": model, "ids": ids, "mask": mask, "ref": ref}, tmp_path / "model.pt")
    code = (
        "import sys, torch\n"
        "d = torch.load(sys.argv[1], weights_only=False)\n"
        "with torch.no_grad():\n"
        "    out = d['model'](d['ids'], attention_mask=d['mask']).logits\n"
        "print(type(d['model'].model.layers[0]).__name__, torch.equal(out, d['ref']))\n"
    )
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "model.pt")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["MHCLlamaDecoderLayer", "True"]


def test_unknown_connection_options_are_refused():
    model = _llama()
    with pytest.raises(ValueError, match=r"unknown connection option\(s\) \['bogus'\] for kind "
                                         r"'residual'; expected \['check_finite', 'impl'\]"):
        mhc_hf.convert(model, "residual", bogus=1)
    with pytest.raises(ValueError, match=r"unknown connection option\(s\) \['bogus', 'zz'\] for "
                                         r"kind 'mhc'; expected \['check_finite', 'gate_init', "
                                         r"'impl', 'norm_eps', 'pre_eps', 'res_init_diag', "
                                         r"'sinkhorn_eps', 'sinkhorn_iters'\]"):
        mhc_hf.convert(model, "mhc", zz=2, bogus=1, sinkhorn_iters=7)
    with pytest.raises(ValueError, match=r"\['sinkhorn_iter'\] \(sinkhorn_iter: did you mean "
                                         r"sinkhorn_iters\?\) for kind 'mhc'"):
        mhc_hf.convert(model, "mhc", sinkhorn_iter=7)
    with pytest.raises(ValueError, match=r"\['sinkhorn_iters'\] for kind 'hc'; expected "
                                         r"\['check_finite', 'dynamic', 'impl', 'norm_eps'\]"):
        mhc_hf.convert(model, "hc", sinkhorn_iters=7)
    assert _is_plain(model) and not hasattr(model.config, "mhc_conversion")
    mhc_hf.convert(model, "residual")
    assert model.config.mhc_conversion["options"] == {}
