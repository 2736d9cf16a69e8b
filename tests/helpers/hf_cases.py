"""Cases shared by the Hugging Face tests: a tiny Llama-like config, a padded batch, the logit
comparison and a perturbation of the connections. Import after
pytest.importorskip("transformers"): torch_mhc.hf imports transformers.

Weights are drawn at initializer_range 0.2 (not transformers' 0.02) so that every branch
changes the residual stream substantially and a wrong connection shows in the logits.
"""

from __future__ import annotations

import torch

import torch_mhc.hf as mhc_hf

V = 64  # vocabulary
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
REL = 1e-5  # fp32 logit parity at conversion: max |diff| / max |ref|


def batch(seed: int = 1):
    """Token ids [3, 12] with left padding in row 0 and right padding in row 1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[1, -3:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def perturb_connections(model, seed: int = 5, scale: float = 0.3):
    """Move every connection parameter off its initial value (so a wrong one shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in mhc_hf.connection_parameters(model):
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
