"""The connections under torch.func's transforms: vmap, grad and per-sample gradients.

Under a transform "auto" takes the reference implementation (the fused ops' autograd
Functions read their inputs' memory, which vmap's and grad's wrapped tensors do not have),
and the reference's Sinkhorn runs its loop under autograd instead of its recomputing
Function. Every result is held, in float64, to the same connection run without a transform:
the forward to the last bits, the gradients to rounding. "mhc-far" is mHC with H_res logits
50 apart, whose Sinkhorn takes the log-domain loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_mhc
from torch_mhc.functional.sinkhorn import sinkhorn

KINDS = ("mhc", "mhc-far", "hc", "mhc-lite", "kromhc", "mhc-static-res", "residual")


def _connection(kind: str, impl: str = "auto") -> nn.Module:
    torch.manual_seed(0)
    n = 1 if kind == "residual" else 4
    conn = torch_mhc.make_connection("mhc" if kind == "mhc-far" else kind, 8, n, 0,
                                     nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                                     impl=impl).double()
    with torch.no_grad():  # away from the initial maps, so that every term is non-zero
        for p in conn.parameters():
            p.add_(0.3 * torch.randn_like(p))
        if kind == "mhc-far":
            conn.b_res.add_(50.0 * torch.eye(4, dtype=torch.float64) - 25.0)
    return conn


def _streams(conn) -> torch.Tensor:
    return torch.randn(3, 2, conn.streams if hasattr(conn, "streams") else 1, 8,
                       dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", KINDS)
def test_vmap_computes_the_connection(kind):
    conn = _connection(kind)
    x = _streams(conn)  # [B, T, n, C]; vmap over B
    expected = conn(x)
    torch.testing.assert_close(torch.func.vmap(conn)(x), expected, rtol=1e-13, atol=1e-13)
    with torch.no_grad():  # a prepared decoding call for one sample's shape exists now
        conn(x[0])
        conn(x[0])
        torch.testing.assert_close(torch.func.vmap(conn)(x), expected, rtol=1e-13,
                                   atol=1e-13)


@pytest.mark.parametrize("kind", KINDS)
def test_func_grad_and_per_sample_gradients_match_autograd(kind):
    conn = _connection(kind)
    x = _streams(conn)
    params = {name: p.detach() for name, p in conn.named_parameters()}

    def loss(p, xs):
        return torch.func.functional_call(conn, p, (xs,)).square().sum()

    grads = torch.func.grad(loss)(params, x)
    conn.zero_grad()
    loss(dict(conn.named_parameters()), x).backward()
    for name, p in conn.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12)
    # per-sample gradients, the transforms' common use: each sample's against its own
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params,
                                                                           x.unsqueeze(1))
    for b in range(x.shape[0]):
        conn.zero_grad()
        loss(dict(conn.named_parameters()), x[b:b + 1]).backward()
        for name, p in conn.named_parameters():
            torch.testing.assert_close(per_sample[name][b], p.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("impl", ["cpu", "inductor"])
def test_an_implementation_named_outside_the_reference_is_refused(impl):
    conn = _connection("mhc", impl=impl)
    with pytest.raises(RuntimeError, match=f"torch_mhc's '{impl}' ops do not run under "
                       "torch.func transforms .* use impl=\"reference\""):
        torch.func.vmap(conn)(_streams(conn))
    conn(_streams(conn))  # outside a transform it runs


@pytest.mark.parametrize("spread", [1.0, 100.0])  # the linear and the log domain
def test_sinkhorn_under_func_grad_is_its_recomputing_backward(spread):
    logits = spread * torch.randn(5, 4, 4, dtype=torch.float64,
                                  generator=torch.Generator().manual_seed(2))
    weight = torch.randn(4, 4, dtype=torch.float64)

    def loss(h):
        return (sinkhorn(h, 20) * weight).sum()

    h = logits.clone().requires_grad_()
    loss(h).backward()  # _Sinkhorn's backward: the loop reversed, iterates recomputed
    torch.testing.assert_close(torch.func.grad(loss)(logits), h.grad, rtol=1e-12,
                               atol=1e-14)
    torch.testing.assert_close(torch.func.vmap(sinkhorn)(logits), sinkhorn(logits), rtol=0,
                               atol=0)
    with pytest.raises(RuntimeError, match=r"sinkhorn\(implicit_grad=True\) does not run "
                                           "under torch.func"):
        torch.func.grad(lambda h: sinkhorn(h, implicit_grad=True).sum())(logits)


def test_recomputation_steps_aside_under_a_transform():
    """recompute_streams keeps its tensors through saved-tensor hooks, which torch.func's
    transforms refuse: under one the connections run without it, to the same gradient."""
    from torch_mhc.runtime.recompute import recompute_streams

    conn = _connection("mhc")
    x = _streams(conn)

    def loss(xs):
        return conn(xs).square().sum()

    expected = torch.func.grad(loss)(x)
    with recompute_streams(2):
        torch.testing.assert_close(torch.func.grad(loss)(x), expected, rtol=0, atol=0)
        torch.testing.assert_close(torch.func.vmap(conn)(x), conn(x), rtol=1e-13, atol=1e-13)
