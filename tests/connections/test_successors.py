"""mHC-lite, KromHC and mHC with a static H_res: definitions, init, gradients, errors."""

import itertools
import math

import pytest
import torch
from torch import nn

from tests.helpers.branches import perturb
from torch_mhc import make_connection, param_groups
from torch_mhc.connections.successors import VARIANT_KINDS, KromHC, MHCLite, MHCStaticRes
from torch_mhc.lm.model import LM, ModelConfig

# ---------------------------------------------------------------------------------------------
# Plain references, written from the papers' definitions without the module's helpers
# ---------------------------------------------------------------------------------------------


def rms_logits(x, phi, eps=1e-6):
    """(flatten(x) @ phi) / RMS(flatten(x)), token by token."""
    v = x.flatten(-2)
    return (v @ phi) / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)


def mhc_lite_res_naive(z):
    """sum_k softmax(z)_k P_k with P_k[i, p(i)] = 1, one token z [n!] at a time."""
    n = next(m for m in range(1, 8) if math.factorial(m) == z.shape[-1])
    out = torch.zeros(*z.shape[:-1], n, n, dtype=z.dtype)
    w = torch.exp(z - z.max(-1, keepdim=True).values)
    w = w / w.sum(-1, keepdim=True)
    for k, p in enumerate(itertools.permutations(range(n))):
        for i in range(n):
            out[..., i, p[i]] += w[..., k]
    return out


def kromhc_res_naive(z):
    """torch.kron of the factors a I + (1 - a) swap, a = sigmoid(z), one token at a time."""
    flat = z.reshape(-1, z.shape[-1])
    mats = []
    for zt in flat:
        m = torch.ones(1, 1, dtype=z.dtype)
        for a in torch.sigmoid(zt):
            m = torch.kron(m, torch.stack([torch.stack([a, 1 - a]), torch.stack([1 - a, a])]))
        mats.append(m)
    return torch.stack(mats).reshape(*z.shape[:-1], *mats[0].shape)


def maps_naive(conn, x):
    """H_pre, H_post, H_res of a variant, from its parameters and the papers' equations."""
    n = conn.streams
    lg = rms_logits(x, conn.phi)
    pre = torch.sigmoid(conn.alpha[0] * lg[..., :n] + conn.b_pre)
    post = 2 * torch.sigmoid(conn.alpha[1] * lg[..., n:2 * n] + conn.b_post)
    if isinstance(conn, MHCStaticRes) or not hasattr(conn, "b_res"):  # I; KromHC n = 1: [[1]]
        res = torch.eye(n, dtype=x.dtype).expand(*x.shape[:-2], n, n)
    else:
        z = conn.alpha[2] * lg[..., 2 * n:] + conn.b_res
        res = (mhc_lite_res_naive if isinstance(conn, MHCLite) else kromhc_res_naive)(z)
    return pre, post, res


def layer_naive(conn, x):
    pre, post, res = maps_naive(conn, x)
    f = conn.branch((pre.unsqueeze(-1) * x).sum(-2))
    return res @ x + post.unsqueeze(-1) * f.unsqueeze(-2)


# n = 1 is refused (tests/connections/test_connections.py::test_bad_input_errors)
STREAMS = {"mhc-lite": [2, 3, 4, 5], "kromhc": [2, 4, 8], "mhc-static-res": [2, 3, 4]}
CASES = [(kind, n) for kind in VARIANT_KINDS for n in STREAMS[kind]]


def _random_variant(kind, n, c=6, dtype=torch.float64, scale=0.5, seed=0):
    torch.manual_seed(seed)
    conn = make_connection(kind, c, n, 1, nn.Sequential(nn.Linear(c, c), nn.Tanh()))
    conn.to(dtype)
    perturb(conn, scale=scale, seed=seed)
    with torch.no_grad():
        conn.alpha.fill_(2.0)  # large dynamic part: maps far from the initial ones
    return conn


# ---------------------------------------------------------------------------------------------
# Definitions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,n", CASES)
def test_layer_equals_the_definition(kind, n):
    conn = _random_variant(kind, n)
    x = torch.randn(3, 5, n, 6, dtype=torch.float64, requires_grad=True)
    for a, b in zip(conn.maps(x), maps_naive(conn, x), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    out, ref = conn(x), layer_naive(conn, x)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(out)
    params = [x, *conn.parameters()]
    for a, b in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


@pytest.mark.parametrize("kind,n", [c for c in CASES if c[0] != "mhc-static-res"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_res_is_exactly_doubly_stochastic(kind, n, dtype, tol):
    conn = _random_variant(kind, n, dtype=dtype, scale=2.0, seed=n)
    x = torch.randn(64, n, 6, dtype=dtype) * 3
    res = conn.maps(x)[2]
    assert res.dtype == dtype and (res >= 0).all()
    ones = torch.ones(64, n, dtype=dtype)
    assert (res.sum(-1) - ones).abs().max() <= tol  # rows
    assert (res.sum(-2) - ones).abs().max() <= tol  # columns: no iteration error
    # the maps really vary from token to token (the test is not of a constant matrix)
    assert n == 1 or (res - res[:1]).abs().max() > 1e-2


@pytest.mark.parametrize("kind,n", CASES)
def test_gradcheck_whole_layer(kind, n):
    conn = _random_variant(kind, n, c=3, scale=0.3)
    x = torch.randn(2, n, 3, dtype=torch.float64, requires_grad=True)
    names, params = zip(*conn.named_parameters(), strict=True)

    def f(x, *ps):
        return torch.func.functional_call(conn, dict(zip(names, ps, strict=True)), (x,))

    assert torch.autograd.gradcheck(f, (x, *[p.detach().requires_grad_() for p in params]))


def test_kromhc_factor_order_matches_torch_kron():
    # stream index bits: the first factor acts on the most significant bit
    z = torch.tensor([[3.0, -1.0]], dtype=torch.float64)
    a, b = torch.sigmoid(z[0])
    swap = torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    eye = torch.eye(2, dtype=torch.float64)
    want = torch.kron(a * eye + (1 - a) * swap, b * eye + (1 - b) * swap)
    conn = make_connection("kromhc", 2, 4, 0, nn.Identity()).double()
    torch.testing.assert_close(conn.res_map(z)[0], want, rtol=0, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# Initialisation
# ---------------------------------------------------------------------------------------------


def test_initial_maps():
    n, c = 4, 8
    x = torch.randn(3, n, c)
    pre_want = torch.tensor([0.125, 0.125, 0.625, 0.125])  # layer 6 reads stream 6 mod 4
    three = torch.tensor([[0.75, 0.25], [0.25, 0.75]])
    res_want = {
        "mhc-lite": torch.eye(n) / 2 + 1 / (2 * n),  # mHC's initial H_res
        "kromhc": torch.kron(three, three),  # each factor I/2 + J/4
        "mhc-static-res": torch.eye(n),
    }
    for kind, want in res_want.items():
        conn = make_connection(kind, c, n, 6, nn.Identity())
        pre, post, res = conn.maps(x)
        torch.testing.assert_close(pre[0], pre_want, rtol=0, atol=1e-7)
        torch.testing.assert_close(post, torch.ones(3, n), rtol=0, atol=0)
        torch.testing.assert_close(res, want.expand(3, n, n), rtol=0, atol=2e-7)
        assert conn.alpha.tolist() == pytest.approx([0.01] * conn.alpha.numel())


@pytest.mark.parametrize("kind", VARIANT_KINDS)
def test_reset_parameters_and_meta_device(kind):
    torch.manual_seed(0)
    fresh = make_connection(kind, 8, 4, 3, nn.Linear(8, 8))
    moved = make_connection(kind, 8, 4, 3, nn.Linear(8, 8))
    perturb(moved)
    moved.reset_parameters()
    with torch.device("meta"):
        meta = make_connection(kind, 8, 4, 3, nn.Linear(8, 8))
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    meta.branch.load_state_dict(fresh.branch.state_dict())
    moved.branch.load_state_dict(fresh.branch.state_dict())
    x = torch.randn(5, 4, 8)
    for conn in (moved, meta):
        for name, p in fresh.named_parameters(recurse=False):
            assert torch.equal(getattr(conn, name), p), name
        for name, b in fresh.named_buffers(recurse=False):
            assert torch.equal(getattr(conn, name), b), name
        torch.testing.assert_close(conn(x), fresh(x), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Ops, model, optimiser groups, errors
# ---------------------------------------------------------------------------------------------


def _reference_and_cpu(kind, n, c):
    """A random successor on the reference ops and the same one on the cpu ops."""
    ref = _random_variant(kind, n, c=c, dtype=torch.float32, scale=0.2)
    ref.impl = "reference"
    fused = make_connection(kind, c, n, 1, ref.branch, impl="cpu")
    fused.load_state_dict(ref.state_dict())
    return ref, fused


def _assert_same_layer(ref, fused, x):
    """Equal outputs and gradients (input and every parameter) under a random upstream."""
    out_r, out_f = ref(x), fused(x)
    torch.testing.assert_close(out_f, out_r, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out_r)
    grads_r = torch.autograd.grad(out_r, [x, *ref.parameters()], g)
    grads_f = torch.autograd.grad(out_f, [x, *fused.parameters()], g)
    for a, b in zip(grads_f, grads_r, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", VARIANT_KINDS)
def test_cpu_ops_agree_with_reference(kind):
    c, n = 24, 4
    ref, fused = _reference_and_cpu(kind, n, c)
    _assert_same_layer(ref, fused, torch.randn(2, 17, n, c, requires_grad=True))


@pytest.mark.parametrize("kind,n", CASES)
def test_cpu_connection_is_one_fused_node(kind, n):
    """impl="cpu" runs the maps, aggregation and (through x_for_merge) the merge's x gradient
    as ops.cpu's one variant_maps_pre node; the layer equals the reference one."""
    c = 24
    ref, fused = _reference_and_cpu(kind, n, c)
    x = torch.randn(3, 23, n, c, requires_grad=True)
    _, state = fused.mix_in(x)
    assert state[-1] is not None  # x_for_merge: the merge's x gradient joins the maps' dx
    _assert_same_layer(ref, fused, x)


@pytest.mark.parametrize("kind", VARIANT_KINDS)
def test_lm_with_variant_starts_as_residual_lm(kind):
    cfg = dict(dim=32, n_layers=2, n_heads=2, max_seq_len=16)
    torch.manual_seed(0)
    res = LM(ModelConfig(connection="residual", **cfg))
    torch.manual_seed(0)
    var = LM(ModelConfig(connection=kind, **cfg))
    idx = torch.randint(0, 256, (2, 16))
    _, loss_r = res(idx, idx)
    _, loss_v = var(idx, idx)
    assert abs(loss_r.item() - loss_v.item()) < 1e-5
    assert var.connections()[0].kind == kind


def test_param_groups_exempt_gates_and_biases():
    conns = nn.ModuleList([make_connection(k, 8, 4, 0, nn.Linear(8, 8)) for k in VARIANT_KINDS])
    decay, no_decay = param_groups(conns)
    ids = {id(p) for p in decay["params"]}
    for conn in conns:
        assert id(conn.phi) in ids
        for name in conn.no_weight_decay():
            assert id(getattr(conn, name)) not in ids, name


def test_parameter_counts():
    c, n = 8, 4
    counts = {k: sum(p.numel() for p in make_connection(k, c, n, 0, nn.Identity())
                     .parameters(recurse=False)) for k in VARIANT_KINDS}
    assert counts["mhc-lite"] == n * c * (2 * n + 24) + 3 + 2 * n + 24
    assert counts["kromhc"] == n * c * (2 * n + 2) + 3 + 2 * n + 2
    assert counts["mhc-static-res"] == n * c * 2 * n + 2 + 2 * n
    assert not any(b.dtype == torch.long for k in VARIANT_KINDS
                   for b in make_connection(k, c, n, 0, nn.Identity()).buffers())
    # the constant buffers are rebuilt, not saved
    assert set(make_connection("mhc-lite", c, n, 0, nn.Identity()).state_dict()) == {
        "phi", "alpha", "b_pre", "b_post", "b_res"}


def test_bad_streams_errors():
    with pytest.raises(ValueError, match=r"mhc-lite .* n <= 5 streams .* got n = 6 \(720 "):
        make_connection("mhc-lite", 8, 6, 0, nn.Identity())
    with pytest.raises(ValueError, match=r"kromhc .* power of two .* got n = 3 \(nearest: 2 or 4"):
        make_connection("kromhc", 8, 3, 0, nn.Identity())
    with pytest.raises(ValueError, match="kromhc.*got n = 6 \\(nearest: 4 or 8"):
        KromHC(8, 6, 0, nn.Identity())
    with pytest.raises(ValueError, match=r"ModelConfig.connection must be one of .*got 'lite'"):
        ModelConfig(connection="lite")
    # checked with the config, before any model is built
    with pytest.raises(ValueError, match=r"ModelConfig.streams: kromhc .* got n = 5"):
        ModelConfig(connection="kromhc", streams=5)
    with pytest.raises(ValueError, match=r"ModelConfig.streams: mhc-lite .* got n = 7"):
        ModelConfig(connection="mhc-lite", streams=7)
    ModelConfig(connection="mhc", streams=7)  # any n for the others


@pytest.mark.parametrize("kind", VARIANT_KINDS)
def test_lm_recompute_gives_the_same_gradients(kind):
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        lm = LM(ModelConfig(connection=kind, dim=32, n_layers=2, n_heads=2, max_seq_len=16,
                            recompute=recompute))
        perturb(lm, scale=0.05)
        _, loss = lm(idx, idx)
        loss.backward()
        grads.append([p.grad for p in lm.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert any(g.abs().max() > 0 for g in grads[0])
