"""torch_mhc.integrations.deepseek_v4 against Hugging Face transformers' DeepseekV4HyperConnection.

The real module is built from a tiny config with random (not initial) fn, base and scale;
no weights are downloaded. It computes its maps in float32 whatever its input dtype (it
calls `.float()`), so the float64 checks run a line-by-line float64 transcription of its
forward, which is itself checked against the real module in float32.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from torch_mhc import ManifoldHyperConnection, StreamHead, reduce_streams  # noqa: E402
from torch_mhc.integrations.deepseek_v4 import (  # noqa: E402
    from_deepseek_v4,
    from_deepseek_v4_head,
    load_deepseek_v4_head_state_dict,
    load_deepseek_v4_state_dict,
    to_deepseek_v4_head_state_dict,
    to_deepseek_v4_state_dict,
)

B, S = 2, 5  # batch, sequence
ITERS, HC_EPS, RMS_EPS = 20, 1e-6, 1e-6
# Allowed max |got - ref| relative to max |ref|, per tensor. Relative to the largest entry,
# not element-wise: gradients are sums over tokens and streams whose small entries come from
# cancellation, where float32 rounding is bounded by the size of the terms, not of the result.
REL = {torch.float32: 2e-6, torch.float64: 1e-12}


def _config(hidden: int, n: int):
    # Only hidden_size, hc_* and rms_norm_eps reach the hyper-connection; the rest is kept tiny.
    return hf.DeepseekV4Config(
        hidden_size=hidden, hc_mult=n, hc_sinkhorn_iters=ITERS, hc_eps=HC_EPS,
        rms_norm_eps=RMS_EPS, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
        q_lora_rank=8, o_lora_rank=8, o_groups=1, n_routed_experts=2, num_experts_per_tok=1,
        index_n_heads=2, index_head_dim=8, vocab_size=16, intermediate_size=16,
        moe_intermediate_size=16,
    )


def _random_hf(hidden: int, n: int, seed: int) -> nn.Module:
    module = hf.DeepseekV4HyperConnection(_config(hidden, n))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.fn.copy_(0.1 * torch.randn(module.fn.shape, generator=g))
        module.base.copy_(torch.randn(module.base.shape, generator=g))
        module.scale.copy_(0.5 + 1.5 * torch.rand(3, generator=g))  # in [0.5, 2]
    return module


def _dsv4_forward(x, fn, base, scale, iters=ITERS, hc_eps=HC_EPS, rms_eps=RMS_EPS):
    """DeepseekV4HyperConnection.forward transcribed without its float32 casts.

    x: [B, S, n, C]. Returns pre, post [B, S, n], comb [B, S, n, n], collapsed [B, S, C]
    (the module itself returns the last three).
    """
    n = x.shape[-2]
    flat = x.reshape(*x.shape[:2], -1)  # [B, S, n*C]
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
    mixes = torch.nn.functional.linear(flat, fn)  # [B, S, (2+n)*n]
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n), -1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=2)
    return pre, post, comb, collapsed


def _dsv4_layer(x, post, comb, collapsed, block):
    """The update of DeepseekV4DecoderLayer.forward: post * block_out + comb^T @ x."""
    return post.unsqueeze(-1) * block(collapsed).unsqueeze(-2) + comb.transpose(-1, -2) @ x


def _mhc_to_dsv4_layout(phi, alpha, b_pre, b_post, b_res):
    """The parameter mapping written entry by entry (used for parameters and gradients)."""
    n = b_pre.numel()
    fn = torch.empty(phi.shape[1], phi.shape[0], dtype=phi.dtype)
    base = torch.empty((2 + n) * n, dtype=phi.dtype)
    for c in range(2 * n):
        fn[c] = phi[:, c]
    base[:n], base[n : 2 * n] = b_pre, b_post
    for i in range(n):
        for j in range(n):
            fn[2 * n + j * n + i] = phi[:, 2 * n + i * n + j]  # comb[j, i] = H_res[i, j]
            base[2 * n + j * n + i] = b_res[i, j]
    return fn, base, alpha.clone()


def _random_block(dim: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(dim, dim).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(dim, dim, generator=g) / dim**0.5)
        lin.bias.copy_(0.1 * torch.randn(dim, generator=g))
    return lin, (lambda h: torch.tanh(lin(h)))


def _streams(n: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # streams of different magnitudes so that the RMS over n*C is not trivial
    x = torch.randn(B, S, n, dim, generator=g) * (0.5 + torch.arange(n).view(n, 1))
    return x.to(dtype)


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    return ((a - b).abs().max() / b.abs().max()).item()


def _assert_close(got: torch.Tensor, ref: torch.Tensor, name: str = "") -> None:
    err = _max_rel(got, ref)
    assert err <= REL[ref.dtype], f"{name}: max|diff| / max|ref| = {err:.2e} > {REL[ref.dtype]}"


def test_transcription_matches_the_real_module():
    module = _random_hf(32, 4, seed=0)
    x = _streams(4, 32, torch.float32, seed=1)
    _, *got_all = _dsv4_forward(x, module.fn, module.base, module.scale)
    for got, want in zip(got_all, module(x), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "dtype,n,dim",
    [(torch.float32, 4, 32), (torch.float64, 4, 32), (torch.float32, 3, 8), (torch.float64, 3, 8)],
)
def test_maps_layer_and_gradients_match(dtype, n, dim):
    module = _random_hf(dim, n, seed=10 + n)
    lin, block = _random_block(dim, dtype, seed=20 + n)
    x = _streams(n, dim, dtype, seed=30 + n).requires_grad_(True)

    if dtype == torch.float32:  # the real module
        dsv4_params = [module.fn, module.base, module.scale]
        post, comb, collapsed = module(x)
        pre = _dsv4_forward(x, *dsv4_params)[0]  # the module does not return it
        mhc = from_deepseek_v4(module, block)
    else:  # its float64 transcription; the mHC is built from the state dict
        dsv4_params = [p.detach().to(dtype).requires_grad_(True) for p in
                       (module.fn, module.base, module.scale)]
        pre, post, comb, collapsed = _dsv4_forward(x, *dsv4_params)
        state = dict(zip(("fn", "base", "scale"), (p.detach() for p in dsv4_params), strict=True))
        mhc = from_deepseek_v4(state, block, sinkhorn_iters=ITERS, hc_eps=HC_EPS,
                               rms_norm_eps=RMS_EPS)
    assert mhc.phi.dtype == dtype
    # What is tested here is the parameter mapping, on the reference ops (whose fp32 sums
    # these tolerances were measured with); the fused implementations are compared with the
    # reference in tests/test_ops_*.py.
    mhc.impl = "reference"
    want = _dsv4_layer(x, post, comb, collapsed, block)

    h_pre, h_post, h_res = mhc.maps(x)
    seen = []
    mhc.branch = lambda h: (seen.append(h), block(h))[1]
    out = mhc(x)
    _assert_close(h_pre, pre, "H_pre")
    _assert_close(h_post, post, "H_post")
    _assert_close(h_res, comb.transpose(-1, -2), "H_res")
    _assert_close(seen[0], collapsed, "collapsed")
    _assert_close(out, want, "out")

    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=dtype)
    mhc_params = [mhc.phi, mhc.alpha, mhc.b_pre, mhc.b_post, mhc.b_res]
    grads_mhc = torch.autograd.grad(out, [x, lin.weight, *mhc_params], g)
    grads_dsv4 = torch.autograd.grad(want, [x, lin.weight, *dsv4_params], g)
    mapped = _mhc_to_dsv4_layout(*grads_mhc[2:])
    for name, got, ref in zip(("x", "block.weight", "fn", "base", "scale"),
                              [*grads_mhc[:2], *mapped], grads_dsv4, strict=True):
        _assert_close(got, ref, f"d{name}")

    diffs = {
        "H_pre": _max_rel(h_pre, pre),
        "H_post": _max_rel(h_post, post),
        "H_res": _max_rel(h_res, comb.transpose(-1, -2)),
        "collapsed": _max_rel(seen[0], collapsed),
        "out": _max_rel(out, want),
        **{f"d{k}": _max_rel(a, b) for k, a, b in
           zip(("x", "fn", "base", "scale"), [grads_mhc[0], *mapped], [grads_dsv4[0],
               *grads_dsv4[2:]], strict=True)},
    }
    print(f"{dtype} n={n} C={dim} max |diff| / max |ref|:",
          {k: f"{v:.1e}" for k, v in diffs.items()})


def test_state_dict_round_trip_both_ways():
    module = _random_hf(32, 4, seed=3)
    mhc = from_deepseek_v4(module, nn.Identity())
    back = to_deepseek_v4_state_dict(mhc)
    for k, v in module.state_dict().items():
        assert torch.equal(back[k], v), k

    # and from an mHC with random parameters: export, load into the real module, same maps
    mhc = ManifoldHyperConnection(32, 4, 1, nn.Identity(), sinkhorn_iters=ITERS,
                                  norm_eps=RMS_EPS, pre_eps=HC_EPS, sinkhorn_eps=HC_EPS)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in mhc.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() == 2 else 1.0))
    target = hf.DeepseekV4HyperConnection(_config(32, 4))
    target.load_state_dict(to_deepseek_v4_state_dict(mhc))
    x = _streams(4, 32, torch.float32, seed=6)
    post, comb, _ = target(x)
    _, h_post, h_res = mhc.maps(x)
    _assert_close(h_post, post, "H_post")
    _assert_close(h_res, comb.transpose(-1, -2), "H_res")
    fresh = ManifoldHyperConnection(32, 4, 0, nn.Identity(), sinkhorn_iters=ITERS)
    load_deepseek_v4_state_dict(fresh, to_deepseek_v4_state_dict(mhc), HC_EPS, RMS_EPS)
    for (k, a), b in zip(mhc.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), k


def test_from_state_dict_with_prefix_infers_shapes():
    module = _random_hf(8, 3, seed=7)
    prefix = "model.layers.0.ffn_hc."
    state = {prefix + k: v.detach() for k, v in module.state_dict().items()}
    state["model.embed_tokens.weight"] = torch.zeros(2, 8)
    mhc = from_deepseek_v4(state, nn.Identity(), sinkhorn_iters=ITERS, hc_eps=HC_EPS,
                           rms_norm_eps=RMS_EPS, prefix=prefix)
    assert (mhc.streams, mhc.dim, mhc.sinkhorn_iters) == (3, 8, ITERS)
    assert (mhc.norm_eps, mhc.pre_eps, mhc.sinkhorn_eps) == (RMS_EPS, HC_EPS, HC_EPS)
    x = _streams(3, 8, torch.float32, seed=8)
    post, comb, _ = module(x)
    _, h_post, h_res = mhc.maps(x)
    _assert_close(h_post, post, "H_post")
    _assert_close(h_res, comb.transpose(-1, -2), "H_res")
    assert set(to_deepseek_v4_state_dict(mhc, prefix=prefix)) == {
        prefix + "fn", prefix + "base", prefix + "scale"
    }


def test_errors_name_what_was_expected():
    state = {k: v.detach() for k, v in _random_hf(32, 4, seed=9).state_dict().items()}
    mhc = ManifoldHyperConnection(16, 4, 0, nn.Identity())
    with pytest.raises(ValueError, match=r"'fn'.*expected shape \(24, 64\).*got \(24, 128\)"):
        load_deepseek_v4_state_dict(mhc, state, HC_EPS, RMS_EPS)
    bad = dict(state, scale=torch.ones(2))
    with pytest.raises(ValueError, match=r"'scale'.*expected shape \(3,\).*got \(2,\)"):
        load_deepseek_v4_state_dict(ManifoldHyperConnection(32, 4, 0, nn.Identity()), bad,
                                    HC_EPS, RMS_EPS)
    with pytest.raises(ValueError, match=r"'base'.*\(2 \+ n\) \* n.*got \(23,\)"):
        from_deepseek_v4(dict(state, base=torch.zeros(23)), nn.Identity(), sinkhorn_iters=20,
                         hc_eps=HC_EPS, rms_norm_eps=RMS_EPS)
    with pytest.raises(KeyError, match=r"missing \['scale'\]"):
        from_deepseek_v4({"fn": state["fn"], "base": state["base"]}, nn.Identity())
    with pytest.raises(ValueError, match=r"needs \['sinkhorn_iters', 'hc_eps'"):
        from_deepseek_v4(state, nn.Identity(), rms_norm_eps=RMS_EPS)
    with pytest.raises(ValueError, match=r"hc_mult=3 disagrees with the module's 4"):
        from_deepseek_v4(_random_hf(32, 4, seed=9), nn.Identity(), hc_mult=3)


# ------------------------------------------------------------------------------------------
# The HyperHead (final stream collapse) <-> StreamHead


def _random_head(hidden: int, n: int, seed: int) -> nn.Module:
    module = hf.DeepseekV4HyperHead(_config(hidden, n))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.hc_fn.copy_(0.1 * torch.randn(module.hc_fn.shape, generator=g))
        module.hc_base.copy_(torch.randn(module.hc_base.shape, generator=g))
        module.hc_scale.fill_(1.7)
    return module


def _head_float64(x, hc_fn, hc_base, hc_scale, hc_eps=HC_EPS, rms_eps=RMS_EPS):
    """DeepseekV4HyperHead.forward transcribed without its float32 casts."""
    flat = x.flatten(-2)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
    pre = torch.sigmoid(torch.nn.functional.linear(flat, hc_fn) * hc_scale + hc_base) + hc_eps
    return (pre.unsqueeze(-1) * x).sum(dim=-2)


@pytest.mark.parametrize("n,dim", [(4, 32), (3, 8)])
def test_stream_head_matches_the_hyperhead(n, dim):
    module = _random_head(dim, n, seed=40 + n)
    x = _streams(n, dim, torch.float32, seed=41).requires_grad_(True)
    head = from_deepseek_v4_head(module)
    assert (head.streams, head.dim, head.eps, head.norm_eps) == (n, dim, HC_EPS, RMS_EPS)
    want, got = module(x), head(x)
    _assert_close(got, want, "head fp32")
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    gx, g_fn = torch.autograd.grad(want, [x, module.hc_fn], g)
    hx, h_phi = torch.autograd.grad(got, [x, head.phi], g)
    _assert_close(hx, gx, "dx")
    _assert_close(h_phi.T, g_fn, "dhc_fn")

    # float64: the transcription against a StreamHead built from the state dict
    state = {k: v.detach().double() for k, v in module.state_dict().items()}
    head64 = from_deepseek_v4_head(state, hc_eps=HC_EPS, rms_norm_eps=RMS_EPS)
    x64 = x.detach().double()
    want64 = _head_float64(x64, state["hc_fn"], state["hc_base"], state["hc_scale"])
    _assert_close(head64(x64), want64, "head float64")


def test_stream_head_round_trip_and_initial_mean():
    module = _random_head(16, 4, seed=5)
    back = to_deepseek_v4_head_state_dict(from_deepseek_v4_head(module), prefix="model.hc_head.")
    for k, v in module.state_dict().items():
        assert torch.equal(back["model.hc_head." + k], v), k

    head = StreamHead(16, 4, norm_eps=RMS_EPS, eps=HC_EPS)
    x = _streams(4, 16, torch.float32, seed=7)
    # initialised: the mean of the streams (w = 1/4 + hc_eps each)
    torch.testing.assert_close(head(x), reduce_streams(x) * (1 + 4 * HC_EPS), rtol=1e-6,
                               atol=1e-6)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    target = hf.DeepseekV4HyperHead(_config(16, 4))
    target.load_state_dict(to_deepseek_v4_head_state_dict(head))
    _assert_close(target(x), head(x), "exported head")
    fresh = load_deepseek_v4_head_state_dict(StreamHead(16, 4), target.state_dict())
    for (k, a), b in zip(head.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), k


def test_stream_head_errors():
    with pytest.raises(ValueError, match=r"\[\.\.\., 4, 8\] \(n=4, C=8\), got \(2, 3, 8\)"):
        StreamHead(8, 4)(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="streams >= 1, got 0"):
        StreamHead(8, 0)
    state = {k: v.detach() for k, v in _random_head(32, 4, seed=1).state_dict().items()}
    with pytest.raises(ValueError, match=r"'hc_fn'.*expected shape \(4, 64\).*got \(4, 128\)"):
        load_deepseek_v4_head_state_dict(StreamHead(16, 4), state)
    with pytest.raises(KeyError, match=r"missing \['hc_scale'\]"):
        from_deepseek_v4_head({"hc_fn": state["hc_fn"], "hc_base": state["hc_base"]})
    with pytest.raises(ValueError, match="needs hc_eps and rms_norm_eps"):
        from_deepseek_v4_head(state, hc_eps=HC_EPS)
    with pytest.raises(TypeError, match="expected a DeepseekV4HyperHead"):
        from_deepseek_v4_head(nn.Linear(2, 2))


def test_norm_epsilon_reads_either_transformers_name():
    """DeepSeek-V4's unweighted input_norm holds its epsilon as `eps` (transformers up to
    5.24) or `variance_epsilon` (5.25); anything else is refused by name."""
    from torch_mhc.integrations.deepseek_v4 import norm_epsilon

    old, new, neither = nn.Module(), nn.Module(), nn.Identity()
    old.eps, new.variance_epsilon = 1e-6, 2e-6
    assert (norm_epsilon(old), norm_epsilon(new)) == (1e-6, 2e-6)
    with pytest.raises(TypeError, match="`eps` or `variance_epsilon`, got Identity"):
        norm_epsilon(neither)
