"""Residual / HC / mHC connections: the papers' equations, init, gradients, compile, errors."""

import copy
import math
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_mhc
from tests.helpers.branches import MLP, Attention, perturb
from tests.helpers.references import hc_layer_naive, mhc_layer_naive
from torch_mhc import (
    HyperConnection,
    ManifoldHyperConnection,
    Residual,
    expand_streams,
    make_connection,
    param_groups,
    reduce_streams,
)
from torch_mhc.runtime.recompute import recompute_streams

# The core kinds and mHC's successors: every one starts as the Pre-Norm residual network.
ALL_KINDS = ["hc", "mhc", "mhc-lite", "kromhc", "mhc-static-res"]


@pytest.mark.parametrize("n", [2, 3, 4])  # n = 1 is refused (test_bad_input_errors)
def test_mhc_layer_equals_paper_equations(n):
    torch.manual_seed(n)
    c, tokens = 6, 5
    branch = nn.Sequential(nn.Linear(c, c), nn.Tanh()).double()
    conn = ManifoldHyperConnection(c, n, layer_index=1, branch=branch).double()
    perturb(conn)
    x = torch.randn(tokens, n, c, dtype=torch.float64, requires_grad=True)
    out = conn(x)
    ref = mhc_layer_naive(x, conn.phi, conn.alpha, conn.b_pre, conn.b_post, conn.b_res, branch)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(out)
    params = [x, *conn.parameters()]
    for a, b in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


@pytest.mark.parametrize("n", [1, 3, 4])
def test_hc_layer_equals_hc_paper_equations(n):
    torch.manual_seed(10 + n)
    c, tokens = 6, 5
    branch = nn.Sequential(nn.Linear(c, c), nn.Tanh()).double()
    conn = HyperConnection(c, n, layer_index=2, branch=branch).double()
    perturb(conn)
    x = torch.randn(tokens, n, c, dtype=torch.float64, requires_grad=True)
    out = conn(x)
    # The HC paper's notation: A_m = static_pre as a column, B = static_post as a row,
    # A_r = static_res transposed.
    ref = hc_layer_naive(
        x, conn.w, conn.s_alpha, conn.s_beta, conn.static_pre[:, None], conn.static_post[None],
        conn.static_res.T, branch,
    )
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(out)
    params = [x, *conn.parameters()]
    for a, b in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_static_hc_has_no_dynamic_part():
    c, n = 4, 3
    conn = HyperConnection(c, n, 0, nn.Identity(), dynamic=False)
    assert conn.w is None and not any(p.dim() == 2 and p.shape[0] == c for p in conn.parameters())
    x = torch.randn(2, n, c)
    pre, post, res = conn.maps(x)
    torch.testing.assert_close(pre, torch.tensor([1.0, 0, 0]).expand(2, n))
    torch.testing.assert_close(res, torch.eye(n).expand(2, n, n))
    torch.testing.assert_close(conn(x), x + x[:, :1, :])  # reads stream 0, writes every stream


def test_gradcheck_whole_mhc_layer():
    torch.manual_seed(3)
    c, n = 3, 4
    branch = nn.Linear(c, c).double()
    conn = ManifoldHyperConnection(c, n, 0, branch, sinkhorn_iters=6).double()
    perturb(conn, scale=0.3)
    x = torch.randn(2, n, c, dtype=torch.float64, requires_grad=True)
    names, params = zip(*conn.named_parameters(), strict=True)

    def f(x, *ps):
        return torch.func.functional_call(conn, dict(zip(names, ps, strict=True)), (x,))

    assert torch.autograd.gradcheck(f, (x, *[p.detach().requires_grad_() for p in params]))


def test_residual_is_plain_residual():
    c = 8
    branch = MLP(c)
    conn = Residual(c, branch)
    h = torch.randn(3, 5, c)
    out = conn(h.unsqueeze(-2)).squeeze(-2)
    torch.testing.assert_close(out, h + branch(h), rtol=0, atol=0)
    # n streams where the residual takes one: the error says how to feed it
    with pytest.raises(ValueError, match=r"got \(3, 5, 4, 8\): the residual connection "
                                         r"carries one stream .* expand_streams\(h, 1\)"):
        conn(expand_streams(h, 4))
    with pytest.raises(ValueError, match=r"got \(3, 5, 1, 7\)$"):  # a wrong width: no hint
        conn(torch.randn(3, 5, 1, 7))


def test_expand_and_reduce():
    h = torch.randn(2, 3, 5)
    x = expand_streams(h, 4)
    assert x.shape == (2, 3, 4, 5)
    for i in range(4):
        assert torch.equal(x[..., i, :], h)
    torch.testing.assert_close(reduce_streams(x), h, rtol=0, atol=0)
    torch.testing.assert_close(reduce_streams(x, 4), h, rtol=0, atol=0)
    torch.testing.assert_close(reduce_streams(torch.stack([h, 3 * h], -2)), 2 * h)
    # the streams forgotten: h [B, T, C] would be averaged over T; with n it is refused
    with pytest.raises(ValueError, match=r"reduce_streams expects a streams tensor "
                       r"\[\.\.\., 4, C\] \(4 streams\), got \(2, 3, 5\) "
                       r"\(expand_streams\(h, 4\)"):
        reduce_streams(h, 4)


def _stack(kind, blocks, c, n):
    return [make_connection(kind, c, n, i, b) for i, b in enumerate(blocks)]


def _run(conns, h, n):
    x = expand_streams(h, n)
    for conn in conns:
        x = conn(x)
    return reduce_streams(x)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_initialised_network_computes_the_residual_network(kind):
    # 8 transformer blocks = 16 pre-norm sublayers (attention, MLP), GPT-2 style init, inputs
    # of unit scale. HC's init is exact (one-hot reads, identity mixing); mHC's initial weights
    # for n = 4 (0.625, 0.125) are exact in binary, leaving only fp32 rounding of the mixing.
    torch.manual_seed(0)
    c, n = 64, 4
    blocks = [m for _ in range(8) for m in (Attention(c), MLP(c))]
    h = torch.randn(4, 33, c)
    ref = h
    for b in blocks:
        ref = ref + b(ref)
    out = _run(_stack(kind, blocks, c, n), h, n)
    assert (out - ref).abs().max() <= 1e-6


def test_mhc_initial_maps():
    n = 4
    conn = ManifoldHyperConnection(8, n, layer_index=6, branch=nn.Identity())
    pre, post, res = conn.maps(torch.randn(3, n, 8))
    torch.testing.assert_close(pre[0], torch.tensor([0.125, 0.125, 0.625, 0.125]))  # 6 mod 4
    torch.testing.assert_close(post, torch.ones(3, n), rtol=0, atol=0)
    torch.testing.assert_close(res[0], torch.eye(n) / 2 + 1 / (2 * n))
    assert conn.alpha.tolist() == pytest.approx([0.01] * 3)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_streams_diverge_during_training(kind):
    torch.manual_seed(1)
    c, n = 32, 4
    blocks = [m for _ in range(2) for m in (Attention(c), MLP(c, std=0.2))]
    conns = nn.ModuleList(_stack(kind, blocks, c, n))
    head = nn.Linear(c, 1)
    opt = torch.optim.AdamW(param_groups(nn.ModuleList([conns, head])), lr=1e-2)
    h, target = torch.randn(8, 16, c), torch.randn(8, 16, 1)

    def streams():
        x = expand_streams(h, n)
        for conn in conns:
            x = conn(x)
        return x

    def spread():
        with torch.no_grad():
            x = streams()
        return ((x - x.mean(-2, keepdim=True)).norm() / x.norm()).item()

    assert spread() < 1e-6  # identical at init, up to fp32 rounding of the mixing
    for _ in range(10):
        loss = F.mse_loss(head(reduce_streams(streams())), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    # Measured: relative spread 0.11 (HC) and 2.7e-3 (mHC) after 10 steps; mHC's init mixes
    # half of every stream into the average each layer, so its streams separate more slowly.
    # The successors (mHC's read/write maps, other H_res) are held to separating at all.
    least = 1e-3 if kind in ("hc", "mhc") else 1e-4
    assert spread() > least, f"streams still identical after 10 steps (spread {spread()})"


def test_branch_receives_extra_arguments():
    seen = {}

    def branch(h, scale, *, shift):
        seen["args"] = (scale, shift)
        return h * scale + shift

    x = torch.randn(2, 4, 5)
    for kind in ("hc", "mhc"):
        make_connection(kind, 5, 4, 0, branch)(x, 2.0, shift=1.0)
        assert seen.pop("args") == (2.0, 1.0)
    make_connection("residual", 5, 4, 0, branch)(x[..., :1, :], 3.0, shift=0.5)
    assert seen.pop("args") == (3.0, 0.5)


def test_compile_fullgraph_matches_eager():
    torch.manual_seed(2)
    c, n = 16, 4
    conn = ManifoldHyperConnection(c, n, 1, MLP(c, std=0.2))
    perturb(conn, scale=0.1)
    x = torch.randn(2, 7, n, c, requires_grad=True)
    out_e = conn(x)  # eager first, as a model that is compiled after some steps
    compiled = torch.compile(conn, fullgraph=True, backend="inductor")
    torch._dynamo.reset()
    torch._dynamo.utils.warn_once_cache.clear()  # Dynamo warns once a process per message
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out_c = compiled(x)
    # nothing in the connection's code that Dynamo warns about (a functools cache did)
    assert not [str(w.message) for w in seen if "Dynamo" in str(w.message)]
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out_e)
    params = [x, *conn.parameters()]
    for a, b in zip(torch.autograd.grad(out_c, params, g), torch.autograd.grad(out_e, params, g),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_param_groups_exempt_static_maps_and_gates():
    c, n = 8, 4
    model = nn.ModuleList([
        make_connection("mhc", c, n, 0, nn.Linear(c, c)),
        make_connection("hc", c, n, 1, nn.Linear(c, c)),
    ])
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = lambda group: {id(p) for p in group["params"]}  # noqa: E731
    mhc, hc = model
    assert {id(mhc.phi), id(hc.w), id(mhc.branch.weight), id(hc.branch.weight)} == ids(decay)
    for p in (mhc.alpha, mhc.b_pre, mhc.b_post, mhc.b_res, hc.static_pre, hc.static_post,
              hc.static_res, hc.s_alpha, hc.s_beta, mhc.branch.bias):
        assert id(p) in ids(no_decay)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_bad_input_errors():
    conn = ManifoldHyperConnection(8, 4, 0, nn.Identity())
    with pytest.raises(ValueError, match=r"\[\.\.\., 4, 8\] \(n=4, C=8\), got \(2, 3, 8\)"):
        conn(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match=r"got \(2, 4, 7\)"):
        conn(torch.randn(2, 4, 7))
    with pytest.raises(TypeError, match="floating-point streams tensor, got torch.int64"):
        conn(torch.zeros(2, 4, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="streams >= 1, got 0"):
        ManifoldHyperConnection(8, 0, 0, nn.Identity())
    for kind in ("mhc", "mhc-lite", "kromhc", "mhc-static-res"):  # n = 1 cannot start as a
        with pytest.raises(ValueError, match="expects streams >= 2, got 1: with one stream "
                                             "its H_pre = sigmoid"):  # residual: refused
            make_connection(kind, 8, 1, 0, nn.Identity())
    make_connection("hc", 8, 1, 0, nn.Identity())  # HC's H_pre = e_k: one stream is exact
    with pytest.raises(ValueError, match="expects sinkhorn_iters >= 1, got 0"):
        ManifoldHyperConnection(8, 4, 0, nn.Identity(), sinkhorn_iters=0)
    with pytest.raises(ValueError, match="unknown connection kind 'mhcc'"):
        make_connection("mhcc", 8, 4, 0, nn.Identity())
    with pytest.raises(TypeError, match="callable branch"):
        HyperConnection(8, 4, 0, branch=3)
    with pytest.raises(ValueError, match="expand_streams expects n >= 1, got 0"):
        expand_streams(torch.randn(3, 8), 0)


def test_check_finite_reports_nan_maps():
    conn = ManifoldHyperConnection(8, 4, 0, nn.Identity(), check_finite=True)
    x = torch.randn(2, 4, 8)
    conn(x)  # finite: no error
    with torch.no_grad():
        conn.phi[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"layer 0\): H_pre contains NaN or Inf"):
        conn(x)
    conn.check_finite = False
    assert torch.isnan(conn(x)).any()  # unchecked: NaN flows through silently


def test_public_api_importable():
    for name in ("sinkhorn", "Residual", "HyperConnection", "ManifoldHyperConnection",
                 "expand_streams", "reduce_streams", "make_connection", "param_groups",
                 "collect_gains"):
        assert hasattr(torch_mhc, name)
    assert torch_mhc.CONNECTION_KINDS[:3] == ("residual", "hc", "mhc")  # then the variants


def test_deepcopy_and_state_dict_roundtrip():
    conn = ManifoldHyperConnection(8, 4, 3, nn.Linear(8, 8))
    perturb(conn)
    twin = ManifoldHyperConnection(8, 4, 0, copy.deepcopy(conn.branch))
    twin.load_state_dict(conn.state_dict())
    x = torch.randn(3, 4, 8)
    torch.testing.assert_close(twin(x), conn(x), rtol=0, atol=0)
    assert math.isclose(conn.alpha.sum().item(), twin.alpha.sum().item())


def test_check_finite_names_the_input_and_the_branch_output():
    conn = ManifoldHyperConnection(8, 4, 0, nn.Identity(), check_finite=True)
    x = torch.randn(2, 4, 8)
    x_nan = x.clone()
    x_nan[1, 2, 3] = float("nan")
    with pytest.raises(FloatingPointError, match="input streams contains NaN"):
        conn(x_nan)
    nan_branch = ManifoldHyperConnection(8, 4, 0, lambda h: h * float("nan"), check_finite=True)
    with pytest.raises(FloatingPointError, match="branch output contains NaN"):
        nan_branch(x)


@pytest.mark.parametrize("make", [
    lambda: ManifoldHyperConnection(8, 4, 0, lambda h: (h, h)),
    lambda: HyperConnection(8, 4, 0, lambda h: (h, h)),
    lambda: make_connection("residual", 8, 1, 0, lambda h: (h, h)),
])
def test_a_branch_must_return_a_tensor(make):
    conn = make()
    x = torch.randn(2, conn.streams, 8)
    with pytest.raises(TypeError, match="branch must return a tensor .*got tuple"):
        conn(x)


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize("kind", ["residual", "hc", "mhc", "kromhc"])
def test_a_branch_output_of_another_shape_is_refused(kind, impl):
    """The torch merge would broadcast a [..., 1] (or [C]) branch output onto every channel
    and token without a word: every kind and implementation refuses it, also under
    recomputation, and names both shapes; the input's NaN is named as the input's, the
    residual's too."""
    n = 1 if kind == "residual" else 4
    x = torch.randn(2, 3, n, 8)
    for branch in (lambda h: h.sum(-1, keepdim=True), lambda h: h[0, 0]):
        conn = make_connection(kind, 8, n, 0, branch, impl=impl)
        got = tuple(branch(torch.zeros(2, 3, 8)).shape)
        with pytest.raises(ValueError, match=re.escape(
                f"the branch must return a tensor of its input's shape (2, 3, 8), got {got}")):
            conn(x)
        with recompute_streams(2), pytest.raises(ValueError, match="input's shape"):
            conn(x.requires_grad_())
        x = x.detach()
    conn = make_connection(kind, 8, n, 0, nn.Identity(), impl=impl, check_finite=True)
    with pytest.raises(FloatingPointError, match="the input streams contains NaN or Inf"):
        conn(torch.full((2, 3, n, 8), float("nan")))


def test_constructor_counts_are_ints_not_bools():
    lin = nn.Linear(8, 8)
    with pytest.raises(TypeError, match="expects layer_index to be an int, got 'a'"):
        make_connection("mhc", 8, 4, "a", lin)
    with pytest.raises(TypeError, match="expects streams to be an int, got True"):
        ManifoldHyperConnection(8, True, 0, lin)
    with pytest.raises(TypeError, match="expand_streams expects n to be an int, got True"):
        expand_streams(torch.randn(2, 8), True)
    with pytest.raises(ValueError, match="HyperConnection expects layer_index >= 0, got -1"):
        HyperConnection(8, 4, -1, lin)
    conn = ManifoldHyperConnection(8, np.int64(4), np.int64(2), lin)  # numpy ints are ints
    assert (conn.streams, conn.layer_index) == (4, 2) and type(conn.streams) is int
    with pytest.raises(ValueError, match="unknown op implementation 'bogus'"):
        make_connection("residual", 8, 1, 0, lin, impl="bogus")
    with pytest.raises(TypeError, match="floating-point streams tensor, got torch.int64"):
        reduce_streams(torch.ones(2, 4, 8, dtype=torch.long))


def test_stream_head_resets_to_the_mean_after_a_meta_build():
    """StreamHead starts as the mean of the streams, also when built on the meta device and
    materialised with to_empty + reset_parameters; bad sizes are refused."""
    x = torch.randn(3, 4, 8)
    with torch.device("meta"):
        head = torch_mhc.StreamHead(8, 4)
    head.to_empty(device="cpu")
    head.reset_parameters()
    assert torch.allclose(head(x), reduce_streams(x), atol=1e-6)
    with pytest.raises(TypeError, match="StreamHead expects streams to be an int, got True"):
        torch_mhc.StreamHead(8, True)
    with pytest.raises(ValueError, match="finite gate_init, got nan"):
        torch_mhc.StreamHead(8, 4, gate_init=float("nan"))


def test_param_groups_extra_no_decay_names_parameters():
    """extra_no_decay takes full parameter names, a tied weight's second name too; a name of
    nothing (a module's name, a typo) is an error, not an exemption of nothing."""
    emb = nn.Embedding(10, 8)
    head = nn.Linear(8, 10, bias=False)
    head.weight = emb.weight  # tied
    model = nn.ModuleDict({"wte": emb, "wpe": nn.Embedding(4, 8), "head": head,
                           "conn": ManifoldHyperConnection(8, 4, 0, nn.Linear(8, 8))})
    decay, no_decay = param_groups(model, extra_no_decay=["wpe.weight", "head.weight"])
    exempt = {id(p) for p in no_decay["params"]}
    assert id(model["wpe"].weight) in exempt and id(emb.weight) in exempt
    assert id(model["conn"].phi) in {id(p) for p in decay["params"]}
    with pytest.raises(ValueError, match=r"extra_no_decay names no parameter of the model: "
                                         r"\['wpe'\]; expected full names .* 'wte.weight'"):
        param_groups(model, extra_no_decay=["wpe"])
    with pytest.raises(TypeError, match="a list of parameter names, got the string"):
        param_groups(model, extra_no_decay="wpe.weight")


def test_param_groups_wants_a_module():
    conn = ManifoldHyperConnection(8, 4, 0, nn.Linear(8, 8))
    with pytest.raises(TypeError, match="param_groups expects an nn.Module .* got list"):
        param_groups([conn])
    groups = param_groups(nn.ModuleList([conn]))
    assert {id(p) for g in groups for p in g["params"]} == {id(p) for p in conn.parameters()}
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"weight_decay to be a finite number >= 0, "
                                             f"got {re.escape(repr(float(bad)))}"):
            param_groups(conn, weight_decay=bad)
    for bad in ("0.1", True):
        with pytest.raises(TypeError, match="weight_decay to be a float, got"):
            param_groups(conn, weight_decay=bad)
    assert param_groups(conn, weight_decay=0)[0]["weight_decay"] == 0


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_norm_eps_must_be_finite_and_positive(kind, bad):
    # norm_eps = 0 divides an all-zero token by 0; inf or NaN poison every map.
    cls = type(make_connection(kind, 8, 4, 0, nn.Identity())).__name__
    with pytest.raises(ValueError, match=rf"{cls} expects norm_eps to be a finite number > 0, "
                                         rf"got {bad!r}"):
        make_connection(kind, 8, 4, 0, nn.Identity(), norm_eps=bad)
    with pytest.raises(ValueError, match=rf"StreamHead expects norm_eps .*> 0, got {bad!r}"):
        torch_mhc.StreamHead(8, 4, norm_eps=bad)


@pytest.mark.parametrize("name", ["pre_eps", "sinkhorn_eps"])
@pytest.mark.parametrize("bad", [-1e-3, float("inf"), float("nan")])
def test_mhc_additive_eps_must_be_finite_and_non_negative(name, bad):
    with pytest.raises(ValueError, match=rf"ManifoldHyperConnection expects {name} to be a "
                                         rf"finite number >= 0, got {bad!r}"):
        make_connection("mhc", 8, 4, 0, nn.Identity(), **{name: bad})
    with pytest.raises(ValueError, match=rf"StreamHead expects eps .*>= 0, got {bad!r}"):
        torch_mhc.StreamHead(8, 4, eps=bad)


def test_eps_options_are_numbers():
    for bad in ("1e-6", True, None):
        with pytest.raises(TypeError, match=rf"expects norm_eps to be a float, got {bad!r}"):
            make_connection("hc", 8, 4, 0, nn.Identity(), norm_eps=bad)
    # ints and numpy floats are numbers; 0 is a valid additive eps
    conn = make_connection("mhc", 8, 4, 0, nn.Identity(), norm_eps=np.float32(1e-5), pre_eps=0,
                           sinkhorn_eps=np.float64(1e-6))
    assert (conn.norm_eps, conn.pre_eps, conn.sinkhorn_eps) == (float(np.float32(1e-5)), 0.0,
                                                                 1e-6)
    assert torch.isfinite(conn(torch.zeros(2, 4, 8))).all()  # an all-zero token stays finite


def test_flags_gates_and_iterations_are_checked():
    # values a hand-edited config could carry: a string flag is truthy, a bool is an int
    with pytest.raises(TypeError, match="HyperConnection expects dynamic to be True or False, "
                                        "got 'false'"):
        make_connection("hc", 8, 4, 0, nn.Identity(), dynamic="false")
    with pytest.raises(TypeError, match="expects check_finite to be True or False, got 1"):
        make_connection("mhc", 8, 4, 0, nn.Identity(), check_finite=1)
    for bad in (True, "20", 20.0, 2.5):  # a wrong type, not a wrong count
        with pytest.raises(TypeError, match=f"expects sinkhorn_iters to be an int, got {bad!r}"):
            make_connection("mhc", 8, 4, 0, nn.Identity(), sinkhorn_iters=bad)
    with pytest.raises(TypeError, match="sinkhorn expects iters to be an int, got True"):
        torch_mhc.sinkhorn(torch.randn(4, 4), iters=True)
    assert make_connection("mhc", 8, 4, 0, nn.Identity(),
                           sinkhorn_iters=np.int64(3)).sinkhorn_iters == 3
    for kind in ("mhc", "mhc-lite", "kromhc", "mhc-static-res"):
        with pytest.raises(ValueError, match="expects a finite gate_init, got inf"):
            make_connection(kind, 8, 4, 0, nn.Identity(), gate_init=float("inf"))


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_parametrized_parameters_are_read_through_the_parametrization(kind):
    """A parametrization (torch.nn.utils.parametrize) moves parameters out of the module's
    _parameters, where map_args and decode_args read them first: the maps then read them
    through the parametrization, with autograd and when decoding without it."""
    from torch.nn.utils import parametrize

    class Scale(nn.Module):
        def forward(self, p):
            return 1.5 * p

    c, n = 24, 4
    torch.manual_seed(0)
    conn = torch_mhc.make_connection(kind, c, n, 1, nn.Sequential(nn.Linear(c, c), nn.Tanh()))
    perturb(conn, scale=0.2)
    plain = copy.deepcopy(conn)
    names = (["w", "s_alpha", "static_pre"] if kind == "hc" else
             ["phi", "b_pre"] + (["b_res"] if hasattr(conn, "b_res") else []))
    with torch.no_grad():
        for name in names:
            getattr(plain, name).mul_(1.5)
    for name in names:
        parametrize.register_parametrization(conn, name, Scale())
    x = torch.randn(2, 3, n, c)
    for impl in ("reference", "cpu"):
        conn.impl = plain.impl = impl
        assert torch.equal(conn(x), plain(x)), impl
        with torch.no_grad():  # few tokens: the cpu ops' prepared decoding calls
            assert torch.equal(conn(x[:, :1]), plain(x[:, :1])), impl


def test_every_kind_takes_the_shared_options_and_names_the_ones_it_takes():
    """One make_connection call with check_finite and impl builds every kind (the residual
    included), and check_finite then checks the branch output; an option a kind does not take
    is a TypeError naming the kind's class and its options (not the successors' base class)."""
    nan_branch = nn.Linear(8, 8)
    with torch.no_grad():
        nan_branch.bias.fill_(float("nan"))
    for kind in torch_mhc.CONNECTION_KINDS:
        conn = make_connection(kind, 8, 4, 0, nan_branch, check_finite=True, impl="reference")
        x = expand_streams(torch.randn(2, 3, 8), conn.streams)
        with pytest.raises(FloatingPointError, match="the branch output contains NaN or Inf"):
            conn(x)
    with pytest.raises(TypeError, match=r"'kromhc' \(KromHC\) takes no option\(s\) "
                                        r"\['sinkhorn_iters'\]; its options: gate_init, "
                                        r"norm_eps, check_finite, impl"):
        make_connection("kromhc", 8, 4, 0, nan_branch, sinkhorn_iters=5)
    with pytest.raises(TypeError, match=r"\(sinkhorn_iter: did you mean sinkhorn_iters\?\)"):
        make_connection("mhc", 8, 4, 0, nan_branch, sinkhorn_iter=5)
    with pytest.raises(TypeError, match=r"'residual' \(Residual\) takes no option\(s\) "
                                        r"\['gate_init'\]; its options: check_finite, impl"):
        make_connection("residual", 8, 1, 0, nan_branch, gate_init=0.1)
