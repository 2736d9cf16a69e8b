"""Amax gain and connection health: definitions on hand-made cases, per layer and composite,
collection from a forward pass."""

import math

import pytest
import torch
from torch import nn

from torch_mhc import collect_gains, diagnostics, expand_streams, make_connection
from torch_mhc.runtime.diagnostics import (
    amax_gain,
    collect_health,
    composite_gains,
    exp_underflow_share,
    logit_range,
    map_health,
    stream_cosine,
)


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


@pytest.mark.parametrize("name", ["collect_gains", "collect_health"])
def test_a_collector_refuses_a_max_tokens_that_is_not_a_count(name):
    """The layers passed where max_tokens goes fail at the call, not at the first forward."""
    collector = getattr(diagnostics, name)
    with pytest.raises(TypeError, match=rf"{name}\(max_tokens\) expects .* got ModuleList"):
        with collector(nn.ModuleList([nn.Identity()])):
            pass
    for bad, error in ((0, ValueError), (True, TypeError), (2.0, TypeError)):
        with pytest.raises(error, match="an int >= 1"):
            with collector(bad):
                pass
    assert diagnostics.ACTIVE is None
    with collector(2) as c:  # a count keeps that many tokens a call
        make_connection("mhc", 4, 2, 0, nn.Identity())(torch.randn(5, 2, 4))
    assert c.maps[0].shape == (2, 2, 2)


# ---------------------------------------------------------------------------------------------
# Connection health: every figure on a hand-made case with a known answer
# ---------------------------------------------------------------------------------------------


def test_map_health_identity_uniform_and_a_shrinking_column():
    n = 4
    eye, uniform = torch.eye(n, dtype=torch.float64), torch.full((n, n), 1 / n).double()
    h = map_health(torch.stack([eye, uniform]))
    assert h["colsum_min"].tolist() == [1.0, 1.0] and h["colsum_max"].tolist() == [1.0, 1.0]
    assert h["max_abs_log_colsum"].tolist() == [0.0, 0.0]
    assert h["dist_identity"].tolist() == pytest.approx([0.0, math.sqrt(n - 1)], abs=1e-15)
    assert h["dist_uniform"].tolist() == pytest.approx([math.sqrt(n - 1), 0.0], abs=1e-15)
    # rows sum to 1 (as after Sinkhorn's last step), columns to 0.5 and 1.5
    m = torch.tensor([[0.25, 0.75], [0.25, 0.75]], dtype=torch.float64)
    h = map_health(m)
    assert h["colsum_min"].item() == 0.5 and h["colsum_max"].item() == 1.5
    assert h["max_abs_log_colsum"].item() == pytest.approx(math.log(2))  # |log 0.5|
    # m - I = [[-0.75, 0.75], [0.25, -0.25]]
    assert h["dist_identity"].item() == pytest.approx(math.sqrt(2 * 0.75**2 + 2 * 0.25**2))
    assert amax_gain(m)[0].item() == 1.0  # the forward gain hides the shrinking column
    # a column summing to 0 or less: |log| is infinite
    assert map_health(torch.tensor([[1.0, 0.0], [1.0, 0.0]]))["max_abs_log_colsum"] == math.inf


def test_max_abs_colsum_error_known_answers():
    # rows sum to 1; columns 0.5 and 1.5 -> 0.5; 2 and 0 -> 1; 0.3, 0.3, 2.4 -> 1.4;
    # exact maps (identity, J/n) -> 0. Tokens reduce by the max.
    third = 1 / 3
    maps = torch.tensor([[[0.25, 0.75, 0.0], [0.25, 0.75, 0.0], [0.0, 0.0, 1.0]],
                         [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]],
                         [[0.1, 0.1, 0.8], [0.1, 0.1, 0.8], [0.1, 0.1, 0.8]],
                         [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]],
                         [[third] * 3] * 3], dtype=torch.float64)
    err = map_health(maps)["max_abs_colsum_error"]
    assert err.tolist() == pytest.approx([0.5, 1.0, 1.4, 0.0, 0.0], abs=1e-15)
    report = diagnostics.composite_health([maps[:2], maps[2:4]])
    assert report.layer_health[0]["max_abs_colsum_error"] == 1.0  # worst token
    assert report.layer_health[1]["max_abs_colsum_error"] == pytest.approx(1.4)
    # composite of layers 1..2 for token 0: [0.1 0.1 0.8]^3 rows @ maps[0] -> columns
    comp0 = maps[2] @ maps[0]
    want = max((comp0.sum(-2) - 1).abs().max().item(), 1.0)  # token 1: eye @ maps[1]
    assert report.composite_health[1]["max_abs_colsum_error"] == pytest.approx(want)
    # what a collector adds per layer (no streams measured here)
    report.stream_cosine, report.gate_pre, report.gate_post = [0.0] * 2, [0.5] * 2, [1.0] * 2
    report.logit_range, report.exp_underflow = [None] * 2, [None] * 2
    flat = report.flat()
    assert flat["max_abs_colsum_error"] == pytest.approx(1.4)  # max over the layers
    assert flat["layer1/max_abs_colsum_error"] == pytest.approx(1.4)
    assert flat["composite1/max_abs_colsum_error"] == pytest.approx(want)


def test_max_abs_colsum_error_of_an_mhc_layer_is_sinkhorns():
    # The figure equals the column error of the Sinkhorn map the layer computed: near 0 for
    # mild logits, large for logits spread over hundreds (functional.sinkhorn's docstring).
    torch.manual_seed(0)
    conn = make_connection("mhc", 8, 4, 0, nn.Identity())
    x = torch.randn(64, 4, 8)
    errs = []
    for scale in (0.0, 100.0):
        with torch.no_grad():
            conn.alpha.fill_(scale)
            conn.phi.normal_(std=1.0)
        with collect_health() as health:
            conn(x)
        h_res = conn.maps(x)[2].double()
        want = (h_res.sum(-2) - 1).abs().max().item()
        got = health.report().layer_health[0]["max_abs_colsum_error"]
        assert got == pytest.approx(want, abs=1e-12)
        errs.append(got)
    assert errs[0] < 1e-6 and errs[1] > 0.1


def test_flat_health_of_a_history_without_the_colsum_error():
    # training histories written before max_abs_colsum_error existed still flatten
    x = expand_streams(torch.randn(3, 8), 4)
    with collect_health() as health:
        for conn in _stack("mhc", layers=2):
            x = conn(x)
    d = health.report().to_dict()
    for entry in d["layer_health"] + d["composite_health"]:
        del entry["max_abs_colsum_error"]
    flat = diagnostics.flat_health(d)
    assert "max_abs_colsum_error" not in flat and "layer0/max_abs_colsum_error" not in flat
    assert flat["layer1/colsum_min"] == pytest.approx(1.0, abs=1e-6)


def test_stream_cosine_known_cases():
    h = torch.randn(5, 8, dtype=torch.float64)
    assert stream_cosine(expand_streams(h, 4)).tolist() == pytest.approx([1.0] * 5)
    assert stream_cosine(torch.stack([h, -h], -2)).tolist() == pytest.approx([-1.0] * 5)
    e = torch.eye(3, dtype=torch.float64)  # three orthogonal streams
    assert stream_cosine(e).item() == pytest.approx(0.0, abs=1e-15)
    # pairs (0,1): 1, (0,2) and (1,2): 0  ->  mean 1/3
    x = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 5.0]])
    assert stream_cosine(x).item() == pytest.approx(1 / 3)


def test_logit_range_and_fp32_exp_underflow():
    z = torch.tensor([[[0.0, 3.0], [-2.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]]])
    assert logit_range(z).tolist() == [5.0, 0.0]
    # exp(-103) is a float32 subnormal (not 0); exp(-105) and exp(-200) are 0
    z = torch.tensor([[0.0, -103.0, -105.0, -200.0]])
    assert exp_underflow_share(z) == 0.5
    assert exp_underflow_share(z + 1000.0) == 0.5  # measured relative to the token's max
    assert exp_underflow_share(torch.tensor([[0.0, -1.0]])) == 0.0


def _stack(kind, layers=4, c=8, n=4):
    torch.manual_seed(0)
    return [make_connection(kind, c, n, i, nn.Linear(c, c)) for i in range(layers)]


@pytest.mark.parametrize("kind,logit_span", [("mhc", math.log(5)), ("mhc-lite", math.log(25)),
                                             ("kromhc", None), ("mhc-static-res", None),
                                             ("hc", None)])
def test_health_of_initialised_connections(kind, logit_span):
    # At init every kind keeps the copied streams equal, reads with H_pre summing to 1 and
    # writes with H_post = 1; the logits are the biases alone (phi = 0).
    n, layers = 4, 4
    x = expand_streams(torch.randn(2, 5, 8), n)
    with collect_health() as health:
        for conn in _stack(kind, layers):
            x = conn(x)
    r = health.report()
    assert r.stream_cosine == pytest.approx([1.0] * layers, abs=1e-6)
    assert r.gate_pre == pytest.approx([1 / n] * layers, abs=1e-6)
    assert r.gate_post == pytest.approx([1.0] * layers, abs=1e-6)
    for entry in r.composite_health + r.layer_health:
        assert entry["colsum_min"] == pytest.approx(1.0, abs=1e-6)
        assert entry["max_abs_log_colsum"] == pytest.approx(0.0, abs=1e-6)
        assert entry["max_abs_colsum_error"] == pytest.approx(0.0, abs=1e-6)
    if logit_span is None:
        assert r.logit_range == [None] * layers and r.exp_underflow == [None] * layers
    else:
        assert [s["max"] for s in r.logit_range] == pytest.approx([logit_span] * layers)
        assert r.exp_underflow == [0.0] * layers
    if kind in ("mhc", "mhc-lite"):
        # H_res = I/2 + J/(2n) composes to J/n + 2^-l (I - J/n): distance from the uniform
        # matrix sqrt(n - 1) / 2^l after l layers, from the identity sqrt(n-1) (1 - 2^-l)
        want = [math.sqrt(n - 1) / 2 ** (i + 1) for i in range(layers)]
        assert [c["dist_uniform"] for c in r.composite_health] == pytest.approx(want, abs=1e-6)
        assert r.composite_health[0]["dist_identity"] == pytest.approx(math.sqrt(n - 1) / 2,
                                                                       abs=1e-6)
    if kind in ("hc", "mhc-static-res"):
        assert all(c["dist_identity"] == 0.0 for c in r.composite_health)


def test_underflow_measured_on_mhc_logits():
    # alpha_res large and phi spread: logits of range ~ hundreds, some exp() underflow
    conn = make_connection("mhc", 8, 4, 0, nn.Identity())
    with torch.no_grad():
        conn.alpha.fill_(100.0)
        conn.phi.normal_(std=1.0)
    x = torch.randn(64, 4, 8)
    with collect_health() as health:
        conn(x)
    r = health.report()
    z = diagnostics._res_logits(conn, x).reshape(64, -1)
    want = (torch.exp(z - z.amax(-1, keepdim=True)) == 0).float().mean().item()
    assert r.exp_underflow[0] == pytest.approx(want) and want > 0.1
    assert r.logit_range[0]["max"] == pytest.approx((z.amax(-1) - z.amin(-1)).max().item())


def test_health_flat_dict_and_gain_report_compatible():
    x = expand_streams(torch.randn(3, 8), 4)
    conns = _stack("mhc-lite", layers=3)
    with torch.no_grad():
        for conn in conns:
            conn.phi.normal_(std=0.5)
            conn.alpha.fill_(1.0)
    with collect_health(max_tokens=2) as health:
        for conn in conns:
            x = conn(x)
    r = health.report()
    flat = r.flat()
    assert all(isinstance(v, float) for v in flat.values())
    assert flat["composite2/dist_identity"] == r.composite_health[2]["dist_identity"]
    assert flat["layer1/stream_cosine"] == r.stream_cosine[1] < 1.0
    assert flat["min_composite_colsum"] == min(c["colsum_min"] for c in r.composite_health)
    assert flat["max_composite_fwd"] == r.max_composite_fwd
    # exactly doubly stochastic maps: every column sum is 1 at every depth
    assert flat["max_abs_log_colsum"] == pytest.approx(0.0, abs=1e-6)
    assert r.layers == ["mhc-lite[0]", "mhc-lite[1]", "mhc-lite[2]"]
    d = r.to_dict()
    assert d["composite_fwd"] == r.composite_fwd and len(d["layer_health"]) == 3
    assert diagnostics.ACTIVE is None


def test_training_logs_health_every_gain_every_steps(tiny_config, tmp_path):
    import json

    from torch_mhc.lm.train import METRICS_FILE, train

    out = tmp_path / "run"
    result = train(tiny_config("mhc-lite", steps=4, gain_every=2, out_dir=str(out)))
    records = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    gains = [r for r in records if r["kind"] == "gain"]
    assert [r["step"] for r in gains] == [0, 2, 4]
    layers = 4  # 2 blocks x (attention, MLP)
    for r in gains:
        for i in range(layers):
            for name in ("colsum_min", "dist_identity", "stream_cosine", "gate_pre"):
                assert isinstance(r[f"layer{i}/{name}"], float), (r["step"], i, name)
        assert r["max_abs_log_colsum"] == pytest.approx(0.0, abs=1e-6)  # exact columns
    assert gains[0]["last_stream_cosine"] == pytest.approx(1.0, abs=1e-6)  # equal at init
    assert result.gain_history[-1]["composite_health"][-1]["dist_identity"] == pytest.approx(
        gains[-1][f"composite{layers - 1}/dist_identity"])


@pytest.mark.parametrize("replay", ["checkpoint", "recompute_streams"])
def test_a_backward_replay_records_nothing(replay):
    """Recomputation replays the connections inside backward (torch.utils.checkpoint, our
    recompute_streams); with the backward inside the collector, each connection is still
    recorded once, in forward order, and the composite gain is the forward pass's."""
    from torch.utils.checkpoint import checkpoint

    from torch_mhc.runtime.recompute import recompute_streams

    torch.manual_seed(0)
    conns = nn.ModuleList(make_connection("mhc", 8, 4, i, nn.Linear(8, 8)) for i in range(3))
    with torch.no_grad():
        for c in conns:
            c.phi.normal_(0.0, 0.5)

    def run(use_replay: bool):
        x = expand_streams(torch.randn(2, 8, generator=torch.Generator().manual_seed(1),
                                       requires_grad=True), 4)
        with collect_gains() as gains:
            if use_replay and replay == "recompute_streams":
                with recompute_streams(2):
                    for c in conns:
                        x = c(x)
            else:
                for c in conns:
                    x = checkpoint(c, x, use_reentrant=False) if use_replay else c(x)
            x.sum().backward()
        return gains

    plain, replayed = run(False), run(True)
    assert replayed.names == plain.names == ["mhc[0]", "mhc[1]", "mhc[2]"]
    assert replayed.report().max_composite_fwd == plain.report().max_composite_fwd
