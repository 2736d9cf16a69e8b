"""Meta-device construction, reset_parameters() and torch.compile readiness of the connections.

Large-model trainers (torchtitan, FSDP2 users) build a model on the meta device, shard it,
materialise it with `to_empty` and only then initialise it by calling each module's
`reset_parameters()`. A connection must therefore be able to re-create its documented
initial values at any time, also when its parameters are DTensor shards. And a compiled block
(`torch.compile(fullgraph=True)`) must trace through the implementation lookup of torch_mhc.ops.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.connections import meta_init_worker as W
from tests.helpers import launch as launch_helpers
from torch_mhc import HyperConnection, ManifoldHyperConnection, Residual, ops

WORKER = Path(__file__).with_name("meta_init_worker.py")


def _own_state(conn: nn.Module) -> dict[str, torch.Tensor]:
    """The connection's own parameters and buffers (the branch excluded)."""
    return {n: t for n, t in conn.state_dict().items() if not n.startswith("branch.")}


def _connections(n: int, k: int) -> list[nn.Module]:
    lin = nn.Linear(6, 6)
    return [
        Residual(6, lin),
        HyperConnection(6, n, k, lin),
        HyperConnection(6, n, k, lin, dynamic=False),
        *([ManifoldHyperConnection(6, n, k, lin),  # mHC takes n >= 2
           ManifoldHyperConnection(6, n, k, lin, gate_init=0.03, res_init_diag=0.7)]
          if n > 1 else []),
    ]


@pytest.mark.parametrize("n, k", [(1, 0), (3, 4), (4, 2)])
def test_meta_build_then_reset_equals_eager_build(n, k):
    """Built on the meta device, moved with to_empty (uninitialised memory) and reset: the
    same values, bit for bit, as the eager constructor; a perturbed connection returns there."""
    eager = _connections(n, k)
    with torch.device("meta"):
        lazy = _connections(n, k)
    for e, m in zip(eager, lazy, strict=True):
        assert all(t.is_meta for t in _own_state(m).values())
        m.to_empty(device="cpu")
        with torch.no_grad():
            for t in _own_state(m).values():
                t.fill_(float("nan"))  # what to_empty might leave behind
        m.reset_parameters()
        ref, got = _own_state(e), _own_state(m)
        assert got.keys() == ref.keys()
        for name in ref:
            assert torch.equal(got[name], ref[name]), f"{type(e).__name__}.{name}"
        with torch.no_grad():
            for p in e.parameters():
                p.add_(0.5)
        e.reset_parameters()
        for name, t in _own_state(e).items():
            assert torch.equal(t, ref[name]), f"{type(e).__name__}.{name} after reset"


def test_reset_keeps_dtype_and_documented_values():
    """bf16 parameters get the documented values rounded once; the n = 4 mHC initial maps are
    the exact weights of the module docstring (0.625 and 0.125 are exact in binary)."""
    conn = ManifoldHyperConnection(8, 4, 1, nn.Identity()).to(torch.bfloat16)
    conn.reset_parameters()
    assert conn.b_pre.dtype == torch.bfloat16
    fp32 = ManifoldHyperConnection(8, 4, 1, nn.Identity())
    h_pre, h_post, h_res = fp32.maps(torch.randn(2, 4, 8))
    expected_pre = torch.tensor([0.125, 0.625, 0.125, 0.125])
    torch.testing.assert_close(h_pre[0], expected_pre, rtol=0, atol=1e-6)
    torch.testing.assert_close(h_post[0], torch.ones(4), rtol=0, atol=1e-6)
    torch.testing.assert_close(h_res[0], torch.eye(4) / 2 + 0.125, rtol=0, atol=1e-6)


def test_hc_scales_load_from_scalar_checkpoints():
    """Older checkpoints hold HC's s_alpha, s_beta as 0-dim tensors: they still load."""
    conn = HyperConnection(6, 2, 0, nn.Identity())
    state = conn.state_dict()
    state["s_alpha"], state["s_beta"] = torch.tensor(0.25), torch.tensor(0.5)
    conn.load_state_dict(state)
    assert conn.s_alpha.tolist() == [0.25] and conn.s_beta.tolist() == [0.5]


@pytest.mark.parametrize("cls", [HyperConnection, ManifoldHyperConnection])
def test_compiled_block_traces_the_impl_lookup_in_one_graph(cls, monkeypatch):
    """torch.compile(fullgraph=True) of a connection wrapping a block: one graph (no break in
    the implementation lookup, even when the implementation is first loaded inside the trace),
    same output and gradients as eager."""
    torch.manual_seed(0)
    conn = cls(16, 4, 1, nn.Sequential(nn.Linear(16, 16), nn.GELU()))
    with torch.no_grad():
        for p in conn.parameters():
            p.add_(0.05 * torch.randn_like(p))  # maps away from their exact start
    x = torch.randn(2, 20, 4, 16)
    monkeypatch.setattr(ops, "_loaded", {})  # the lookup's first load happens while tracing
    torch._dynamo.reset()
    compiled = torch.compile(conn, fullgraph=True, backend="aot_eager")
    xc = x.clone().requires_grad_()
    out_c = compiled(xc)
    out_c.pow(2).sum().backward()
    grads_c = [p.grad.clone() for p in conn.parameters()]
    conn.zero_grad()
    xe = x.clone().requires_grad_()
    out_e = conn(xe)
    out_e.pow(2).sum().backward()
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-5, atol=1e-6)
    for gc, p in zip(grads_c, conn.parameters(), strict=True):
        torch.testing.assert_close(gc, p.grad, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


# --- meta build, FSDP2 on 2 processes --------------------------------------------------------


def _eager_reference(kind: str) -> dict:
    model = W.build(kind)
    h, target = W.batch()
    loss = W.loss_of(model, h, target)
    loss.backward()
    return {
        "state": {n: p.detach() for n, p in model.named_parameters()},
        "buffers": dict(model.named_buffers()),
        "loss": loss.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters()},
    }


@pytest.mark.distributed
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                    reason="torch.distributed with the gloo backend is not available")
def test_meta_build_sharded_by_fsdp2_initialises_like_the_eager_model(tmp_path):
    """A stack of 4 connections (residual, HC, mHC) built on the meta device, sharded with
    fully_shard on 2 gloo processes, materialised with to_empty and initialised by
    reset_parameters (every parameter then a DTensor shard): the gathered parameters equal the
    eagerly built model's bit for bit; the loss on a batch split over the ranks and the
    averaged gradients equal the single-process ones (summation order aside: rtol 1e-5, the
    tolerance tests/lm/test_parallel.py justifies)."""
    cmd = launch_helpers.torchrun(str(WORKER), str(tmp_path))
    code, out = launch_helpers.run(cmd, 150, "meta/FSDP2 worker")
    assert code == 0, out[-6000:]
    ranks = [torch.load(tmp_path / f"meta_rank{r}.pt") for r in range(2)]
    for kind in W.KINDS:
        ref = _eager_reference(kind)
        got = [r[kind] for r in ranks]
        assert len(got[0]["sharded"]) == len(ref["state"])  # every parameter was a DTensor
        assert got[0]["state"].keys() == ref["state"].keys()
        for name, value in ref["state"].items():
            assert torch.equal(got[0]["state"][name], value), f"{kind}: {name}"
        for name, value in ref["buffers"].items():
            assert torch.equal(got[0]["buffers"][name], value), f"{kind}: buffer {name}"
        loss = (got[0]["loss"] + got[1]["loss"]) / 2  # equal halves of the batch
        torch.testing.assert_close(loss, ref["loss"], rtol=1e-5, atol=0.0)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(got[0]["grads"][name], g, rtol=1e-5,
                                       atol=1e-6 * g.abs().max().item(),
                                       msg=lambda m, n=name, k=kind: f"{k} grad {n}: {m}")


@pytest.mark.parametrize("impl", ["auto", "reference", "cpu", "inductor"])
@pytest.mark.parametrize("kind", ["residual", "hc", "mhc", "mhc-lite", "kromhc",
                                  "mhc-static-res"])
def test_every_kind_runs_on_meta_tensors_and_fake_tensors(kind, impl):
    """Shape propagation without data (a meta-device dry run, FakeTensorMode as tracers use
    it): mHC's Sinkhorn cannot choose its domain per matrix from the data there (Tensor.item()
    on meta, DataDependentOutputException under fake tensors) and takes its data-free path,
    and the successors' tables follow the logits' device; the inductor ops run their
    reference functions uncompiled (torch.compile failed on both). Forward and backward run;
    only shapes and devices exist to compare."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import torch_mhc

    n = 1 if kind == "residual" else 4
    conn = torch_mhc.make_connection(kind, 16, n, 3, nn.Linear(16, 16), impl=impl)
    meta = conn.to("meta")
    x = torch.randn(2, 3, n, 16, device="meta", requires_grad=True)
    out = meta(x)
    out.sum().backward()
    assert out.is_meta and out.shape == x.shape and x.grad.shape == x.shape
    conn = torch_mhc.make_connection(kind, 16, n, 3, nn.Linear(16, 16), impl=impl)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = conn(torch.randn(2, 3, n, 16))
    assert type(out).__name__ == "FakeTensor" and out.shape == (2, 3, n, 16)
