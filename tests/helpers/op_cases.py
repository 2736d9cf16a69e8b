"""Op test cases shared by the implementation tests (cpu, triton, inductor).

Inputs with O(1) logits on awkward shapes, random upstream gradients, and a scale-aware
comparison: every implementation is held to `functional.maps` with these.
"""

import torch

# Gradients of bf16 tensors are rounded to bf16 (8 bits): allow a few roundings of the
# largest entry. fp32: both sides compute the same float32 maths in a different order.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}


def assert_close(actual, expected, tol):
    """|actual - expected| <= tol * max|expected|, elementwise (scale-aware for bf16)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.double(), expected.double()
    scale = e.abs().max().clamp_min(1e-30)
    err = (a - e).abs().max() / scale
    assert err <= tol, f"relative max error {err.item():.3g} > {tol}"


def maps_inputs(tokens, n, c, dtype, seed=0):
    """Streams x [*tokens, n, C] and mHC parameters with O(1) logits (all requiring grad)."""
    g = torch.Generator().manual_seed(seed)
    m = n * n + 2 * n
    x = torch.randn(*tokens, n, c, generator=g).to(dtype)
    phi = torch.randn(n * c, m, generator=g) / (n * c) ** 0.5
    alpha = torch.tensor([0.8, 1.1, 1.5])
    b_pre, b_post = torch.randn(n, generator=g) * 0.5, torch.randn(n, generator=g) * 0.5
    b_res = torch.randn(n, n, generator=g) * 0.5
    return [t.requires_grad_() for t in (x, phi, alpha, b_pre, b_post, b_res)]


def run(fn, inputs, seed=1, upstream_dtype=None):
    """Outputs of fn(*inputs) and grads of all inputs for random upstream gradients.

    upstream_dtype rounds the upstream gradients first (to compare a half-precision run
    with a float32 reference on the same values).
    """
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(seed)
    grads_out = [torch.randn(o.shape, generator=g).to(upstream_dtype or o.dtype).to(o.dtype)
                 for o in outs]
    grads_in = torch.autograd.grad(outs, inputs, grads_out)
    return [o.detach() for o in outs], grads_in


def clone_inputs(inputs):
    return [t.detach().clone().requires_grad_() for t in inputs]


def merge_inputs(tokens, n, c, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*tokens, n, c, generator=g).to(dtype)
    f = torch.randn(*tokens, c, generator=g).to(dtype)
    h_pre = torch.rand(*tokens, n, generator=g)
    h_post = 2 * torch.rand(*tokens, n, generator=g)
    h_res = torch.softmax(torch.randn(*tokens, n, n, generator=g), dim=-1)
    return [t.requires_grad_() for t in (x, f, h_pre, h_post, h_res)]


class Branch(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.lin = torch.nn.Linear(c, c)

    def forward(self, h):
        return torch.tanh(self.lin(h))


def perturbed(conn, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in conn.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return conn


def reference_and(impl, c, n, sinkhorn_iters):
    """A perturbed reference connection and one of `impl` holding the same parameters."""
    from torch_mhc import ManifoldHyperConnection

    torch.manual_seed(0)
    ref = perturbed(ManifoldHyperConnection(c, n, 1, Branch(c), sinkhorn_iters=sinkhorn_iters,
                                            impl="reference"))
    other = ManifoldHyperConnection(c, n, 1, Branch(c), sinkhorn_iters=sinkhorn_iters, impl=impl)
    other.load_state_dict(ref.state_dict())
    return ref, other


def compiled_and_eager(fn, x, upstream, monkeypatch, functions=()):
    """((out, grad) eager, (out, grad) compiled) of fn on x for the upstream gradient: eager
    first, then under torch.compile (aot_eager, fullgraph) with the forward of each autograd
    Function class in `functions` replaced by one that raises (the compiled graph must not
    run them)."""
    def grad_of(f):
        xi = x.clone().requires_grad_()
        out = f(xi)
        return out, torch.autograd.grad(out, xi, upstream)[0]

    eager = grad_of(fn)

    def refuse(*args):
        raise AssertionError("an autograd function ran under torch.compile")

    for cls in functions:
        monkeypatch.setattr(cls, "forward", staticmethod(refuse))
    torch._dynamo.reset()
    try:
        compiled = grad_of(torch.compile(fn, backend="aot_eager", fullgraph=True))
    finally:
        torch._dynamo.reset()
    return eager, compiled
