"""Tests of torch_mhc.lm.model: the reference LM under all three connection kinds.

Tiny sizes throughout (dim 32, 2 blocks, T <= 32) so each test takes seconds on a CPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from torch_mhc.lm.model import LM, KVCache, ModelConfig

KINDS = ("residual", "hc", "mhc")


def tiny_config(connection: str = "mhc", **overrides) -> ModelConfig:
    kw = dict(dim=32, n_layers=2, n_heads=4, max_seq_len=32, connection=connection, streams=4)
    kw.update(overrides)
    return ModelConfig(**kw)


def tiny_model(connection: str = "mhc", seed: int = 0, **overrides) -> LM:
    torch.manual_seed(seed)
    return LM(tiny_config(connection, **overrides)).eval()


def perturb_connections(model: LM, seed: int = 1) -> None:
    """Move every connection parameter off its init, so the streams genuinely differ.

    At init HC/mHC compute the residual function, where caching mistakes in stream handling
    could hide; after this the maps depend on the token and the streams separate.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for conn in model.connections():
            for p in conn.parameters(recurse=False):
                p.add_(0.3 * torch.randn(p.shape, generator=g))


def prepared_model(kind: str) -> LM:
    model = tiny_model(kind)
    perturb_connections(model)
    return model


# --- KV cache ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_cached_forward_matches_full_forward(kind):
    model = prepared_model(kind)
    idx = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, _ = model(idx)  # [2, 24, V]
        cache = model.new_kv_cache(batch_size=2)
        # A prefill of 7, a chunk of 5 (the offset causal mask), then single-token steps.
        pieces = [model(idx[:, :7], kv_cache=cache)[0]]
        pieces.append(model(idx[:, 7:12], kv_cache=cache, start_pos=7)[0])
        for t in range(12, 24):
            assert cache.pos == t
            pieces.append(model(idx[:, t : t + 1], kv_cache=cache, start_pos=cache.pos)[0])
    cached = torch.cat(pieces, dim=1)
    assert cache.pos == 24
    err = (cached - full).abs().max().item()
    assert err <= 1e-5, f"{kind}: cached vs full logits differ by {err:.3g}"
    # The streams really differ after perturbation (otherwise the test would be weaker).
    if kind != "residual":
        ref = tiny_model("residual")
        assert (ref(idx)[0] - full).abs().max().item() > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_generate_with_cache_equals_without(kind):
    model = prepared_model(kind)
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    n_new = 20
    greedy_cached = model.generate(prompt, n_new, temperature=0.0, use_cache=True)
    greedy_plain = model.generate(prompt, n_new, temperature=0.0, use_cache=False)
    assert greedy_cached.shape == (2, 5 + n_new)
    assert torch.equal(greedy_cached[:, :5], prompt)
    assert torch.equal(greedy_cached, greedy_plain)

    sampled = []
    for use_cache in (True, False):
        gen = torch.Generator().manual_seed(4)
        sampled.append(
            model.generate(prompt, n_new, temperature=1.0, top_k=50, use_cache=use_cache,
                           generator=gen)
        )
    assert torch.equal(sampled[0], sampled[1])
    # Sampling at temperature 1 from a near-uniform model is not the greedy path.
    assert not torch.equal(sampled[0], greedy_cached)


def test_generate_greedy_matches_plain_argmax_loop():
    """generate(temperature=0) against a hand-written argmax loop over the full forward."""
    model = prepared_model("mhc")
    idx = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(5))
    expected = idx
    with torch.no_grad():
        for _ in range(6):
            logits, _ = model(expected)
            expected = torch.cat((expected, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(model.generate(idx, 6, temperature=0.0), expected)


def test_generate_without_cache_crops_the_context():
    model = prepared_model("mhc")
    prompt = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(6))
    out = model.generate(prompt, 5, temperature=0.0, use_cache=False)  # 35 > max_seq_len 32
    with torch.no_grad():
        last, _ = model(out[:, -33:-1])  # the cropped context that chose the last token
    assert out[0, -1].item() == last[0, -1].argmax().item()
    with pytest.raises(ValueError, match="T0 \\+ max_new_tokens - 1 = 30 \\+ 5 - 1 = 34 > 32"):
        model.generate(prompt, 5, temperature=0.0, use_cache=True)
    # Exactly filling the cache is allowed: 30 + 3 - 1 = 32.
    assert torch.equal(
        model.generate(prompt, 3, temperature=0.0, use_cache=True),
        model.generate(prompt, 3, temperature=0.0, use_cache=False),
    )


# --- function preservation at init -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["hc", "mhc"])
def test_hc_and_mhc_start_as_the_residual_network(kind):
    residual = tiny_model("residual", seed=7)
    model = tiny_model(kind, seed=7)
    # Copy the block weights: every non-connection parameter; connections keep their init.
    missing, unexpected = model.load_state_dict(residual.state_dict(), strict=False)
    assert unexpected == []
    conn_names = {
        f"blocks.{b}.{which}.{name}"
        for b in range(2)
        for which in ("attn", "mlp")
        for name, _ in getattr(model.blocks[b], which).named_parameters(recurse=False)
    }
    assert set(missing) == conn_names
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref, _ = residual(idx)
        out, _ = model(idx)
    err = (out - ref).abs().max().item()
    print(f"{kind} vs residual at init: max abs logit diff {err:.3g}")
    assert err <= 1e-5, f"{kind} at init differs from the residual network by {err:.3g}"


# --- training ---------------------------------------------------------------------------------


def test_mhc_model_learns_a_repeated_sequence():
    torch.manual_seed(0)
    model = LM(tiny_config("mhc"))
    data = torch.tensor(list(b"the quick brown fox jumps! " * 6))  # 162 bytes, period 27
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(60):
        starts = torch.randint(0, len(data) - 33, (4,), generator=g)
        x = torch.stack([data[s : s + 32] for s in starts])  # [4, 32]
        y = torch.stack([data[s + 1 : s + 33] for s in starts])  # [4, 32]
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} nats")
    assert abs(losses[0] - math.log(256)) < 0.7  # starts near a uniform guess over bytes
    assert losses[-1] < 1.0


def test_loss_is_mean_cross_entropy_in_nats():
    model = prepared_model("hc")
    idx = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(9))
    targets = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(10))
    targets[0, 3] = -1  # ignored position
    with torch.no_grad():
        logits, loss = model(idx, targets)
    logp = torch.log_softmax(logits.double(), dim=-1)
    keep = targets >= 0
    expected = -logp[keep].gather(-1, targets[keep].unsqueeze(-1)).mean()
    assert abs(loss.item() - expected.item()) < 1e-5
    assert model(idx)[1] is None


# --- parameter budgets ------------------------------------------------------------------------


def test_parameter_counts():
    C, L, V, n, H = 32, 2, 256, 4, 128
    block = 2 * C + 3 * C * C + C * C + C * H + H * C  # two norms, qkv, out, fc, out
    base = V * C + L * block + C  # tied head, final norm
    res = tiny_model("residual")
    assert res.num_params() == base
    assert res.num_params(exclude_embeddings=True) == base - V * C
    assert res.connection_params() == 0
    mhc = tiny_model("mhc")
    per_mhc = n * C * (n * n + 2 * n) + 3 + n + n + n * n  # phi, alpha, b_pre, b_post, b_res
    assert mhc.connection_params() == 2 * L * per_mhc
    assert mhc.num_params() == base + 2 * L * per_mhc
    hc = tiny_model("hc")
    per_hc = n + n + n * n + C * (2 + n) + 2  # static maps, w, s_alpha, s_beta
    assert hc.connection_params() == 2 * L * per_hc
    untied = tiny_model("residual", tie_embeddings=False)
    assert untied.num_params() == base + V * C
    assert untied.num_params(exclude_embeddings=True) == base


def test_gpt2_init_scales_residual_projections():
    model = LM(tiny_config("mhc", dim=64, n_layers=2, max_seq_len=8, init_std=0.05))
    out_std = model.blocks[0].attn.branch.attn.out_proj.weight.std().item()
    qkv_std = model.blocks[0].attn.branch.attn.qkv.weight.std().item()
    assert abs(qkv_std - 0.05) < 0.005
    assert abs(out_std - 0.05 / 2.0) < 0.005  # 1 / sqrt(2 * n_layers) = 1/2
    # The connections' own init is untouched: mHC's phi starts at zero.
    assert torch.count_nonzero(model.blocks[1].mlp.phi) == 0


# --- config and input errors ------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"dim": 30, "n_heads": 4}, "divisible by n_heads"),
        ({"dim": 12, "n_heads": 4}, "even head_dim"),
        ({"n_layers": 0}, "n_layers must be an integer >= 1"),
        ({"vocab_size": -3}, "vocab_size must be an integer >= 1"),
        ({"connection": "dense"}, "connection must be one of"),
        ({"streams": 0}, "streams must be an integer >= 1"),
        ({"sinkhorn_iters": 0}, "sinkhorn_iters must be an integer >= 1"),
        ({"init_std": 0.0}, "init_std must be a number > 0"),
    ],
)
def test_bad_config_raises(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**overrides)


def test_config_round_trip_and_unknown_keys():
    cfg = tiny_config("hc", sinkhorn_iters=7)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    d = cfg.to_dict() | {"dropout": 0.1}
    with pytest.raises(ValueError, match="unknown keys \\['dropout'\\]"):
        ModelConfig.from_dict(d)


def test_bad_inputs_raise():
    model = tiny_model("mhc")
    with pytest.raises(ValueError, match="exceeds max_seq_len = 32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    cache = model.new_kv_cache(batch_size=1)
    model(torch.zeros(1, 30, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="30 \\+ 3 = 33 exceeds max_seq_len"):
        model(torch.zeros(1, 3, dtype=torch.long), kv_cache=cache, start_pos=30)
    with pytest.raises(ValueError, match="would leave a gap"):
        model(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache, start_pos=31)
    with pytest.raises(ValueError, match="made for batch size 1"):
        model(torch.zeros(2, 1, dtype=torch.long), kv_cache=cache, start_pos=30)
    with pytest.raises(ValueError, match="needs a kv_cache"):
        model(torch.zeros(1, 1, dtype=torch.long), start_pos=3)
    with pytest.raises(ValueError, match="token ids must lie in \\[0, 256\\), got values in"):
        model(torch.tensor([[1, 256]]))
    with pytest.raises(ValueError, match="token ids must lie"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="LongTensor \\[B, T\\]"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer token ids"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="targets must have idx's shape"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))


def test_kv_cache_update_writes_and_returns_prefix():
    cache = KVCache(n_layers=2, batch_size=1, n_heads=2, max_len=6, head_dim=4)
    k = torch.randn(1, 2, 3, 4)
    v = torch.randn(1, 2, 3, 4)
    k_all, v_all = cache.update(1, k, v, start_pos=2)
    assert torch.equal(k_all[:, :, 2:], k) and torch.equal(v_all[:, :, 2:], v)
    assert k_all.shape[2] == 5
    assert torch.count_nonzero(cache.k[0]) == 0  # the other layer is untouched


# --- torch.compile ----------------------------------------------------------------------------


def test_forward_traces_as_one_graph():
    """fullgraph tracing with the eager backend: catches graph breaks without codegen."""
    model = prepared_model("mhc")
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(11))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        ref, _ = model(idx)
        out, _ = compiled(idx)
    assert (out - ref).abs().max().item() <= 1e-6


@pytest.mark.slow
def test_compiled_forward_matches_eager():
    """torch.compile(fullgraph=True) with the default (inductor) backend; ~1 min on 2 cores."""
    model = prepared_model("mhc")
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(12))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        ref, _ = model(idx)
        out, _ = compiled(idx)
    err = (out - ref).abs().max().item()
    print(f"compiled vs eager: max abs logit diff {err:.3g}")
    assert err <= 1e-5
