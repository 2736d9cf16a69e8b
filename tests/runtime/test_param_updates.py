"""The optimizer-step count the no-autograd caches compare (runtime.param_updates): torch's
fused optimizers write parameters without bumping their versions, and a connection's
decoding path must still compute with the values they wrote."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_mhc
from tests.helpers.op_cases import perturbed
from torch_mhc.ops.cpu import native
from torch_mhc.runtime import param_updates

KINDS = [k for k in torch_mhc.CONNECTION_KINDS if k != "residual"]


def _need_native() -> None:
    """Without the native library no path keeps tables (nothing could go stale)."""
    if native.load() is None:
        pytest.skip("native CPU library unavailable: no cached tables to test")


def _fused_step(params) -> None:
    """One step of torch's fused AdamW, which leaves the parameters' versions as they were."""
    params = list(params)
    for p in params:
        p.grad = torch.randn_like(p)
    versions = [p._version for p in params]
    torch.optim.AdamW(params, lr=0.05, fused=True).step()
    assert [p._version for p in params] == versions  # what makes a version check blind


def test_every_optimizer_step_counts():
    """Fused, foreach and for-loop steps, and a subclass's, each change the count."""

    class Plain(torch.optim.SGD):
        pass

    p = nn.Parameter(torch.randn(3))
    p.grad = torch.ones(3)
    for opt in (torch.optim.AdamW([p], fused=True), torch.optim.SGD([p], lr=0.1, foreach=True),
                torch.optim.Adam([p], foreach=False), Plain([p], lr=0.1)):
        before = param_updates.current()
        opt.step()
        assert param_updates.current() > before, type(opt).__name__


@pytest.mark.parametrize("tokens", [1, 2 * native.SINGLE_THREAD_TOKENS],
                         ids=["decoding", "many-tokens"])
@pytest.mark.parametrize("kind", KINDS)
def test_no_grad_forward_sees_a_fused_optimizer_step(kind, tokens):
    """A connection run without autograd (its prepared decoding calls for one token, the ops'
    cached tables for many), then stepped by fused AdamW, then run without autograd again:
    the output is that of the stepped parameters (the autograd path's, and the reference
    implementation's with the same state), not of the tables made before the step."""
    _need_native()
    c, n = 24, 4
    torch.manual_seed(0)
    conn = perturbed(torch_mhc.make_connection(kind, c, n, layer_index=1,
                                               branch=nn.Sequential(nn.Linear(c, c), nn.Tanh())))
    ref = torch_mhc.make_connection(kind, c, n, layer_index=1, impl="reference",
                                    branch=nn.Sequential(nn.Linear(c, c), nn.Tanh()))
    x = torch.randn(tokens, n, c)
    with torch.no_grad():
        before = conn(x)
        conn(x)  # a second call: the prepared calls are in use
    _fused_step(conn.parameters())
    with torch.no_grad():
        after = conn(x)
        ref.load_state_dict(conn.state_dict())
        expected = ref(x)
    with_grad = conn(x.clone().requires_grad_()).detach()
    assert (after - before).abs().max() > 1e-3  # the step moved the output
    torch.testing.assert_close(after, with_grad, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(after, expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("kind", ["mhc", "hc"])
def test_a_write_into_data_is_seen_after_parameters_changed(kind):
    """`p.data -= ...` bumps no version and runs no optimizer: the decoding path keeps the
    tables it made until torch_mhc.parameters_changed() says otherwise."""
    _need_native()
    c, n = 24, 4
    torch.manual_seed(1)
    conn = perturbed(torch_mhc.make_connection(kind, c, n, layer_index=1,
                                               branch=nn.Sequential(nn.Linear(c, c), nn.Tanh())))
    x = torch.randn(1, n, c)
    with torch.no_grad():
        before = conn(x)
    for p in conn.parameters():
        p.data -= 0.3 * torch.randn_like(p)  # the tutorials' SGD step
    with_grad = conn(x.clone().requires_grad_()).detach()
    torch_mhc.parameters_changed()
    with torch.no_grad():
        after = conn(x)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, with_grad, rtol=2e-6, atol=2e-6)
