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
    ],
)
def test_bad_settings_are_refused(kwargs, error, message):
    from torch_mhc.integrations.torchtitan import MhcConverter

    with pytest.raises(error) as err:
        MhcConverter.Config(**kwargs).build()
    assert message in str(err.value)


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
