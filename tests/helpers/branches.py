"""Pre-norm branch modules for connection-level tests, and a parameter perturbation."""

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Pre-norm MLP branch [..., C] -> [..., C]."""

    def __init__(self, c, std=0.02):
        super().__init__()
        self.norm = nn.RMSNorm(c)
        self.up, self.down = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        for p in (self.up.weight, self.down.weight):
            nn.init.normal_(p, std=std)

    def forward(self, h):
        return self.down(F.gelu(self.up(self.norm(h))))


class Attention(nn.Module):
    """Pre-norm causal self-attention branch [B, T, C] -> [B, T, C]."""

    def __init__(self, c, heads=4, std=0.02):
        super().__init__()
        self.norm, self.heads = nn.RMSNorm(c), heads
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        for p in (self.qkv.weight, self.proj.weight):
            nn.init.normal_(p, std=std)

    def forward(self, h):
        b, t, c = h.shape
        q, k, v = self.qkv(self.norm(h)).view(b, t, 3, self.heads, -1).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def perturb(module, scale=0.5, seed=0):
    """Move every parameter away from its initial value (in place)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
