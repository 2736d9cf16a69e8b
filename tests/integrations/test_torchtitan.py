"""torch_mhc.integrations.torchtitan on one process: the converter, its errors, checkpoints.

Function preservation. At initialisation every connection is the residual x + F(x) on equal
streams (connections.py), so the converted model computes the unconverted one's logits. It is
not bit-exact: mHC forms x as sum_j H_res[i, j] x_j with weights 0.625 and 3 x 0.125 (exact in
binary, but the four-term sum rounds), each of 12 connections adds a few ulps of |x|, and
the logits go through the final norm and lm_head. Measured on the llama3 debug model: 1.2e-6
against |logits| up to 4.7 (3e-7 relative, ~2 ulps of fp32). The tolerance, 1e-5 of the
largest logit (~80 ulps), leaves room for other BLAS builds; a wrong stream read, H_post or
reduction moves the logits by O(1). HC at initialisation (H_pre = e_k, H_res = I, W = 0)
rounds nothing: equal to the last bit.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers import titan_support as S

pytestmark = pytest.mark.skipif(not S.AVAILABLE, reason=S.SKIP_REASON)

CONNECTION_KEY = re.compile(
    r"layers\.\d+\.(attention_hc|ffn_hc)\.(phi|alpha|b_pre|b_post|b_res|"
    r"static_pre|static_post|static_res|w|s_alpha|s_beta)"
)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
@pytest.mark.parametrize("kind", ["mhc", "hc"])
def test_converted_model_computes_the_unconverted_function_at_init(family, kind):
    base = S.build(S.model_config(family, None))
    conv = S.build(S.model_config(family, kind))
    tok, pos = S.tokens(base.config.vocab_size)
    with torch.no_grad():
        ref, got = S.logits(base, tok, pos), S.logits(conv, tok, pos)
    scale = ref.abs().max().item()
    assert scale > 0.5  # real logits, not a degenerate model
    if kind == "hc":
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got, ref, rtol=0.0, atol=1e-5 * scale)
    # The streams really are separate tensors inside: the middle block sees [B, T, n, C].
    assert conv.layers["0"].hc_first and conv.layers[str(len(conv.layers) - 1)].hc_last


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_only_the_connection_parameters_are_added(family):
    with torch.device("meta"):
        base = S.model_config(family, None).build()
        conv = S.model_config(family, "mhc").build()
    b, c = base.state_dict(), conv.state_dict()
    assert set(b) <= set(c)
    assert all(c[k].shape == b[k].shape for k in b)
    added = sorted(set(c) - set(b))
    assert all(CONNECTION_KEY.fullmatch(k) for k in added), added
    n, dim, layers = 4, base.config.dim, len(base.layers)
    assert len(added) == 2 * layers * 5  # phi, alpha, b_pre, b_post, b_res per connection
    assert c["layers.0.attention_hc.phi"].shape == (n * dim, n * n + 2 * n)


def test_override_is_the_converter():
    """The @override factory, applied through torchtitan's override machinery to a whole
    trainer config, gives the converter's model config."""
    from torchtitan.config.override import apply_overrides
    from torchtitan.models.llama3 import config_registry

    config = config_registry.llama3_debugmodel()
    config.override.imports = [
        ("torch_mhc.integrations.torchtitan.converter.mhc_override", {"streams": 2})]
    apply_overrides(config.override, config)
    layers = config.model_spec.model.layers
    assert [type(layer).__qualname__ for layer in layers] == ["HyperLlama3Block.Config"] * 6
    assert [layer.hc_streams for layer in layers] == [2] * 6
    assert [layer.hc_first for layer in layers] == [True] + [False] * 5


def test_ready_configs_are_converted():
    from torch_mhc.integrations.torchtitan import config_registry as R

    for fn, n_layers in ((R.llama3_debugmodel_mhc, 6), (R.llama3_8b_mhc, 32),
                         (R.qwen3_debugmodel_mhc, 8), (R.llama3_debugmodel_hc, 6)):
        layers = fn().model_spec.model.layers
        assert len(layers) == n_layers
        assert {layer.hc_kind for layer in layers} == {"hc" if "_hc" in fn.__name__ else "mhc"}
        assert [layer.hc_last for layer in layers].index(True) == n_layers - 1


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(streams=0), ValueError, "streams must be an integer >= 1, got 0"),
        (dict(streams=2.0), ValueError, "streams must be an integer >= 1, got 2.0"),
        (dict(kind="residual"), ValueError, "kind must be one of ('hc', 'mhc')"),
        # the options, before any model is built (they failed there, naming the class's init)
        (dict(options={"sinkhorn_iter": 5}), TypeError,
         "MhcConverter: make_connection: 'mhc' (ManifoldHyperConnection) takes no option(s) "
         "['sinkhorn_iter'] (sinkhorn_iter: did you mean sinkhorn_iters?)"),
        (dict(kind="hc", options={"sinkhorn_iters": 5}), TypeError,
         "'hc' (HyperConnection) takes no option(s) ['sinkhorn_iters']"),
        (dict(options={"sinkhorn_iters": 0}), ValueError,
         "MhcConverter: ManifoldHyperConnection expects sinkhorn_iters >= 1, got 0"),
    ],
)
def test_bad_settings_are_refused(kwargs, error, message):
    from torch_mhc.integrations.torchtitan import MhcConverter

    with pytest.raises(error) as err:
        MhcConverter.Config(**kwargs).build()
    assert message in str(err.value)


@pytest.mark.parametrize("kind", ["mhc", "hc"])
def test_a_branch_output_of_another_shape_is_refused(kind):
    """The merge would broadcast a [B, T, 1] output onto every channel without a word."""
    from torch_mhc.integrations.torchtitan.connection import (
        TitanHyperConnection,
        TitanManifoldHyperConnection,
    )

    cls = TitanManifoldHyperConnection if kind == "mhc" else TitanHyperConnection
    conn = cls(8, 2, 0)
    x = torch.randn(2, 3, 2, 8)
    with pytest.raises(ValueError, match=r"the branch must return a tensor of its input's "
                                         r"shape \(2, 3, 8\), got \(2, 3, 1\)"):
        conn(x, lambda h: h[..., :1])


def test_converting_twice_is_refused():
    cfg = S.model_config("llama3", "mhc")
    from torch_mhc.integrations.torchtitan import convert_model_config

    with pytest.raises(ValueError, match=r"layers\[0\] is already converted"):
        convert_model_config(cfg)


def test_moe_and_unknown_blocks_are_refused():
    from torchtitan.models.common.decoder import TransformerBlock
    from torchtitan.models.qwen3 import qwen3_configs

    from torch_mhc.integrations.torchtitan import convert_model_config

    moe = qwen3_configs["debugmodel_moe"](attn_backend="flex")
    with pytest.raises(NotImplementedError, match=r"layers\[\d+\] is a mixture-of-experts"):
        convert_model_config(moe)

    cfg = S.model_config("llama3", None)
    values = {f: getattr(cfg.layers[1], f) for f in ("attention", "feed_forward",
                                                     "attention_norm", "ffn_norm")}
    cfg.layers[1] = TransformerBlock.Config(**values)  # a block whose forward we don't know
    with pytest.raises(TypeError, match=r"layers\[1\] is a TransformerBlock.Config; supp"):
        convert_model_config(cfg)
    assert type(cfg.layers[0]).__name__ == "Config"  # nothing converted on the way
    assert not hasattr(cfg.layers[0], "hc_kind")
    with pytest.raises(TypeError, match="expects a torchtitan decoder config"):
        convert_model_config(cfg.layers[0])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoints_between_converted_and_unconverted_models(tmp_path):
    """An mHC checkpoint offered to an unconverted model, and the reverse: one clear error
    each; matching pairs pass."""
    import torch.distributed.checkpoint as dcp

    from torch_mhc.integrations.torchtitan import check_checkpoint_keys

    with torch.device("meta"):
        base = S.model_config("llama3", None).build()
        conv = S.model_config("llama3", "mhc").build()
    for name, model in (("base", base), ("conv", conv)):
        model.to_empty(device="cpu")
        dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / name))
    check_checkpoint_keys(tmp_path / "base", base)
    check_checkpoint_keys(tmp_path / "conv", [conv])
    with pytest.raises(ValueError, match="holds HC / mHC connection parameters \\(60 tensors"):
        check_checkpoint_keys(tmp_path / "conv", base)
    with pytest.raises(ValueError, match="saved by an unconverted model"):
        check_checkpoint_keys(tmp_path / "base", conv)


# --- compile ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_one_converted_block_compiles_in_one_graph():
    """torch.compile(fullgraph=True) of a middle block (streams in, streams out): no graph
    break anywhere in the connections, the op lookup or the block; output as eager."""
    model = S.build(S.model_config("llama3", "mhc"))
    block = model.layers["2"]
    with torch.no_grad():  # maps away from their exact start, so the ops do real work
        g = torch.Generator().manual_seed(3)
        for conn in (block.attention_hc, block.ffn_hc):
            for p in conn.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    tok, pos = S.tokens(model.config.vocab_size)
    masks = None  # causal SDPA (titan_support.model_config)
    x = torch.randn(S.BATCH, S.SEQ, 4, model.config.dim, generator=g)  # [B, T, n, C]
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    xc = x.clone().requires_grad_()
    out_c = compiled(xc, masks, pos)
    out_c.square().mean().backward()
    grads_c = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    xe = x.clone().requires_grad_()
    out_e = block(xe, masks, pos)
    out_e.square().mean().backward()
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-5, atol=1e-6)
    for name, p in block.named_parameters():
        torch.testing.assert_close(grads_c[name], p.grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")
    torch._dynamo.reset()


# --- HF export ---------------------------------------------------------------------------


def _perturbed(model, seed: int = 3):
    """Connections moved away from their initial values (a wrong mapping then shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if CONNECTION_KEY.match(name):
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _adapter(family: str, cfg):
    from torchtitan.models.llama3 import model_registry as llama3
    from torchtitan.models.qwen3 import model_registry as qwen3

    from torch_mhc.integrations.torchtitan import with_connections

    base = (llama3 if family == "llama3" else qwen3)("debugmodel").state_dict_adapter
    return with_connections(base)(cfg, None)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
@pytest.mark.parametrize("kind", ["mhc", "hc"])
def test_hf_export_keeps_connections_and_computes_the_same_logits(family, kind):
    """to_hf of a converted debug model (connections perturbed) loads fully into the
    transformers model of the same shapes converted by torch_mhc.hf.convert with
    hf_conversion's arguments: same logits, within the tolerance of the module docstring
    (measured: llama3 mHC 1.4e-6 against |logits| up to 4.7). from_hf gives back the
    torchtitan state dict exactly."""
    pytest.importorskip("transformers")
    import torch_mhc.hf
    from torch_mhc.integrations.torchtitan import hf_conversion

    cfg = S.model_config(family, kind)
    model = S.build(cfg)
    tok, pos = S.tokens(cfg.vocab_size)
    with torch.no_grad():
        at_init = S.logits(model, tok, pos)
        ref = S.logits(_perturbed(model), tok, pos)
    adapter = _adapter(family, cfg)
    hf_sd = adapter.to_hf(model.state_dict())
    assert "model.layers.5.mhc_mlp." + ("phi" if kind == "mhc" else "static_res") in hf_sd
    hf = S.hf_twin(family, cfg)
    torch_mhc.hf.convert(hf, **hf_conversion(cfg))
    result = hf.load_state_dict(hf_sd, strict=False)
    tied = ["lm_head.weight"] if cfg.enable_weight_tying else []  # qwen3: the embedding
    assert (result.missing_keys, result.unexpected_keys) == (tied, [])
    with torch.no_grad():
        got = hf(tok).logits
    scale = ref.abs().max().item()
    assert (ref - at_init).abs().max().item() > 1e-3 * scale  # the connections matter
    torch.testing.assert_close(got, ref, rtol=0.0, atol=1e-5 * scale)
    back = adapter.from_hf(dict(hf_sd))
    own = model.state_dict()
    assert set(back) == set(own)
    assert all(torch.equal(back[k], own[k]) for k in own)


def test_hf_import_into_an_unconverted_model_is_refused():
    pytest.importorskip("transformers")
    conv = S.model_config("llama3", "mhc")
    base = S.model_config("llama3", None)
    with torch.device("meta"):
        hf_sd = _adapter("llama3", conv).to_hf(conv.build().state_dict())
    with pytest.raises(ValueError, match=r"holds HC / mHC connections \(60 tensors, e\.g\. "
                                         r"'model\.layers\.0\.mhc_attn\.alpha'\)"):
        _adapter("llama3", base).from_hf(hf_sd)


def test_hf_export_puts_connections_in_their_layers_safetensors_file():
    """With the HF assets' index (fqn_to_index_mapping), every written key needs a file:
    a connection goes to its layer's file."""
    cfg = S.model_config("llama3", "mhc")
    adapter = _adapter("llama3", cfg)
    adapter.fqn_to_index_mapping = {f"model.layers.{i}.input_layernorm.weight": 1 + i // 3
                                    for i in range(6)}
    with torch.device("meta"):
        adapter.to_hf(cfg.build().state_dict())
    mapping = adapter.fqn_to_index_mapping
    assert mapping["model.layers.1.mhc_attn.phi"] == 1
    assert mapping["model.layers.4.mhc_mlp.b_res"] == 2


# --- checkpoint loads through torchtitan's CheckpointManager ------------------------------


def _saved(tmp_path, name: str, kind: str | None, streams: int = 4):
    """A DCP checkpoint of a (meta-built, uninitialised) debug model's state dict: the keys
    torchtitan's CheckpointManager writes for a model-only save."""
    import torch.distributed.checkpoint as dcp

    with torch.device("meta"):
        model = S.model_config("llama3", kind, streams).build()
    model.to_empty(device="cpu")
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / name))
    return tmp_path / name


def _manager(model, load_path, family: str = "llama3", assets=None, **config):
    """MhcCheckpointManager over `model` with an initial model-only load from load_path: its
    load() is the trainer's (CheckpointManager._load -> dcp_load). assets: the HF assets
    folder (hf_assets_path)."""
    from torchtitan.models.llama3 import model_registry as llama3
    from torchtitan.models.qwen3 import model_registry as qwen3

    from torch_mhc.integrations.torchtitan import MhcCheckpointManager

    adapter = (llama3 if family == "llama3" else qwen3)("debugmodel").state_dict_adapter
    cfg = MhcCheckpointManager.Config(enable=True, folder="none",
                                      initial_load_path=str(load_path), **config)
    return cfg.build(dataloader=None, model_parts=[model], optimizers=None,
                     lr_schedulers=None, states={},
                     sd_adapter=adapter(model.config, None if assets is None else str(assets)),
                     base_folder=str(load_path.parent))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize(
    "saved, loading, message",
    [
        (None, "mhc", r"the model has HC / mHC connections \(e\.g\. 'layers\.0\.attention_hc"
                      r"\.alpha': mHC, n = 4, 12 connections\) but checkpoint .* holds none"),
        ("mhc", None, r"holds HC / mHC connection parameters \(60 tensors, .*mHC, n = 4, 12 "
                      r"connections\) but the model has no connections"),
        ("hc", "mhc", r"other HC / mHC connections than the model: checkpoint HC \(dynamic\), "
                      r"n = 4, 12 connections, model mHC, n = 4, 12 connections"),
        ("mhc2", "mhc", r"checkpoint mHC, n = 2, 12 connections, model mHC, n = 4, 12 conn"),
    ],
)
def test_checkpoint_manager_refuses_a_checkpoint_of_another_kind(tmp_path, saved, loading,
                                                                 message):
    """The trainer's load of a checkpoint of another kind (unconverted, HC for mHC, other
    streams) into a model: one line, before DCP (whose own errors would be a bare "Missing
    key" or a size mismatch, or nothing at all for an unconverted model)."""
    kind, streams = (saved[:-1], 2) if saved and saved[-1].isdigit() else (saved, 4)
    path = _saved(tmp_path, "ckpt", kind, streams)
    model = S.build(S.model_config("llama3", loading))
    with pytest.raises(ValueError, match=message) as err:
        _manager(model, path).load()
    assert "\n" not in str(err.value)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_manager_loads_a_matching_checkpoint_and_fresh_connections(tmp_path):
    """A converted model's checkpoint loads into another converted model (every tensor);
    with fresh_connections, an unconverted model's checkpoint loads into a converted model
    whose connections keep their initial values: the unconverted model's logits."""
    import torch.distributed.checkpoint as dcp

    source = _perturbed(S.build(S.model_config("llama3", "mhc"), seed=5))
    dcp.save(source.state_dict(), checkpoint_id=str(tmp_path / "mhc"))
    target = S.build(S.model_config("llama3", "mhc"))
    assert _manager(target, tmp_path / "mhc").load()
    own, want = target.state_dict(), source.state_dict()
    assert all(torch.equal(own[k], want[k]) for k in want)

    base = S.build(S.model_config("llama3", None), seed=7)
    dcp.save(base.state_dict(), checkpoint_id=str(tmp_path / "base"))
    conv = S.build(S.model_config("llama3", "mhc"))
    assert _manager(conv, tmp_path / "base", fresh_connections=True).load()
    tok, pos = S.tokens(base.config.vocab_size)
    with torch.no_grad():
        ref, got = S.logits(base, tok, pos), S.logits(conv, tok, pos)
    scale = ref.abs().max().item()
    torch.testing.assert_close(got, ref, rtol=0.0, atol=1e-5 * scale)


class _Warnings(list):
    def warning(self, message):
        self.append(message)

    def info(self, message):
        pass


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_hf_checkpoints_keep_connections_through_the_checkpoint_manager(tmp_path, monkeypatch):
    """The trainer's HF export (dcp_save to_hf) writes the connections under torch_mhc.hf's
    names; the trainer's HF load (from_hf) restores them; an unconverted model's HF export
    offered to a converted model is refused in one line. Without a base config.json in the HF
    assets the export stays weights only, and a warning says how to finish it."""
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    from torch_mhc.integrations.torchtitan import checkpoint

    warnings = _Warnings()
    monkeypatch.setattr(checkpoint, "logger", warnings)
    source = _perturbed(S.build(S.model_config("llama3", "mhc"), seed=5))
    export = tmp_path / "hf"
    manager = _manager(source, export)
    manager.dcp_save(manager.states["model"].state_dict(), str(export), async_mode="disabled",
                     to_hf=True)
    files = sorted(export.glob("*.safetensors"))
    keys = {k for f in files for k in safe_open(str(f), "pt").keys()}
    assert "model.layers.0.mhc_attn.phi" in keys and "model.layers.5.mhc_mlp.b_res" in keys
    assert not any("attention_hc" in k or "ffn_hc" in k for k in keys)
    assert not (export / "config.json").exists()
    call = re.search(r"holds the weights with the HC / mHC connections but was not made "
                     r"portable, no HF assets folder .* To make it load with them: "
                     r"(torch_mhc\.hf\.make_portable\(.*\))$", warnings[0]) if len(
                         warnings) == 1 else None
    assert call is not None, warnings
    # the call it gives, pasted with a base config's path, makes the export portable
    import torch_mhc.hf

    cfg = S.model_config("llama3", "mhc")
    S.hf_twin("llama3", cfg).config.save_pretrained(tmp_path / "base")
    exec(call[1].replace("path/to/the/base/config.json", str(tmp_path / "base/config.json")))
    tok, pos = S.tokens(cfg.vocab_size)
    with torch.no_grad():
        ref = S.logits(source, tok, pos)
        got = torch_mhc.hf.from_pretrained(export).eval()(tok).logits
    torch.testing.assert_close(got, ref, rtol=0.0, atol=1e-5 * ref.abs().max().item())

    target = S.build(S.model_config("llama3", "mhc"))
    assert _manager(target, export, initial_load_in_hf=True).load()
    own, want = target.state_dict(), source.state_dict()
    assert all(torch.equal(own[k], want[k]) for k in want)

    base = S.build(S.model_config("llama3", None))
    plain = tmp_path / "hf_plain"
    manager = _manager(base, plain)
    manager.dcp_save(manager.states["model"].state_dict(), str(plain), async_mode="disabled",
                     to_hf=True)
    with pytest.raises(ValueError, match="saved by an unconverted model") as err:
        _manager(S.build(S.model_config("llama3", "mhc")), plain,
                 initial_load_in_hf=True).load()
    assert "\n" not in str(err.value)


def test_ready_configs_and_the_override_check_checkpoints():
    """The ready configs, convert_trainer_config and the mhc_checkpoint override give the
    checking manager and the connection-keeping HF adapter."""
    from torchtitan.config.override import apply_overrides
    from torchtitan.models.llama3 import config_registry

    from torch_mhc.integrations.torchtitan import (
        HyperLlama3StateDictAdapter,
        MhcCheckpointManager,
        convert_trainer_config,
    )
    from torch_mhc.integrations.torchtitan import config_registry as R

    ready = R.qwen3_debugmodel_mhc()
    assert isinstance(ready.checkpoint, MhcCheckpointManager.Config)
    assert ready.model_spec.state_dict_adapter.__name__ == "HyperQwen3StateDictAdapter"
    config = convert_trainer_config(config_registry.llama3_debugmodel(), "hc", 2,
                                    fresh_connections=True)
    assert config.checkpoint.fresh_connections and config.checkpoint.interval == 10
    assert config.model_spec.state_dict_adapter is HyperLlama3StateDictAdapter
    assert config.model_spec.model.layers[0].hc_kind == "hc"

    config = config_registry.llama3_debugmodel()
    config.override.imports = [
        ("torch_mhc.integrations.torchtitan.converter.mhc_override", {"streams": 2}),
        "torch_mhc.integrations.torchtitan.checkpoint.mhc_checkpoint"]
    apply_overrides(config.override, config)
    assert type(config.checkpoint) is MhcCheckpointManager.Config
    assert not config.checkpoint.fresh_connections


# Runs where torch_mhc cannot be imported: transformers alone loads the portable export.
PORTABLE_WORKER = r"""
import json, sys
sys.modules["torch_mhc"] = None
import torch
from transformers import AutoModelForCausalLM

folder, ref = sys.argv[1], torch.load(sys.argv[2])
try:
    AutoModelForCausalLM.from_pretrained(folder)
    refused = None
except ValueError as e:
    refused = str(e)
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
with torch.no_grad():
    diff = (model(ref["ids"]).logits - ref["logits"]).abs().max().item()
layer = type(model.get_submodule("model.layers.0")).__name__
json.dump({"refused": refused, "diff": diff, "layer": layer}, open(sys.argv[3], "w"))
"""


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_hf_export_with_the_base_config_in_the_assets_is_portable(tmp_path, family):
    """With the base model's config.json in the HF assets folder (where torchtitan keeps it),
    the manager's HF export is a portable folder: transformers alone (torch_mhc unimportable)
    refuses it without trust_remote_code and with it computes the torchtitan model's logits
    (the tolerance of the module docstring; measured: llama3 1.4e-6 against |logits| up to
    5.0); torch_mhc.hf loads it too; the manager loads it back, every tensor equal."""
    import json
    import os
    import subprocess
    import sys

    import torch_mhc.hf

    cfg = S.model_config(family, "mhc")
    source = _perturbed(S.build(cfg, seed=5))
    assets = tmp_path / "assets"
    S.hf_twin(family, cfg).config.save_pretrained(assets)
    export = tmp_path / "hf"
    manager = _manager(source, export, family, assets)
    manager.dcp_save(manager.states["model"].state_dict(), str(export), async_mode="disabled",
                     to_hf=True)
    assert json.loads((export / "config.json").read_text())["model_type"] == "torch_mhc"
    tok, pos = S.tokens(cfg.vocab_size)
    with torch.no_grad():
        ref = S.logits(source, tok, pos)
        library = torch_mhc.hf.from_pretrained(export).eval()(tok).logits
    scale = ref.abs().max().item()
    torch.testing.assert_close(library, ref, rtol=0.0, atol=1e-5 * scale)

    torch.save({"ids": tok, "logits": ref}, tmp_path / "ref.pt")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", PORTABLE_WORKER, str(export),
                          str(tmp_path / "ref.pt"), str(tmp_path / "got.json")], env=env,
                         text=True, capture_output=True, stdin=subprocess.DEVNULL, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads((tmp_path / "got.json").read_text())
    assert got["refused"] is not None and "trust_remote_code=True" in got["refused"]
    assert got["layer"].startswith("MHC") and got["diff"] <= 1e-5 * scale, got

    target = S.build(S.model_config(family, "mhc"))
    assert _manager(target, export, family, assets, initial_load_in_hf=True).load()
    own, want = target.state_dict(), source.state_dict()
    assert all(torch.equal(own[k], want[k]) for k in want)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_hf_export_with_another_base_config_stays_weights_only(tmp_path, monkeypatch):
    """A base config.json in the assets that is not the model's (here its rotary base, which
    the weights' shapes do not show) leaves the export weights only, with a warning naming
    the difference."""
    import json

    from torch_mhc.integrations.torchtitan import checkpoint

    warnings = _Warnings()
    monkeypatch.setattr(checkpoint, "logger", warnings)
    cfg = S.model_config("llama3", "mhc")
    source = S.build(cfg)
    assets = tmp_path / "assets"
    S.hf_twin("llama3", cfg).config.save_pretrained(assets)
    config = json.loads((assets / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 10000.0
    (assets / "config.json").write_text(json.dumps(config))
    export = tmp_path / "hf"
    manager = _manager(source, export, "llama3", assets)
    manager.dcp_save(manager.states["model"].state_dict(), str(export), async_mode="disabled",
                     to_hf=True)
    assert not (export / "config.json").exists()
    assert len(warnings) == 1 and re.search(
        r"was not made portable, with the base config .*config\.json: ValueError: its rope "
        r"theta is 10000\.0, the torchtitan model's 500000\. A base model's", warnings[0]), \
        warnings


@pytest.mark.parametrize("change, message", [
    ({"rope_type": "default"}, r"its rope type is 'default', the torchtitan model's rotary "
                               r"scaling 'llama' is transformers' 'llama3'"),
    ({"factor": 16.0}, r"its rope factor is 16\.0, the torchtitan model's 8\.0"),
])
def test_the_base_configs_rope_scaling_is_compared(tmp_path, change, message):
    """The llama3 models' rotary scaling (type and parameters), which the weights' shapes do
    not show, must be the base config's."""
    import json

    from torch_mhc.integrations.torchtitan.checkpoint import _check_scalars

    cfg = S.model_config("llama3", "mhc")
    S.hf_twin("llama3", cfg).config.save_pretrained(tmp_path)
    _check_scalars(cfg, str(tmp_path / "config.json"))  # the model's own: no difference
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        _check_scalars(cfg, str(tmp_path / "config.json"))
