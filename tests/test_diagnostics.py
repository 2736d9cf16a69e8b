"""Amax gain: definition, per layer and composite, collection from a model's forward pass."""

import pytest
import torch
from torch import nn

from torch_mhc import collect_gains, diagnostics, expand_streams, make_connection
from torch_mhc.diagnostics import amax_gain, composite_gains


def test_amax_gain_definition():
    m = torch.tensor([[1.0, -3.0], [2.0, 0.5]])
    fwd, bwd = amax_gain(m)
    assert fwd.item() == 2.5  # row sums -2, 2.5
    assert bwd.item() == 3.0  # column sums 3, -2.5


def test_composite_is_the_product_in_layer_order():
    g = torch.Generator().manual_seed(0)
    maps = [torch.randn(5, 3, 3, generator=g, dtype=torch.float64) for _ in range(4)]
    report = composite_gains(maps)
    for depth in range(4):
        prod = torch.eye(3, dtype=torch.float64).expand(5, 3, 3)
        for m in maps[: depth + 1]:
            prod = m @ prod  # H_L ... H_1
        fwd = prod.sum(-1).abs().amax(-1)
        bwd = prod.sum(-2).abs().amax(-1)
        assert report.composite_fwd[depth]["mean"] == pytest.approx(fwd.mean().item())
        assert report.composite_fwd[depth]["max"] == pytest.approx(fwd.max().item())
        assert report.composite_bwd[depth]["max"] == pytest.approx(bwd.max().item())
    assert report.max_composite_fwd == max(c["max"] for c in report.composite_fwd)


def test_doubly_stochastic_composite_gain_is_one():
    # A product of exactly doubly stochastic matrices has gain 1 both ways.
    perms = [torch.eye(4)[torch.randperm(4)] for _ in range(6)]
    report = composite_gains([(p + torch.eye(4)) / 2 for p in perms])
    assert report.max_composite_fwd == pytest.approx(1.0)
    assert report.max_composite_bwd == pytest.approx(1.0)


def test_collect_from_a_stack_of_connections():
    torch.manual_seed(0)
    c, n, layers = 8, 4, 6
    conns = [make_connection("mhc", c, n, i, nn.Linear(c, c)) for i in range(layers)]
    for conn in conns:
        with torch.no_grad():
            conn.phi.normal_(std=1.0)
            conn.alpha.fill_(1.0)
    x = expand_streams(torch.randn(2, 5, c), n)
    maps = []
    with collect_gains() as gains:
        for conn in conns:
            maps.append(conn.maps(x)[2])  # what this layer's forward will compute
            x = conn(x)
    report = gains.report()
    assert report.layers == [f"mhc[{i}]" for i in range(layers)]
    want = composite_gains([m.reshape(-1, n, n) for m in maps])
    assert report.composite_fwd == want.composite_fwd  # same maps, same arithmetic
    assert report.layer_bwd == want.layer_bwd
    # Sinkhorn maps: forward gain 1 (rows exact); backward gain above 1 by the column error.
    assert report.max_composite_fwd == pytest.approx(1.0, abs=1e-5)
    assert report.max_composite_bwd >= 1.0
    assert diagnostics.ACTIVE is None  # switched off again


def test_hc_gains_grow_with_unconstrained_maps():
    torch.manual_seed(1)
    c, n = 8, 4
    conns = [make_connection("hc", c, n, i, nn.Linear(c, c)) for i in range(8)]
    for conn in conns:
        with torch.no_grad():
            conn.static_res.add_(0.3)  # rows sum to 2.2: unconstrained amplification
    x = expand_streams(torch.randn(3, c), n)
    with collect_gains() as gains:
        for conn in conns:
            x = conn(x)
    report = gains.report()
    assert report.layer_fwd[0]["max"] == pytest.approx(2.2)
    assert report.max_composite_fwd == pytest.approx(2.2 ** 8, rel=1e-6)


def test_nothing_recorded_outside_the_context_and_errors():
    conn = make_connection("mhc", 4, 2, 0, nn.Identity())
    conn(torch.randn(3, 2, 4))
    assert diagnostics.ACTIVE is None
    with collect_gains() as gains:
        make_connection("residual", 4, 1, 0, nn.Identity())(torch.randn(3, 1, 4))
        with pytest.raises(RuntimeError, match="already active"):
            with collect_gains():
                pass
    with pytest.raises(RuntimeError, match="no connection recorded its maps"):
        gains.report()
