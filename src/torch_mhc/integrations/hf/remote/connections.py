"""The connections of torch-mhc for remote code: torch and the copied maths only.

Copied into every folder that transformers loads without torch-mhc (a converted model's
portable checkpoint, an exported reference LM), beside maps.py, sinkhorn.py and successors.py
(torch_mhc/functional, verbatim). The modules keep the parameter names, shapes and initial
values of torch_mhc.connections, so the library's state dicts load into them unchanged, and
compute their maps with the library's plain-torch reference, so the outputs equal the
library's up to float rounding (the library's fused ops compute the same maps). There is
one implementation here: the option `impl` is accepted and ignored.

    conn = make_connection(kind, dim, streams, layer_index, options, branch=None)
    x = conn(x, *args, branch=f, **kwargs)   # x [..., n, C]; f: [..., C] -> [..., C]

The branch is the one given at the call, else the module given at construction.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .maps import hc_maps, mhc_maps, post_merge, pre_aggregate, read_write_maps
from .successors import kromhc_res, kronecker_pattern, mhc_lite_res, permutation_matrices

MAX_LITE_STREAMS = 5  # mhc-lite mixes all n! permutations


def pre_bias(n: int, layer_index: int) -> torch.Tensor:
    """b_pre with sigmoid(b_pre) = e_{k mod n} / 2 + 1 / (2n) (layer k reads stream k)."""
    p = torch.full((n,), 0.5 / n, dtype=torch.float64)
    p[layer_index % n] += 0.5
    return torch.logit(p.clamp(max=0.99)).float()


class Connection(nn.Module):
    """x [..., n, C] -> H_res x + H_post^T F(H_pre x); subclasses define `maps`."""

    def __init__(self, dim: int, streams: int, layer_index: int, options: dict,
                 branch: nn.Module | None = None):
        super().__init__()
        self.dim, self.streams, self.layer_index = dim, streams, layer_index
        self.norm_eps = float(options.get("norm_eps", 1e-6))
        self.check_finite = bool(options.get("check_finite", False))
        self.branch = branch

    def forward(self, x: torch.Tensor, *args, branch=None, **kwargs) -> torch.Tensor:
        branch = self.branch if branch is None else branch
        h_pre, h_post, h_res = self.maps(x)
        f = branch(pre_aggregate(x, h_pre), *args, **kwargs)  # [..., C]
        if self.check_finite:
            for what, t in (("H_pre", h_pre), ("H_post", h_post), ("H_res", h_res), ("F", f)):
                if not bool(torch.isfinite(t).all()):
                    raise FloatingPointError(f"{type(self).__name__}: {what} holds NaN or Inf")
        return post_merge(x, f, h_post, h_res)  # [..., n, C]


class Residual(Connection):
    """x + F(x) on one stream: x [..., 1, C]."""

    def forward(self, x: torch.Tensor, *args, branch=None, **kwargs) -> torch.Tensor:
        branch = self.branch if branch is None else branch
        f = branch(x.squeeze(-2), *args, **kwargs)  # [..., C]
        if self.check_finite and not bool(torch.isfinite(f).all()):
            raise FloatingPointError(f"{type(self).__name__}: F holds NaN or Inf")
        return x + f.unsqueeze(-2)


class HyperConnection(Connection):
    """HC: static maps plus (dynamic) tanh terms; w [C, 2 + n], scales s_alpha, s_beta [1]."""

    def __init__(self, dim, streams, layer_index, options, branch=None):
        super().__init__(dim, streams, layer_index, options, branch)
        n = streams
        self.static_pre = nn.Parameter(torch.eye(n)[layer_index % n])
        self.static_post = nn.Parameter(torch.ones(n))
        self.static_res = nn.Parameter(torch.eye(n))
        if options.get("dynamic", True):
            self.w = nn.Parameter(torch.zeros(dim, 2 + n))
            self.s_alpha = nn.Parameter(torch.full((1,), 0.01))
            self.s_beta = nn.Parameter(torch.full((1,), 0.01))
        else:
            self.register_parameter("w", None)
            self.register_buffer("s_alpha", torch.zeros(1))
            self.register_buffer("s_beta", torch.zeros(1))

    def maps(self, x):
        return hc_maps(x, self.w, self.s_alpha.view(()), self.s_beta.view(()), self.static_pre,
                       self.static_post, self.static_res, self.norm_eps)


class ManifoldHyperConnection(Connection):
    """mHC: phi [n*C, n*n + 2n], gates alpha [3], biases b_pre, b_post [n], b_res [n, n]."""

    def __init__(self, dim, streams, layer_index, options, branch=None):
        super().__init__(dim, streams, layer_index, options, branch)
        n = streams
        self.sinkhorn_iters = int(options.get("sinkhorn_iters", 20))
        self.pre_eps = float(options.get("pre_eps", 0.0))
        self.sinkhorn_eps = float(options.get("sinkhorn_eps", 0.0))
        diag = options.get("res_init_diag") or 0.5 + 0.5 / n  # sinkhorn(b_res): I/2 + J/(2n)
        self.phi = nn.Parameter(torch.zeros(n * dim, n * n + 2 * n))
        self.alpha = nn.Parameter(torch.full((3,), float(options.get("gate_init", 0.01))))
        self.b_pre = nn.Parameter(pre_bias(n, layer_index))
        self.b_post = nn.Parameter(torch.zeros(n))
        self.b_res = nn.Parameter(torch.zeros(1, 1) if n == 1 else
                                  torch.eye(n) * math.log(diag * (n - 1) / (1.0 - diag)))

    def maps(self, x):
        return mhc_maps(x, self.phi, self.alpha, self.b_pre, self.b_post, self.b_res,
                        self.sinkhorn_iters, self.norm_eps, self.sinkhorn_eps, self.pre_eps)


class MhcResVariant(Connection):
    """mHC's read and write maps with another H_res from R res logits: mhc-lite (R = n!, a
    softmax mixture of permutations), kromhc (R = log2 n Kronecker factors) or
    mhc-static-res (R = 0, H_res = I). phi [n*C, 2n + R], alpha [3] ([2] when R = 0)."""

    kind = ""  # set by the subclasses in CONNECTIONS

    def __init__(self, dim, streams, layer_index, options, branch=None):
        super().__init__(dim, streams, layer_index, options, branch)
        n, kind = streams, self.kind
        r = {"mhc-lite": math.factorial(n), "kromhc": n.bit_length() - 1}.get(kind, 0)
        self.phi = nn.Parameter(torch.zeros(n * dim, 2 * n + r))
        self.alpha = nn.Parameter(torch.full((3 if r else 2,), float(options.get("gate_init",
                                                                                  0.01))))
        self.b_pre = nn.Parameter(pre_bias(n, layer_index))
        self.b_post = nn.Parameter(torch.zeros(n))
        if kind == "mhc-lite":
            # the identity's weight 1/2 + 1/(2 n!), as the library's initialisation
            top = torch.tensor(math.log(r + 1), dtype=torch.float32)
            rest = (top.double() - math.log(r + 1)).float().expand(r - 1)
            self.b_res = nn.Parameter(torch.cat([top[None], rest]))
        elif kind == "kromhc":
            self.b_res = nn.Parameter(torch.full((r,), math.log(3.0)))  # factors I/2 + J/4
        # The permutations or the Kronecker pattern, made per device on first use: no buffer,
        # since transformers builds a model on the meta device and fills only what the
        # checkpoint holds.
        self._constants: dict = {}

    def maps(self, x):
        h_pre, h_post, rest = read_write_maps(x, self.phi, self.alpha, self.b_pre, self.b_post,
                                              self.norm_eps)
        z = rest + self.b_res.to(rest.dtype) if hasattr(self, "b_res") else rest
        # H_res in float64, rounded once, as the library computes it (MPS has no float64)
        wide = torch.float32 if z.device.type == "mps" else torch.float64
        return h_pre, h_post, self.res_map(z.to(wide)).to(z.dtype)

    def res_map(self, z: torch.Tensor) -> torch.Tensor:
        """H_res [..., n, n] from the biased res logits z [..., R]."""
        n = self.streams
        if self.kind == "mhc-static-res":
            return torch.eye(n, dtype=z.dtype, device=z.device).expand(*z.shape[:-1], n, n)
        if z.device not in self._constants:
            make = permutation_matrices if self.kind == "mhc-lite" else kronecker_pattern
            self._constants[z.device] = make(n).to(z.device)
        res = mhc_lite_res if self.kind == "mhc-lite" else kromhc_res
        return res(z, self._constants[z.device])


# one class per kind, defined at module level so that pickle finds each by its name
class MhcLite(MhcResVariant):
    kind = "mhc-lite"


class Kromhc(MhcResVariant):
    kind = "kromhc"


class MhcStaticRes(MhcResVariant):
    kind = "mhc-static-res"


CONNECTIONS = {
    "residual": Residual, "hc": HyperConnection, "mhc": ManifoldHyperConnection,
    "mhc-lite": MhcLite, "kromhc": Kromhc, "mhc-static-res": MhcStaticRes,
}


def make_connection(kind: str, dim: int, streams: int, layer_index: int, options: dict,
                    branch: nn.Module | None = None) -> Connection:
    """The connection of `kind` (one of CONNECTIONS) with the library's initial values."""
    if kind not in CONNECTIONS:
        raise ValueError(f"connection kind must be one of {sorted(CONNECTIONS)}, got {kind!r}")
    return CONNECTIONS[kind](dim, streams, layer_index, options, branch)
