"""Plain reference implementations the library is tested against (written for reading,
not speed): one matrix, one token at a time, straight from the papers' equations."""

from __future__ import annotations

import torch


def sinkhorn_naive(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """mHC paper Eq. 9 on a batch of n x n matrices, one matrix at a time, with autograd."""
    out = []
    for h in logits.reshape(-1, *logits.shape[-2:]):
        m = torch.exp(h - h.max())
        for _ in range(iters):
            m = m / m.sum(dim=0, keepdim=True)  # columns
            m = m / m.sum(dim=1, keepdim=True)  # rows
        out.append(m)
    return torch.stack(out).reshape(logits.shape)


def mhc_layer_naive(x, phi, alpha, b_pre, b_post, b_res, branch, iters=20, norm_eps=1e-6):
    """mHC layer (paper Eq. 3, 7-9) for streams x [T, n, C], one token at a time."""
    tokens, n, c = x.shape
    outs = []
    for t in range(tokens):
        xl = x[t]  # [n, C]
        v = xl.reshape(n * c)
        rms = torch.sqrt((v * v).mean() + norm_eps)
        vn = v / rms  # RMSNorm (weight folded into phi)
        h_pre = torch.sigmoid(alpha[0] * (vn @ phi[:, :n]) + b_pre)
        h_post = 2 * torch.sigmoid(alpha[1] * (vn @ phi[:, n : 2 * n]) + b_post)
        h_res = sinkhorn_naive(alpha[2] * (vn @ phi[:, 2 * n :]).reshape(n, n) + b_res, iters)
        f = branch(h_pre @ xl)  # [C]
        rows = [sum(h_res[i, j] * xl[j] for j in range(n)) + h_post[i] * f for i in range(n)]
        outs.append(torch.stack(rows))
    return torch.stack(outs)


def hc_layer_naive(x, w, s_alpha, s_beta, a_m, b, a_r, branch, norm_eps=1e-6):
    """Dynamic HC layer in the HC paper's own notation (Eq. 10-13), tokens x [T, n, C].

    H_hat = B(H)^T F(A_m(H)^T H) + A_r(H)^T H, with
    B(H) = s_beta * tanh(Hn W_beta)^T + B, A_m(H) = s_alpha * tanh(Hn W_m) + A_m,
    A_r(H) = s_alpha * tanh(Hn W_r) + A_r, Hn the per-stream normalised H.
    w = [W_beta | W_m | W_r]: [C, 2 + n]; b: [1, n]; a_m: [n, 1]; a_r: [n, n].
    """
    outs = []
    for hmat in x:  # [n, C]
        hn = hmat / torch.sqrt((hmat * hmat).mean(dim=-1, keepdim=True) + norm_eps)
        b_dyn = s_beta * torch.tanh(hn @ w[:, :1]).T + b  # [1, n]
        am_dyn = s_alpha * torch.tanh(hn @ w[:, 1:2]) + a_m  # [n, 1]
        ar_dyn = s_alpha * torch.tanh(hn @ w[:, 2:]) + a_r  # [n, n]
        h0 = am_dyn.T @ hmat  # [1, C]
        outs.append(b_dyn.T @ branch(h0) + ar_dyn.T @ hmat)
    return torch.stack(outs)


def sinkhorn_log_naive(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """mHC paper Eq. 9 evaluated in the log domain in float64, one matrix at a time, with
    autograd: the same unrolled function (columns, then rows, iters times) without underflow.
    """
    out = []
    for h in logits.reshape(-1, *logits.shape[-2:]).double():
        z = h
        for _ in range(iters):
            z = z - torch.logsumexp(z, dim=0, keepdim=True)  # columns
            z = z - torch.logsumexp(z, dim=1, keepdim=True)  # rows
        out.append(z.exp())
    return torch.stack(out).reshape(logits.shape)
