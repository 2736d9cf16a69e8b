"""Selective recomputation: the same gradients, fewer bytes saved for backward."""

import gc
import weakref

import pytest
import torch
from torch import nn

import torch_mhc as tm
from tests.helpers.branches import MLP, Attention, perturb
from torch_mhc.lm.model import LM, ModelConfig
from torch_mhc.runtime import recompute
from torch_mhc.runtime.recompute import optimal_interval, recompute_streams
from torch_mhc.tools.bench.workloads import saved_bytes


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize("kind", ["hc", "mhc"])
@pytest.mark.parametrize("interval", [1, 2, 3, 6])
def test_gradients_equal_without_recomputation(impl, kind, interval):
    torch.manual_seed(0)
    c, n = 16, 4
    blocks = [m for _ in range(3) for m in (Attention(c), MLP(c, std=0.2))]
    conns = nn.ModuleList(tm.make_connection(kind, c, n, i, b, impl=impl)
                          for i, b in enumerate(blocks)).double()
    perturb(conns, 0.05)
    h = torch.randn(2, 9, c, dtype=torch.float64, requires_grad=True)

    def run():
        x = tm.expand_streams(h, n)
        for conn in conns:
            x = conn(x)
        return x

    out = run()
    g = torch.randn_like(out)
    params = [h, *conns.parameters()]
    want = torch.autograd.grad(out, params, g)
    with recompute_streams(interval) as stats:
        out_rc = run()
    got = torch.autograd.grad(out_rc, params, g)
    torch.testing.assert_close(out_rc, out, rtol=0, atol=0)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    assert stats.replays == -(-6 // interval)  # each group replayed once in backward


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_no_replayed_tensor_outlives_the_backward(impl, monkeypatch):
    """Each step's replays are freed with its graph: a replay that kept its tensors in its own
    graph's saved slots leaked them (about two thirds of a GiB a step in a small LM)."""
    replayed = []
    replay = recompute._replay

    def recording(group, upto):
        replay(group, upto)
        replayed.extend(weakref.ref(t) for saved in group.replayed.values() for t in saved)

    monkeypatch.setattr(recompute, "_replay", recording)
    torch.manual_seed(0)
    c, n = 16, 4
    conns = nn.ModuleList(tm.make_connection("mhc", c, n, i, MLP(c), impl=impl)
                          for i in range(4))
    h = torch.randn(2, 9, c, requires_grad=True)
    for _ in range(2):
        with recompute_streams(2) as stats:
            x = tm.expand_streams(h, n)
            for conn in conns:
                x = conn(x)
        x.square().sum().backward()
        del x
    gc.collect()
    assert stats.replays == 2 and len(replayed) > 4 * 2
    assert [r for r in replayed if r() is not None] == []


def test_lm_saves_fewer_bytes_and_same_gradients():
    # Saved-for-backward bytes of the whole LM per token per connection: the blocks save the
    # same in every variant; the plain mHC connections add n-stream tensors; recomputation
    # keeps only each group's input streams and the branch outputs.
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 64))
    per_layer = {}
    grads = {}
    for name, kind, rc in [("residual", "residual", False), ("mhc", "mhc", False),
                           ("mhc+recompute", "mhc", True)]:
        torch.manual_seed(0)
        model = LM(ModelConfig(dim=64, n_layers=4, max_seq_len=64, connection=kind,
                               recompute=rc))
        nbytes, loss = saved_bytes(lambda m=model: m(tokens, tokens)[1],
                                   exclude=list(model.parameters()))
        if rc:
            nbytes += model.recompute_stats.kept
        per_layer[name] = nbytes / tokens.numel() / (2 * 4)
        loss.backward()
        grads[name] = {k: p.grad for k, p in model.named_parameters()}
    assert per_layer["mhc+recompute"] < per_layer["mhc"]
    # The target: with recomputation, mHC saves <= 1.3x the residual's bytes.
    assert per_layer["mhc+recompute"] <= 1.3 * per_layer["residual"], per_layer
    for k, g in grads["mhc"].items():
        torch.testing.assert_close(grads["mhc+recompute"][k], g, rtol=0, atol=0)


def test_optimal_interval_and_errors():
    assert optimal_interval(4, 60) == 6  # sqrt(40) = 6.32
    assert optimal_interval(1, 1) == 1
    # the half-way case: sqrt(6 * 27 / 8) = sqrt(20.25) = 4.5 exactly. Halves go up (5);
    # Python's round would give 4 (halves to even).
    assert (6 * 27 / 8) ** 0.5 == 4.5 and round(4.5) == 4
    assert optimal_interval(6, 27) == 5
    with pytest.raises(ValueError, match="layers must be >= 1, got 0"):
        optimal_interval(4, 0)
    with pytest.raises(ValueError, match="int >= 1, got 0"):
        with recompute_streams(0):
            pass
    # no interval and nothing to choose one from (it took one connection, interval 1)
    with pytest.raises(ValueError, match="needs an interval, or layers"):
        with recompute_streams():
            pass
    from torch_mhc.runtime import recompute

    with recompute_streams(streams=4, layers=6):  # L_r = floor(sqrt(24 / 6) + 1/2) = 2
        assert recompute.ACTIVE.interval == 2
    with pytest.raises(ValueError, match="recompute_interval must be an integer >= 0"):
        ModelConfig(recompute_interval=-1)
