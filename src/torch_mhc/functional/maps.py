"""The maths of HC and mHC in plain torch: the readable definition and the test oracle.

Conventions: streams x have shape [..., n, C]; per token a connection produces
H_pre [..., n], H_post [..., n] and H_res [..., n, n], and the layer computes (paper Eq. 3)

    out[..., i, :] = sum_j H_res[i, j] x[..., j, :] + H_post[i] F(sum_j H_pre[j] x[..., j, :])

Maps are computed in float32 (float64 stays float64) whatever the streams' dtype; the
aggregation and the merge run in the streams' dtype.
"""

from __future__ import annotations

import torch

from .sinkhorn import compute_dtype as _maps_dtype
from .sinkhorn import sinkhorn


def mhc_maps(
    x: torch.Tensor,
    phi: torch.Tensor,
    alpha: torch.Tensor,
    b_pre: torch.Tensor,
    b_post: torch.Tensor,
    b_res: torch.Tensor,
    sinkhorn_iters: int = 20,
    norm_eps: float = 1e-6,
    sinkhorn_eps: float = 0.0,
    pre_eps: float = 0.0,
):
    """mHC maps, paper Eq. 7-9 with the section 4.3 reordering (normalise after the matmul).

    x: [..., n, C]; phi: [n*C, n*n + 2n] (columns: pre, post, then res row-major);
    alpha: [3] (alpha_pre, alpha_post, alpha_res); b_pre, b_post: [n]; b_res: [n, n].
    Returns H_pre [..., n], H_post [..., n], H_res [..., n, n] in float32.
    """
    n = x.shape[-2]
    h_pre, h_post, rest = read_write_maps(x, phi, alpha, b_pre, b_post, norm_eps)
    res_logits = rest.unflatten(-1, (n, n)) + b_res.to(rest.dtype)  # [..., n, n]
    h_res = sinkhorn(res_logits, sinkhorn_iters, eps=sinkhorn_eps)
    return h_pre + pre_eps, h_post, h_res


def read_write_maps(x, phi, alpha, b_pre, b_post, norm_eps=1e-6):
    """mHC's H_pre [..., n], H_post [..., n] and the remaining scaled logits [..., R]
    (no pre_eps; shared by mhc_maps and mHC's successors in torch_mhc.connections.successors).

    x: [..., n, C]; phi: [n*C, 2n + R]; alpha: [2] or [3] (the third scales the res logits).
    """
    n = x.shape[-2]
    dt = _maps_dtype(x.dtype)
    v = x.flatten(-2).to(dt)  # [..., n*C]
    r = torch.sqrt(v.square().mean(dim=-1, keepdim=True) + norm_eps)  # [..., 1] RMS over n*C
    logits = (v @ phi.to(dt)) / r  # [..., 2n + R], one matmul, divide after
    a = alpha.to(dt)
    h_pre = torch.sigmoid(a[0] * logits[..., :n] + b_pre.to(dt))
    h_post = 2.0 * torch.sigmoid(a[1] * logits[..., n : 2 * n] + b_post.to(dt))
    rest = a[2] * logits[..., 2 * n :] if a.numel() > 2 else logits[..., 2 * n :]
    return h_pre, h_post, rest


def hc_maps(
    x: torch.Tensor,
    w: torch.Tensor | None,
    s_alpha: torch.Tensor,
    s_beta: torch.Tensor,
    static_pre: torch.Tensor,
    static_post: torch.Tensor,
    static_res: torch.Tensor,
    norm_eps: float = 1e-6,
):
    """HC maps (HC paper, Eq. 10-13), written in this library's convention.

    The HC paper's A_m is H_pre, its B is H_post and its A_r is H_res transposed: stream j's
    dynamic row tanh(norm(x_j) W_r) is column j of H_res here.
    x: [..., n, C]; w: [C, 2 + n] (columns: beta, m, r...) or None for static HC;
    s_alpha, s_beta: scalars; static_pre, static_post: [n]; static_res: [n, n].
    """
    dt = _maps_dtype(x.dtype)
    h_pre, h_post, h_res = static_pre.to(dt), static_post.to(dt), static_res.to(dt)
    if w is None:
        shape = x.shape[:-2]
        return h_pre.expand(*shape, -1), h_post.expand(*shape, -1), h_res.expand(*shape, -1, -1)
    xd = x.to(dt)
    xn = xd * torch.rsqrt(xd.square().mean(dim=-1, keepdim=True) + norm_eps)  # per stream
    d = torch.tanh(xn @ w.to(dt))  # [..., n, 2 + n]
    return hc_maps_from_tanh(d, s_alpha, s_beta, h_pre, h_post, h_res)


def hc_maps_from_tanh(d, s_alpha, s_beta, static_pre, static_post, static_res):
    """HC's maps from d = tanh(norm(x_j) W) [..., n, 2 + n] (columns beta, m, r...), in d's
    dtype: H_post = static + s_beta d_beta, H_pre = static + s_alpha d_m, H_res = static +
    s_alpha d_r^T (stream j's row is column j)."""
    dt = d.dtype
    h_post = static_post.to(dt) + s_beta.to(dt) * d[..., 0]
    h_pre = static_pre.to(dt) + s_alpha.to(dt) * d[..., 1]
    h_res = static_res.to(dt) + s_alpha.to(dt) * d[..., 2:].transpose(-1, -2)
    return h_pre, h_post, h_res


def pre_aggregate(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    """sum_j H_pre[j] x[j]: [..., n, C], [..., n] -> [..., C] in x's dtype."""
    return (h_pre.to(x.dtype).unsqueeze(-2) @ x).squeeze(-2)


def post_merge(
    x: torch.Tensor, f: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor
) -> torch.Tensor:
    """H_res x + H_post^T f: [..., n, C], [..., C], [..., n], [..., n, n] -> [..., n, C]."""
    return h_res.to(x.dtype) @ x + h_post.to(x.dtype).unsqueeze(-1) * f.unsqueeze(-2)


def check_merge_shapes(
    x: torch.Tensor, f: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor
) -> None:
    """Raise one clear ValueError when post_merge's operands do not fit x [..., n, C]."""
    lead, (n, c) = tuple(x.shape[:-2]), x.shape[-2:]
    expected = {"f": (*lead, c), "h_post": (*lead, n), "h_res": (*lead, n, n)}
    for name, tensor in (("f", f), ("h_post", h_post), ("h_res", h_res)):
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"post_merge expects {name} of shape {expected[name]} for x of shape "
                f"{tuple(x.shape)}, got {tuple(tensor.shape)}"
            )
