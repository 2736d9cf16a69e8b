"""Second derivatives through the connections: exact on the reference implementation, refused
by the fused ones.

The `cpu` (and `triton`) ops' backwards are kernels whose results autograd sees as constants:
a backward with create_graph=True through them would give wrong second derivatives without a
word (for an mHC connection as _connection builds it, on 2 x 3 tokens, a Hessian-vector
product through the cpu kernels comes out 16 off where its entries reach 22), so they refuse
it, naming the implementation that takes it. The reference is held in both of
Sinkhorn's domains: logits within 32 of each other take the linear loop, farther ones the
log-domain loop ("mhc-far", an H_res bias 50 apart).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_mhc

KINDS = ("mhc", "hc", "mhc-lite", "kromhc", "mhc-static-res")


def _connection(kind: str, impl: str, dim: int = 3, n: int = 2, dtype=torch.float32):
    torch.manual_seed(0)
    branch = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
    far = kind == "mhc-far"
    conn = torch_mhc.make_connection("mhc" if far else kind, dim, n, 1, branch,
                                     impl=impl).to(dtype)
    with torch.no_grad():  # away from the initial maps, so that every term is non-zero
        for p in conn.parameters():
            p.add_(0.3 * torch.randn_like(p))
        if far:  # H_res's logits spread past LINEAR_RANGE: Sinkhorn's log-domain loop
            conn.b_res.add_(torch.tensor([[25.0, -25.0], [-25.0, 25.0]], dtype=dtype))
    return conn


@pytest.mark.parametrize("kind", KINDS)
def test_the_cpu_ops_refuse_a_backward_that_builds_a_graph(kind):
    conn = _connection(kind, "cpu")
    x = torch.randn(2, 3, 2, 3)
    out = conn(x)
    with pytest.raises(RuntimeError, match="torch_mhc's 'cpu' ops compute first derivatives "
                       "only: a backward with create_graph=True .* impl=\"reference\""):
        torch.autograd.grad(out.square().sum(), conn.branch[0].weight, create_graph=True)
    # a plain backward of the same graph is unaffected
    (g,) = torch.autograd.grad(out.square().sum(), conn.branch[0].weight)
    assert g.abs().sum() > 0


@pytest.mark.parametrize("kind", (*KINDS, "mhc-far"))
def test_the_reference_gives_second_derivatives(kind):
    """gradgradcheck in float64, through the streams and the branch's weight, and a
    Hessian-vector product against finite differences of the gradient."""
    conn = _connection(kind, "reference", dtype=torch.float64)
    w = conn.branch[0].weight
    x = torch.randn(1, 2, 2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x, w: torch.func.functional_call(
        conn, {"branch.0.weight": w}, (x,)), (x, w.detach().clone().requires_grad_()))

    def grad_w(weight):
        (g,) = torch.autograd.grad(torch.func.functional_call(
            conn, {"branch.0.weight": weight}, (x.detach(),)).square().sum(), weight,
            create_graph=True)
        return g

    v = torch.randn_like(w)
    w0 = w.detach().clone().requires_grad_()
    (hvp,) = torch.autograd.grad(grad_w(w0), w0, v)
    eps = 1e-6
    fd = (grad_w((w0 + eps * v).detach().requires_grad_()) -
          grad_w((w0 - eps * v).detach().requires_grad_())) / (2 * eps)
    assert torch.allclose(hvp, fd.detach(), rtol=1e-6, atol=1e-8)
