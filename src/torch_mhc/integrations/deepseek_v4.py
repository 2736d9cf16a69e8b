"""Parameters of Hugging Face DeepSeek-V4's `DeepseekV4HyperConnection` <-> ManifoldHyperConnection.

DeepSeek-V4 (transformers `models/deepseek_v4`) holds one mHC map generator per block with
three parameters, for n = hc_mult streams of width C = hidden_size:

    fn    [(2+n)*n, n*C]   rows: pre (n), post (n), comb (n*n, row-major comb[j, i])
    base  [(2+n)*n]        the same order
    scale [3]              (pre, post, comb)

and computes, per token, from the flattened streams v = flatten(x) [n*C]:

    logits = F.linear(v * rsqrt(mean(v**2) + rms_norm_eps), fn)
    pre    = sigmoid(scale[0] * logits[:n]   + base[:n]) + hc_eps
    post   = 2 * sigmoid(scale[1] * logits[n:2n] + base[n:2n])
    comb   = softmax(scale[2] * mat(logits[2n:]) + mat(base[2n:]), dim=-1) + hc_eps,
             then comb /= colsum + hc_eps, then (hc_sinkhorn_iters - 1) x (row, column) steps
    out    = post[:, None] * F(collapsed)[None, :] + comb^T @ x,  collapsed = sum_j pre[j] x[j]

Compatibility mode. ManifoldHyperConnection reproduces this exactly when built with
`norm_eps = rms_norm_eps`, `pre_eps = hc_eps`, `sinkhorn_eps = hc_eps` and
`sinkhorn_iters = hc_sinkhorn_iters` (the paper's algorithm has no eps in H_pre or in
Sinkhorn; DeepSeek-V4 adds them). The RMS normalisation is the same function; this library
divides the matmul's result by sqrt(mean(v**2) + eps) where DeepSeek-V4 multiplies v by
rsqrt(...) before the matmul, which differs only by rounding (measured in float64 on random
inputs: at most 2e-15 absolute on logits of size ~3). The branch given to the connection
must include what DeepSeek-V4 applies to `collapsed` before the block, e.g.
`lambda h: attn(layer.input_layernorm(h))`.

The transposition. DeepSeek-V4 consumes comb transposed (comb^T @ x: output stream i
receives sum_j comb[j, i] x[j]), and its Sinkhorn normalises comb's rows first. This
library's H_res acts as H_res @ x, so H_res = comb^T, and the conversion transposes every
n x n block:

    phi[:, c]        = fn[c, :]                 for the pre and post columns c < 2n
    phi[:, 2n+i*n+j] = fn[2n+j*n+i, :]          so that mat(logits)[i, j] = comb_logits[j, i]
    alpha            = scale
    b_pre, b_post    = base[:n], base[n:2n]
    b_res            = mat(base[2n:])^T

torch_mhc.sinkhorn(..., eps) run on the transposed logits performs exactly DeepSeek-V4's
steps in transposed form (column softmax, row step, then (column, row) pairs). The mapping is
a permutation, so gradients map the same way as the parameters.

The eps values and the iteration count live in DeepSeek-V4's config, not in its state dict:
`to_deepseek_v4_state_dict` returns only fn, base and scale, and the model receiving them
reproduces the module when its config has hc_eps = pre_eps = sinkhorn_eps,
rms_norm_eps = norm_eps and hc_sinkhorn_iters = sinkhorn_iters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import nn

from torch_mhc.connections import ManifoldHyperConnection
from torch_mhc.connections.stream_head import StreamHead

__all__ = [
    "column_order",
    "from_deepseek_v4",
    "from_deepseek_v4_head",
    "load_deepseek_v4_head_state_dict",
    "load_deepseek_v4_state_dict",
    "to_deepseek_v4_head_state_dict",
    "to_deepseek_v4_state_dict",
]

_KEYS = ("fn", "base", "scale")


def column_order(n: int) -> torch.Tensor:
    """Index p with phi[:, c] = fn[p[c], :]: identity on pre/post, n x n transpose on res.

    A transposition is its own inverse, so the same index also gives fn[r, :] = phi[:, p[r]].
    """
    res = torch.arange(n * n).view(n, n).T.reshape(-1) + 2 * n  # 2n + i*n + j -> 2n + j*n + i
    return torch.cat([torch.arange(2 * n), res])


def _streams_from_width(width: int) -> int | None:
    """n with (2 + n) * n == width, or None."""
    n = round(math.sqrt(1 + width)) - 1
    return n if n >= 1 and (2 + n) * n == width else None


def _read_state_dict(state_dict: Mapping[str, torch.Tensor], prefix: str) -> dict:
    missing = [prefix + k for k in _KEYS if prefix + k not in state_dict]
    if missing:
        got = sorted(state_dict.keys())
        shown = got if len(got) <= 10 else got[:10] + [f"... ({len(got)} keys)"]
        raise KeyError(
            f"DeepSeek-V4 hyper-connection state dict: expected keys "
            f"{[prefix + k for k in _KEYS]}, missing {missing}; got {shown}"
        )
    out = {}
    for k in _KEYS:
        t = state_dict[prefix + k]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{prefix + k}: expected a torch.Tensor, got {type(t).__name__}")
        out[k] = t
    return out


def _check_shapes(tensors: dict, n: int, dim: int, prefix: str) -> None:
    expected = {"fn": ((2 + n) * n, n * dim), "base": ((2 + n) * n,), "scale": (3,)}
    for k in _KEYS:
        got = tuple(tensors[k].shape)
        if got != expected[k]:
            raise ValueError(
                f"DeepSeek-V4 hyper-connection parameter {prefix + k!r}: expected shape "
                f"{expected[k]} for hc_mult={n}, hidden_size={dim}, got {got}"
            )


def load_deepseek_v4_state_dict(
    mhc: ManifoldHyperConnection,
    state_dict: Mapping[str, torch.Tensor],
    hc_eps: float,
    rms_norm_eps: float,
    *,
    prefix: str = "",
) -> ManifoldHyperConnection:
    """Copy a DeepseekV4HyperConnection's fn, base, scale into `mhc`, in place.

    Also sets the compatibility eps (pre_eps = sinkhorn_eps = hc_eps, norm_eps = rms_norm_eps).
    `mhc.sinkhorn_iters` is left as it is: build `mhc` with the config's hc_sinkhorn_iters.
    Keys are `prefix + "fn"` etc. (e.g. prefix="model.layers.0.attn_hc." for a whole model).
    Values are cast to the dtype and device of mhc's parameters. Returns `mhc`.
    """
    if not isinstance(mhc, ManifoldHyperConnection):
        raise TypeError(f"expected a ManifoldHyperConnection, got {type(mhc).__name__}")
    n, dim = mhc.streams, mhc.dim
    tensors = _read_state_dict(state_dict, prefix)
    _check_shapes(tensors, n, dim, prefix)
    order = column_order(n).to(tensors["fn"].device)
    base = tensors["base"]
    with torch.no_grad():
        mhc.phi.copy_(tensors["fn"][order].T)  # [n*C, n*n + 2n]
        mhc.alpha.copy_(tensors["scale"])
        mhc.b_pre.copy_(base[:n])
        mhc.b_post.copy_(base[n : 2 * n])
        mhc.b_res.copy_(base[2 * n :].view(n, n).T)  # H_res = comb^T
    mhc.pre_eps, mhc.sinkhorn_eps, mhc.norm_eps = float(hc_eps), float(hc_eps), float(rms_norm_eps)
    return mhc


def to_deepseek_v4_state_dict(
    mhc: ManifoldHyperConnection, *, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """The inverse of `load_deepseek_v4_state_dict`: {"fn", "base", "scale"} as new tensors.

    The receiving DeepSeek-V4 config must have hc_mult = mhc.streams,
    hidden_size = mhc.dim, hc_sinkhorn_iters = mhc.sinkhorn_iters, and for an exact match
    hc_eps = mhc.pre_eps = mhc.sinkhorn_eps and rms_norm_eps = mhc.norm_eps.
    """
    if not isinstance(mhc, ManifoldHyperConnection):
        raise TypeError(f"expected a ManifoldHyperConnection, got {type(mhc).__name__}")
    n = mhc.streams
    with torch.no_grad():
        order = column_order(n).to(mhc.phi.device)
        fn = mhc.phi.T[order]  # [(2+n)*n, n*C], a new tensor (advanced indexing copies)
        base = torch.cat([mhc.b_pre, mhc.b_post, mhc.b_res.T.reshape(-1)])  # [(2+n)*n]
        scale = mhc.alpha.detach().clone()
    return {prefix + "fn": fn, prefix + "base": base, prefix + "scale": scale}


def from_deepseek_v4(
    hc_module_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    branch: Callable,
    layer_index: int = 0,
    *,
    hidden_size: int | None = None,
    hc_mult: int | None = None,
    sinkhorn_iters: int | None = None,
    hc_eps: float | None = None,
    rms_norm_eps: float | None = None,
    prefix: str = "",
) -> ManifoldHyperConnection:
    """A ManifoldHyperConnection computing what a DeepseekV4HyperConnection computes.

    Given the module, hc_mult, hc_sinkhorn_iters, hc_eps and rms_norm_eps are read from it
    (a keyword that disagrees with the module is an error). Given a state dict, hc_mult and
    hidden_size are inferred from the shapes, and sinkhorn_iters, hc_eps and rms_norm_eps
    must be passed (from the model's config: hc_sinkhorn_iters, hc_eps, rms_norm_eps).
    `branch` is the block F, including the norm DeepSeek-V4 applies to `collapsed`.
    The result has the module's parameter dtype and device (state dict: the tensors').
    """
    given = {
        "hidden_size": hidden_size, "hc_mult": hc_mult, "sinkhorn_iters": sinkhorn_iters,
        "hc_eps": hc_eps, "rms_norm_eps": rms_norm_eps,
    }
    if isinstance(hc_module_or_state_dict, nn.Module):
        module = hc_module_or_state_dict
        found = _settings_of_module(module, given)
        state_dict, prefix = {k: getattr(module, k) for k in _KEYS}, ""
    elif isinstance(hc_module_or_state_dict, Mapping):
        state_dict = hc_module_or_state_dict
        found = _settings_of_state_dict(state_dict, prefix, given)
    else:
        raise TypeError(
            "from_deepseek_v4 expects a DeepseekV4HyperConnection or a state dict with keys "
            f"{list(_KEYS)}, got {type(hc_module_or_state_dict).__name__}"
        )

    fn = state_dict[prefix + "fn"]
    mhc = ManifoldHyperConnection(
        found["hidden_size"], found["hc_mult"], layer_index, branch,
        sinkhorn_iters=int(found["sinkhorn_iters"]),
    ).to(device=fn.device, dtype=fn.dtype)
    return load_deepseek_v4_state_dict(
        mhc, state_dict, found["hc_eps"], found["rms_norm_eps"], prefix=prefix
    )


def norm_epsilon(norm: nn.Module) -> float:
    """The epsilon of a DeepSeek-V4 module's input_norm (an unweighted RMSNorm): transformers
    up to 5.24 names it `eps`, 5.25 `variance_epsilon`."""
    for name in ("eps", "variance_epsilon"):
        value = getattr(norm, name, None)
        if value is not None:
            return float(value)
    raise TypeError(
        f"expected DeepSeek-V4's input_norm to hold its epsilon as `eps` or `variance_epsilon`, "
        f"got {type(norm).__name__} with neither"
    )


def _settings_of_module(module: nn.Module, given: dict) -> dict:
    """hidden_size, hc_mult, sinkhorn_iters, hc_eps, rms_norm_eps read from a
    DeepseekV4HyperConnection; a given (not None) value that disagrees is an error."""
    needed = ("fn", "base", "scale", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "input_norm")
    lacking = [a for a in needed if not hasattr(module, a)]
    if lacking:
        raise TypeError(
            f"expected a DeepseekV4HyperConnection (attributes {list(needed)}), "
            f"got {type(module).__name__} lacking {lacking}"
        )
    n = int(module.hc_mult)
    found = {
        "hidden_size": module.fn.shape[-1] // n, "hc_mult": n,
        "sinkhorn_iters": int(module.hc_sinkhorn_iters), "hc_eps": float(module.hc_eps),
        "rms_norm_eps": norm_epsilon(module.input_norm),
    }
    for name, value in given.items():
        if value is not None and value != found[name]:
            raise ValueError(
                f"from_deepseek_v4: {name}={value!r} disagrees with the module's "
                f"{found[name]!r}"
            )
    return found


def _settings_of_state_dict(state_dict: Mapping[str, torch.Tensor], prefix: str,
                            given: dict) -> dict:
    """hidden_size and hc_mult inferred from the tensors' shapes, the rest as given (each
    needed: the weights do not store them)."""
    tensors = _read_state_dict(state_dict, prefix)
    width = tensors["base"].numel() if tensors["base"].dim() == 1 else -1
    n = _streams_from_width(width)
    if n is None:
        raise ValueError(
            f"DeepSeek-V4 hyper-connection parameter {prefix + 'base'!r}: expected shape "
            f"[(2 + n) * n] for some hc_mult n >= 1, got {tuple(tensors['base'].shape)}"
        )
    if tensors["fn"].dim() != 2 or tensors["fn"].shape[1] % n:
        raise ValueError(
            f"DeepSeek-V4 hyper-connection parameter {prefix + 'fn'!r}: expected shape "
            f"[{(2 + n) * n}, {n} * hidden_size], got {tuple(tensors['fn'].shape)}"
        )
    found = dict(given, hidden_size=tensors["fn"].shape[1] // n, hc_mult=n)
    for name in ("hidden_size", "hc_mult"):
        if given[name] is not None and given[name] != found[name]:
            raise ValueError(
                f"from_deepseek_v4: {name}={given[name]!r} disagrees with the state dict's "
                f"shapes, which give {found[name]!r}"
            )
    lacking = [k for k in ("sinkhorn_iters", "hc_eps", "rms_norm_eps") if found[k] is None]
    if lacking:
        raise ValueError(
            f"from_deepseek_v4 from a state dict needs {lacking} (the model config's "
            f"hc_sinkhorn_iters, hc_eps, rms_norm_eps); they are not stored in the weights"
        )
    return found


# ------------------------------------------------------------------------------------------
# DeepSeek-V4's HyperHead (the final stream collapse) <-> torch_mhc.StreamHead
#
#   hc_fn [n, n*C], hc_base [n], hc_scale [1]:  pre = sigmoid(hc_scale * (v_normed @ hc_fn^T)
#   + hc_base) + hc_eps, out = sum_j pre[j] x[j]. StreamHead computes the same with
#   phi = hc_fn^T, alpha = hc_scale, b = hc_base, eps = hc_eps, norm_eps = rms_norm_eps
#   (no permutation: the head has no n x n block).

_HEAD_KEYS = ("hc_fn", "hc_base", "hc_scale")


def from_deepseek_v4_head(
    head_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    *,
    hc_eps: float | None = None,
    rms_norm_eps: float | None = None,
    prefix: str = "",
) -> StreamHead:
    """A StreamHead computing what a DeepseekV4HyperHead computes (new parameters, copied).

    Given the module, hc_eps and rms_norm_eps are read from it; given a state dict
    (keys prefix + hc_fn, hc_base, hc_scale) they must be passed (the config's hc_eps,
    rms_norm_eps), and n, C are inferred from hc_fn's shape [n, n*C].
    """
    if isinstance(head_or_state_dict, nn.Module):
        module = head_or_state_dict
        lacking = [a for a in (*_HEAD_KEYS, "eps", "input_norm") if not hasattr(module, a)]
        if lacking:
            raise TypeError(
                f"expected a DeepseekV4HyperHead (attributes {[*_HEAD_KEYS, 'eps', 'input_norm']})"
                f", got {type(module).__name__} lacking {lacking}"
            )
        tensors = {k: getattr(module, k) for k in _HEAD_KEYS}
        hc_eps = float(module.eps) if hc_eps is None else hc_eps
        rms_norm_eps = norm_epsilon(module.input_norm) if rms_norm_eps is None else rms_norm_eps
    elif isinstance(head_or_state_dict, Mapping):
        missing = [prefix + k for k in _HEAD_KEYS if prefix + k not in head_or_state_dict]
        if missing:
            raise KeyError(
                f"DeepSeek-V4 HyperHead state dict: expected keys "
                f"{[prefix + k for k in _HEAD_KEYS]}, missing {missing}"
            )
        tensors = {k: head_or_state_dict[prefix + k] for k in _HEAD_KEYS}
        if hc_eps is None or rms_norm_eps is None:
            raise ValueError(
                "from_deepseek_v4_head from a state dict needs hc_eps and rms_norm_eps (the "
                "model config's); they are not stored in the weights"
            )
    else:
        raise TypeError(
            "from_deepseek_v4_head expects a DeepseekV4HyperHead or a state dict with keys "
            f"{list(_HEAD_KEYS)}, got {type(head_or_state_dict).__name__}"
        )
    fn = tensors["hc_fn"]
    n = fn.shape[0] if fn.dim() == 2 else 0
    if n < 1 or fn.shape[1] % n:
        raise ValueError(
            f"DeepSeek-V4 HyperHead parameter {prefix + 'hc_fn'!r}: expected shape [n, n * C], "
            f"got {tuple(fn.shape)}"
        )
    head = StreamHead(fn.shape[1] // n, n, norm_eps=float(rms_norm_eps), eps=float(hc_eps))
    head = head.to(device=fn.device, dtype=fn.dtype)
    return load_deepseek_v4_head_state_dict(head, tensors)


def load_deepseek_v4_head_state_dict(
    head: StreamHead, state_dict: Mapping[str, torch.Tensor], *, prefix: str = ""
) -> StreamHead:
    """Copy hc_fn, hc_base, hc_scale into `head` in place (shapes checked); returns head."""
    n, dim = head.streams, head.dim
    expected = {"hc_fn": (n, n * dim), "hc_base": (n,), "hc_scale": (1,)}
    for k, shape in expected.items():
        if prefix + k not in state_dict:
            raise KeyError(f"DeepSeek-V4 HyperHead state dict: missing {prefix + k!r}")
        got = tuple(state_dict[prefix + k].shape)
        if got != shape:
            raise ValueError(
                f"DeepSeek-V4 HyperHead parameter {prefix + k!r}: expected shape {shape} for "
                f"hc_mult={n}, hidden_size={dim}, got {got}"
            )
    with torch.no_grad():
        head.phi.copy_(state_dict[prefix + "hc_fn"].T)  # [n*C, n]
        head.alpha.copy_(state_dict[prefix + "hc_scale"])
        head.b.copy_(state_dict[prefix + "hc_base"])
    return head


def to_deepseek_v4_head_state_dict(head: StreamHead, *, prefix: str = "") -> dict:
    """The inverse: {"hc_fn" [n, n*C], "hc_base" [n], "hc_scale" [1]} as new tensors. The
    receiving config needs hc_eps = head.eps and rms_norm_eps = head.norm_eps to match."""
    if not isinstance(head, StreamHead):
        raise TypeError(f"expected a StreamHead, got {type(head).__name__}")
    phi, alpha, b = head.parameters_as_phi_alpha_b()
    with torch.no_grad():
        return {prefix + "hc_fn": phi.T.clone(), prefix + "hc_base": b.detach().clone(),
                prefix + "hc_scale": alpha.detach().clone()}
