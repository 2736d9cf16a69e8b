"""Every implementation on an empty batch (forward and backward) and with bad scalars.

An empty batch ([0, T, n, C], e.g. a filtered micro-batch) gives empty maps and outputs and
zero parameter gradients. sinkhorn_iters < 1, a negative or non-finite epsilon, and
norm_eps <= 0 are refused with a ValueError by the ops themselves (ops/checks.py), not only
by the modules. The triton implementation runs these in the interpreter process of
tests/ops/test_triton.py (its test_empty_batches_* and test_bad_scalars_*).
"""

import pytest
import torch

import torch_mhc.ops as ops
from tests.helpers.op_cases import maps_inputs, merge_inputs


def _grads(outs, ins):
    outs = [o for o in outs if o is not None and o.requires_grad]
    ups = [torch.ones_like(o) for o in outs]
    return torch.autograd.grad(outs, ins, ups, allow_unused=True, materialize_grads=True)


def check_empty_batch(impl, device="cpu"):
    """Forward and backward of every op of `impl` on [0, 3, n, C] inputs."""
    n, c = 4, 8
    ins = [t.detach().to(device).requires_grad_() for t in maps_inputs((0, 3), n, c,
                                                                        torch.float32)]
    h_pre, h_post, h_res = impl.mhc_maps(*ins, sinkhorn_iters=3)
    assert h_pre.shape == (0, 3, n) and h_res.shape == (0, 3, n, n)
    grads = _grads([h_pre, h_post, h_res], ins)
    assert grads[0].shape == ins[0].shape
    for g, p in zip(grads[1:], ins[1:], strict=True):
        assert g.shape == p.shape and not g.abs().any()
    outs = impl.mhc_maps_pre(*ins, sinkhorn_iters=3)
    assert outs[3].shape == (0, 3, c)
    _grads(list(outs[:4]), ins)
    x, f, h_pre, h_post, h_res = [t.detach().to(device).requires_grad_()
                                  for t in merge_inputs((0, 3), n, c, torch.float32)]
    agg = impl.pre_aggregate(x, h_pre)
    merged = impl.post_merge(x, f, h_post, h_res)
    assert agg.shape == (0, 3, c) and merged.shape == x.shape
    _grads([agg, merged], [x, f, h_pre, h_post, h_res])
    logits = torch.zeros(0, n, n, device=device, requires_grad=True)
    out = impl.sinkhorn(logits, 3)
    assert out.shape == (0, n, n)
    _grads([out], [logits])


def check_bad_scalars(impl, device="cpu"):
    ins = [t.detach().to(device) for t in maps_inputs((2,), 4, 8, torch.float32)]
    bad_maps = [dict(sinkhorn_iters=0), dict(sinkhorn_iters=-1), dict(norm_eps=0.0),
                dict(norm_eps=-1e-6), dict(norm_eps=float("nan")), dict(sinkhorn_eps=-1e-3),
                dict(sinkhorn_eps=float("inf")), dict(pre_eps=-1e-3),
                dict(pre_eps=float("nan"))]
    for kw in bad_maps:
        name = next(iter(kw))
        for fn in (impl.mhc_maps, impl.mhc_maps_pre):
            with pytest.raises(ValueError, match=rf"expects {name} to be"):
                fn(*ins, **kw)
    logits = torch.randn(2, 4, 4, device=device)
    with pytest.raises(ValueError, match="expects iters to be an integer >= 1, got 0"):
        impl.sinkhorn(logits, 0)
    with pytest.raises(ValueError, match="expects eps to be a finite number >= 0"):
        impl.sinkhorn(logits, 3, eps=-1.0)
    x = ins[0]
    hc = (torch.randn(8, 6, device=device), torch.tensor(1.0, device=device),
          torch.tensor(1.0, device=device), torch.ones(4, device=device),
          torch.ones(4, device=device), torch.eye(4, device=device))
    for fn in (impl.hc_maps, impl.hc_maps_pre):
        with pytest.raises(ValueError, match="expects norm_eps to be a finite number > 0"):
            fn(x, *hc, norm_eps=0.0)


@pytest.mark.parametrize("name", ["reference", "cpu", "inductor"])
def test_empty_batches_run_forward_and_backward(name):
    check_empty_batch(ops.get_impl(name))


@pytest.mark.parametrize("name", ["reference", "cpu", "inductor"])
def test_bad_scalars_are_refused_by_the_ops(name):
    # Refused before anything compiles: cheap for inductor too.
    check_bad_scalars(ops.get_impl(name))


@pytest.mark.parametrize("grad", [True, False])
def test_misshapen_parameters_are_refused_by_the_cpu_ops(grad):
    """The native loops index phi and the static maps by n and C without bounds: a parameter
    of another shape is one ValueError naming it, with or without autograd (decoding)."""
    cpu = ops.get_impl("cpu")
    ins = [t.detach().requires_grad_(grad) for t in maps_inputs((2,), 4, 8, torch.float32)]
    x, phi, alpha, b_pre, b_post, b_res = ins
    cases = {"phi": (phi[:-1], alpha, b_pre, b_post, b_res),
             "alpha": (phi, alpha[:2], b_pre, b_post, b_res),
             "b_res": (phi, alpha, b_pre, b_post, b_res[:, :3])}
    for name, params in cases.items():
        for fn in (cpu.mhc_maps, cpu.mhc_maps_pre):
            with pytest.raises(ValueError, match=rf"expects {name} of shape"):
                fn(x, *params, sinkhorn_iters=3)
    w, one = torch.randn(8, 6), torch.tensor(1.0)
    hc_cases = {"w": (w[:, :5], one, one, torch.ones(4), torch.ones(4), torch.eye(4)),
                "static_pre": (w, one, one, torch.ones(3), torch.ones(4), torch.eye(4)),
                "s_beta": (w, one, torch.ones(2), torch.ones(4), torch.ones(4), torch.eye(4))}
    for name, params in hc_cases.items():
        for fn in (cpu.hc_maps, cpu.hc_maps_pre):
            with pytest.raises(ValueError, match=rf"expects {name} (of shape|to hold)"):
                fn(x, *params)
