"""Analytic cost model of the residual connection, Hyper-Connections (HC) and mHC.

Everything here is arithmetic on the shapes of the connections (torch_mhc.connections); nothing
runs a model, so `mhc cost` answers instantly. Notation: n = streams, C = hidden,
L = layers (transformer blocks), T = tokens per sequence, m = n^2 + 2n (the number of map
coefficients per token: n for H_pre, n for H_post, n^2 for H_res). Every transformer block
has two sublayers (attention, MLP), each wrapped by one connection, so a model has 2L
connections; the paper's "layer" l (Eq. 3) is one connection.

Memory access per token of one connection, in elements (paper Table 2)
----------------------------------------------------------------------
Residual, one kernel: `x + F(x)` reads x and F(x) and writes the sum: reads 2C, writes C.

HC, unfused (one kernel per operation, the paper's accounting):

    kernel   reads          writes       what
    maps     nC             m            the n^2 + 2n coefficients from the streams
    pre      nC + n         C            H_pre x
    post     C + n          nC           H_post^T F(.)
    res      nC + n^2       nC           H_res x
    merge    2nC            nC           sum of the two
    total    (5n+1)C + m    (3n+1)C + m

mHC with the fused kernels of paper section 4.3 (three kernels):

    kernel            reads             writes   what
    maps              nC                m        RMS, matmul with phi, gates, sigmoid, Sinkhorn
    pre               nC + n            C        H_pre x (reads H_pre)
    post_res_merge    (n+1)C + n^2 + n  nC       H_res x + H_post^T F(.): reads x (nC) and
                                                 F(.) (C) once, plus H_res and H_post
    total             (3n+1)C + m       (n+1)C + m

The coefficients are written once (m) and read once between the two later kernels
(n + n^2 + n = m). The fusion removes the intermediate [n, C] tensors of HC's post and res
kernels: (5n+1)C + (3n+1)C = (8n+2)C elements of streams traffic become (4n+2)C. Bytes are
elements times the width of `dtype`; the coefficients are counted in the same dtype (kernels
keep them in fp32, which changes the totals by at most 2m bytes).

Parameters added per connection
-------------------------------
HC (dynamic, HC paper Eq. 10-13, as in connections.HyperConnection): W = [W_beta | W_m |
W_r] of shape [C, 2 + n], the static B [n], A_m [n], A_r [n, n], and the scalars s_alpha,
s_beta: C(n + 2) + n^2 + 2n + 2. The per-stream norm has no weight (folded into W).
mHC: phi [nC, m] (the RMSNorm weight folded in), b_pre [n], b_post [n], b_res [n, n] and
three gates alpha: nCm + m + 3. The residual connection adds nothing.

FLOPs per token of one connection (forward)
-------------------------------------------
Counting rule: one FLOP per scalar add, multiply, divide, compare, exp, tanh; a
multiply-accumulate is 2 FLOPs; sigmoid(z) = 1 / (1 + exp(-z)) is 3 FLOPs; the handful of
per-token scalar operations (a mean, a sqrt, a reciprocal) are not counted.

    residual: the add, C.
    HC:   norm 3nC (square, accumulate, scale per stream)  + projection 2nC(n + 2)
          + coefficients 3n(n + 2) (tanh, times s, plus static)
          + pre 2nC + post_res_merge 2n^2 C + 2nC.
    mHC:  rms 2nC (square, accumulate over nC) + projection 2nCm
          + scale_bias 3m (divide by the RMS, times alpha, plus b)
          + sigmoid 7n (3n for H_pre, 4n for 2 sigmoid of H_post)
          + sinkhorn 3n^2 + 4 t n^2 (max, subtract, exp; then per iteration two
            normalisations, each n^2 accumulations and n^2 divisions), t = sinkhorn_iters
          + pre 2nC + post_res_merge 2n^2 C + 2nC.

The block itself (forward, per token, dense, no biases): attention projections
2C q + 4C k + 2q C with q the query width (heads * head_dim, default C) and k the key/value
width (kv_heads * head_dim, default q); causal attention scores and values
4q (T + 1) / 2 = 2q (T + 1) (token t attends to t + 1 positions); a two-matrix MLP 4C F with
F = round(ffn_mult C) (a SwiGLU MLP of width h costs the same as ffn_mult = 1.5 h / C);
two RMSNorms 8C. Softmax, embeddings and the output head are not counted. Overheads are
ratios of whole-model FLOPs: (L block + 2L connection) for each connection kind.
Training FLOPs are 3x forward; with selective recomputation mHC's kernels run forward twice,
so its connections cost 4x forward in training.

Activation memory kept for the backward pass, per token (paper section 4.3)
----------------------------------------------------------------------------
Per connection and token, an mHC layer keeps its input streams x_l (nC), the aggregated input
H_pre x_l (C) and the output of F's pre-norm (C), i.e. (n + 2)C, plus the coefficients
(the m maps and the RMS: m + 1). F's own internal activations (attention, MLP hidden) are the
same for every connection kind and are not counted. The residual connection's counterpart
is x_l and its norm output, 2C.

Without recomputation a pipeline stage of L_s connections keeps L_s ((n + 2)C + m + 1).
With selective recomputation the stage is cut into segments of L_r connections; only the
input streams of each segment's first connection are kept, and during the backward pass one
segment at a time is rebuilt, so the stage needs

    n C ceil(L_s / L_r) + (n + 2) C L_r        elements per token

(the paper's expression; the coefficients are recomputed and not counted). The rebuilt set
includes F's pre-norm output, which the residual baseline keeps, so the recomputed mHC figure
can fall below the residual's no-recompute figure; the table labels both. Ignoring the
ceil, the minimum is at L_r* = sqrt(n L_s / (n + 2)); `optimal_recompute_interval` rounds it
to the nearest integer (halves up), at least 1. Segments follow stage boundaries (as in the
paper), so the interval is chosen per stage: L_s = 2L / pipeline_stages connections.
`recompute_interval` is counted in connections, like L_r in the paper.

Pipeline communication
----------------------
Each of the pipeline_stages - 1 boundaries carries the streams tensor [b, T, n, C] of a
micro-batch of b = batch / micro_batches sequences forward (activation) and its gradient
backward: b T n C bytes_per_elem each way (the residual network sends n = 1). Per training
step this is 2 (pipeline_stages - 1) micro_batches times that.

KV cache
--------
2 (K and V) L T H bytes_per_elem batch, with H = kv_heads * head_dim (default C, full
multi-head attention). It does not depend on the connection; it is reported so that the
serving cost can be put next to the training cost. E.g. L = 32, H = 4096, bf16: 8192 tokens
take 4 GiB, 131072 tokens 64 GiB.

Parallelism
-----------
batch is per data-parallel replica; data_parallel only scales the tokens per step and adds
the all-reduce of the connection parameters' gradients (ring: 2 (d - 1) / d of their bytes
sent per rank, in `dtype`). tensor_parallel shards the block's matmuls (FLOPs / t per
device) and the KV cache (/ t); the connection's work is assumed replicated on every tensor
parallel rank (no sequence parallelism), so its per-device share of the FLOPs grows with t.

Not modelled: expanding the embedding into n streams and reducing them at the end (once per
model, O(nC)), the backward kernels' memory traffic, optimizer state, wall-clock time.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from torch_mhc.runtime.recompute import optimal_interval as optimal_recompute_interval

__all__ = [
    "DTYPE_BITS",
    "KINDS",
    "PAPER_27B",
    "CostConfig",
    "bytes_for",
    "memory_access",
    "connection_params",
    "connection_flops",
    "block_flops",
    "block_params",
    "optimal_recompute_interval",
    "recompute_activation_elements",
    "activation_memory",
    "pipeline_communication",
    "kv_cache_bytes",
    "estimate",
    "paper_27b_overhead",
]

# Width of one element in bits; int4 is half a byte.
DTYPE_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "int4": 4}

KINDS = ("residual", "hc", "mhc")

# The paper's 27B model: 30 blocks (60 connections), C = 2560, n = 4, t_max = 20.
# Only these sizes come from the paper; the block FLOPs are those of a dense block of the
# same width (the paper's model is a DeepSeek-V3-style MoE, whose block differs).
PAPER_27B = {"layers": 30, "hidden": 2560, "streams": 4, "sinkhorn_iters": 20}

# Training time overhead that the paper reports for n = 4 with its fused kernels.
PAPER_REPORTED_TRAINING_OVERHEAD = 0.067


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def _check_int(name: str, value, minimum: int = 1, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_dtype(dtype) -> None:
    if dtype not in DTYPE_BITS:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_BITS)}")


@dataclass(frozen=True)
class CostConfig:
    """Sizes of a model and of its training layout.

    layers: transformer blocks (2 connections each); hidden: C; streams: n; tokens: T per
    sequence; batch: sequences per data-parallel replica and step, split into micro_batches;
    dtype: element type of activations and KV cache; heads, kv_heads, head_dim: attention
    shape (default: full multi-head attention of width C); ffn_mult: MLP width / C;
    recompute_interval: L_r in connections (None: the optimum per pipeline stage).
    pipeline_stages must divide 2 * layers (equal stages, which may cut a block between its
    attention and MLP connections) and micro_batches must divide batch.
    """

    layers: int
    hidden: int
    streams: int = 4
    tokens: int = 4096
    batch: int = 1
    dtype: str = "bf16"
    sinkhorn_iters: int = 20
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    ffn_mult: float = 4
    pipeline_stages: int = 1
    micro_batches: int = 1
    data_parallel: int = 1
    tensor_parallel: int = 1
    recompute_interval: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "streams", "tokens", "batch", "sinkhorn_iters",
                     "pipeline_stages", "micro_batches", "data_parallel", "tensor_parallel"):
            _check_int(name, getattr(self, name))
        for name in ("heads", "kv_heads", "head_dim", "recompute_interval"):
            _check_int(name, getattr(self, name), optional=True)
        _check_dtype(self.dtype)
        if (not isinstance(self.ffn_mult, (int, float)) or isinstance(self.ffn_mult, bool)
                or not self.ffn_mult > 0 or not math.isfinite(self.ffn_mult)):
            raise ValueError(f"ffn_mult must be a positive number, got {self.ffn_mult!r}")
        if self.heads is not None and self.head_dim is None and self.hidden % self.heads:
            raise ValueError(
                f"heads must divide hidden when head_dim is not given, "
                f"got hidden={self.hidden}, heads={self.heads}"
            )
        if self.head_dim is not None and self.heads is None and self.hidden % self.head_dim:
            raise ValueError(
                f"head_dim must divide hidden when heads is not given, "
                f"got hidden={self.hidden}, head_dim={self.head_dim}"
            )
        if self.kv_heads is not None:
            if self.heads is None and self.head_dim is None:
                raise ValueError("kv_heads needs heads or head_dim to fix the head size")
            if self.kv_heads > self.query_heads or self.query_heads % self.kv_heads:
                raise ValueError(
                    f"kv_heads must divide the number of query heads, "
                    f"got kv_heads={self.kv_heads}, heads={self.query_heads}"
                )
        if self.connections % self.pipeline_stages:
            raise ValueError(
                f"pipeline_stages must divide the number of connections 2*layers="
                f"{self.connections}, got pipeline_stages={self.pipeline_stages}"
            )
        if self.batch % self.micro_batches:
            raise ValueError(
                f"batch must be divisible by micro_batches, "
                f"got batch={self.batch}, micro_batches={self.micro_batches}"
            )
        if self.recompute_interval is not None and self.recompute_interval > self.stage_connections:
            raise ValueError(
                f"recompute_interval must be <= the connections per pipeline stage "
                f"({self.stage_connections}), got {self.recompute_interval}"
            )

    @property
    def connections(self) -> int:  # 2 per block: attention and MLP
        return 2 * self.layers

    @property
    def stage_connections(self) -> int:  # L_s
        return self.connections // self.pipeline_stages

    @property
    def micro_batch_size(self) -> int:  # sequences per micro-batch
        return self.batch // self.micro_batches

    @property
    def resolved_head_dim(self) -> int | None:
        if self.head_dim is not None:
            return self.head_dim
        if self.heads is not None:
            return self.hidden // self.heads
        return None

    @property
    def query_heads(self) -> int | None:
        if self.heads is not None:
            return self.heads
        if self.head_dim is not None:
            return self.hidden // self.head_dim
        return None

    @property
    def attention_dim(self) -> int:  # q: width of the queries and of the attention output
        if self.heads is not None and self.head_dim is not None:
            return self.heads * self.head_dim
        return self.hidden

    @property
    def kv_dim(self) -> int:  # k: width of the keys (= of the values)
        if self.kv_heads is None:
            return self.attention_dim
        return self.kv_heads * self.resolved_head_dim

    @property
    def ffn_dim(self) -> int:  # F
        return round(self.ffn_mult * self.hidden)


def bytes_for(elements: int, dtype: str) -> int | float:
    """Bytes taken by `elements` values of `dtype` (an int unless int4 leaves half a byte)."""
    _check_dtype(dtype)
    bits = elements * DTYPE_BITS[dtype]
    return bits // 8 if bits % 8 == 0 else bits / 8


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown connection kind {kind!r}; expected one of {', '.join(KINDS)}")


def _check_nc(streams: int, hidden: int) -> None:
    _check_int("streams", streams)
    _check_int("hidden", hidden)


def _totalled(breakdown: dict) -> dict:
    return {"breakdown": breakdown, "total": sum(breakdown.values())}


# --------------------------------------------------------------------------------------------
# One connection: memory access, parameters, FLOPs
# --------------------------------------------------------------------------------------------


def memory_access(kind: str, streams: int, hidden: int) -> dict:
    """Elements read and written per token by one connection, kernel by kernel (Table 2).

    Returns {"kernels": {name: {"read": r, "write": w}}, "read": R, "write": W, "total": R+W}.
    For "residual" the streams argument is ignored (one stream).
    """
    _check_kind(kind)
    _check_nc(streams, hidden)
    n, c = streams, hidden
    m = n * n + 2 * n  # coefficients per token
    if kind == "residual":
        kernels = {"merge": (2 * c, c)}
    elif kind == "hc":
        kernels = {
            "maps": (n * c, m),
            "pre": (n * c + n, c),
            "post": (c + n, n * c),
            "res": (n * c + n * n, n * c),
            "merge": (2 * n * c, n * c),
        }
    else:
        kernels = {
            "maps": (n * c, m),
            "pre": (n * c + n, c),
            "post_res_merge": ((n + 1) * c + n * n + n, n * c),
        }
    read = sum(r for r, _ in kernels.values())
    write = sum(w for _, w in kernels.values())
    return {
        "kernels": {name: {"read": r, "write": w} for name, (r, w) in kernels.items()},
        "read": read,
        "write": write,
        "total": read + write,
    }


def connection_params(kind: str, streams: int, hidden: int) -> dict:
    """Parameters one connection adds: {"breakdown": {name: count}, "total": count}."""
    _check_kind(kind)
    _check_nc(streams, hidden)
    n, c = streams, hidden
    m = n * n + 2 * n
    if kind == "residual":
        return _totalled({})
    if kind == "hc":
        return _totalled({
            "w": c * (n + 2),  # [C, 2 + n]: W_beta, W_m, W_r
            "static_pre": n,  # A_m
            "static_post": n,  # B
            "static_res": n * n,  # A_r
            "scales": 2,  # s_alpha, s_beta
        })
    return _totalled({
        "phi": n * c * m,  # [nC, n^2 + 2n]
        "b_pre": n,
        "b_post": n,
        "b_res": n * n,
        "alpha": 3,
    })


def connection_flops(kind: str, streams: int, hidden: int, sinkhorn_iters: int = 20) -> dict:
    """Forward FLOPs per token of one connection: {"breakdown": {...}, "total": ...}.

    See the module docstring for the counting rule.
    """
    _check_kind(kind)
    _check_nc(streams, hidden)
    _check_int("sinkhorn_iters", sinkhorn_iters)
    n, c, t = streams, hidden, sinkhorn_iters
    m = n * n + 2 * n
    merge = {"pre": 2 * n * c, "post_res_merge": 2 * n * n * c + 2 * n * c}
    if kind == "residual":
        return _totalled({"add": c})
    if kind == "hc":
        return _totalled({
            "norm": 3 * n * c,
            "projection": 2 * n * c * (n + 2),
            "coefficients": 3 * n * (n + 2),
            **merge,
        })
    return _totalled({
        "rms": 2 * n * c,
        "projection": 2 * n * c * m,
        "scale_bias": 3 * m,
        "sigmoid": 7 * n,
        "sinkhorn": 3 * n * n + 4 * t * n * n,
        **merge,
    })


# --------------------------------------------------------------------------------------------
# The transformer block (the baseline the overheads are relative to)
# --------------------------------------------------------------------------------------------


def block_flops(cfg: CostConfig) -> dict:
    """Forward FLOPs per token of one dense transformer block (attention + MLP)."""
    c, q, k, f = cfg.hidden, cfg.attention_dim, cfg.kv_dim, cfg.ffn_dim
    return _totalled({
        "attention_projections": 2 * c * q + 2 * 2 * c * k + 2 * q * c,  # Q; K, V; O
        "attention_scores": 2 * q * (cfg.tokens + 1),  # QK^T and AV, causal mean context
        "mlp": 2 * 2 * c * f,  # up [C, F] and down [F, C]
        "norms": 2 * 4 * c,  # two RMSNorms with weight
    })


def block_params(cfg: CostConfig) -> dict:
    """Parameters of one dense transformer block (no biases)."""
    c, q, k, f = cfg.hidden, cfg.attention_dim, cfg.kv_dim, cfg.ffn_dim
    return _totalled({"attention": 2 * c * q + 2 * c * k, "mlp": 2 * c * f, "norms": 2 * c})


# --------------------------------------------------------------------------------------------
# Activations, pipeline, KV cache
# --------------------------------------------------------------------------------------------


def recompute_activation_elements(streams: int, hidden: int, layers: int, interval: int) -> int:
    """Elements per token kept with selective recomputation: nC ceil(L/L_r) + (n+2)C L_r."""
    _check_nc(streams, hidden)
    _check_int("layers", layers)
    _check_int("interval", interval)
    n, c = streams, hidden
    return n * c * math.ceil(layers / interval) + (n + 2) * c * interval


def activation_memory(cfg: CostConfig) -> dict:
    """Activation bytes kept for the backward pass by the connections of one pipeline stage."""
    n, c, ls = cfg.streams, cfg.hidden, cfg.stage_connections
    m = n * n + 2 * n
    tokens_per_micro_batch = cfg.micro_batch_size * cfg.tokens
    optimum = optimal_recompute_interval(n, ls)
    interval = cfg.recompute_interval if cfg.recompute_interval is not None else optimum

    per_connection = {  # elements per token
        "residual": 2 * c,  # x_l, norm(x_l)
        "mhc": (n + 2) * c + m + 1,  # x_l (nC), H_pre x_l (C), norm (C), maps (m), RMS (1)
    }
    per_stage = {  # elements per token, whole stage
        "residual": ls * per_connection["residual"],
        "mhc": ls * per_connection["mhc"],
        "mhc_recompute": recompute_activation_elements(n, c, ls, interval),
    }
    to_bytes = {name: bytes_for(e, cfg.dtype) for name, e in per_stage.items()}
    return {
        "stage_connections": ls,
        "recompute_interval": interval,
        "recompute_interval_optimal": optimum,
        "per_connection_bytes_per_token": {
            name: bytes_for(e, cfg.dtype) for name, e in per_connection.items()
        } | {"mhc_recompute": bytes_for(per_stage["mhc_recompute"], cfg.dtype) / ls},
        "per_stage_bytes_per_token": to_bytes,
        "per_stage_bytes_per_micro_batch": {
            name: b * tokens_per_micro_batch for name, b in to_bytes.items()
        },
        "mhc_recompute_saving": 1 - per_stage["mhc_recompute"] / per_stage["mhc"],
    }


def pipeline_communication(cfg: CostConfig) -> dict:
    """Bytes sent across pipeline stage boundaries (streams forward, gradients backward)."""
    boundaries = cfg.pipeline_stages - 1
    tokens = cfg.micro_batch_size * cfg.tokens

    def per_boundary(n: int) -> int | float:  # one micro-batch, one direction
        return bytes_for(tokens * n * cfg.hidden, cfg.dtype)  # [b, T, n, C]

    def per_step(n: int) -> int | float:  # all boundaries, both directions, all micro-batches
        return 2 * boundaries * cfg.micro_batches * per_boundary(n)

    return {
        "boundaries": boundaries,
        "micro_batch_size": cfg.micro_batch_size,
        "forward_bytes_per_boundary_per_micro_batch": per_boundary(cfg.streams),
        "backward_bytes_per_boundary_per_micro_batch": per_boundary(cfg.streams),
        "bytes_per_step": per_step(cfg.streams),
        "residual_forward_bytes_per_boundary_per_micro_batch": per_boundary(1),
        "residual_bytes_per_step": per_step(1),
    }


def kv_cache_bytes(
    layers: int, tokens: int, kv_dim: int, dtype: str = "bf16", batch: int = 1
) -> int | float:
    """2 (K and V) * layers * tokens * kv_dim * bytes_per_elem * batch."""
    for name, value in (("layers", layers), ("tokens", tokens), ("kv_dim", kv_dim),
                        ("batch", batch)):
        _check_int(name, value)
    return bytes_for(2 * layers * tokens * kv_dim * batch, dtype)


# --------------------------------------------------------------------------------------------
# The whole report
# --------------------------------------------------------------------------------------------


def estimate(cfg: CostConfig) -> dict:
    """Every figure of the cost model for `cfg` as a JSON-serialisable nested dict."""
    conns = cfg.connections
    flops = {kind: connection_flops(kind, cfg.streams, cfg.hidden, cfg.sinkhorn_iters)
             for kind in KINDS}
    params = {kind: connection_params(kind, cfg.streams, cfg.hidden) for kind in KINDS}
    dp, tp = cfg.data_parallel, cfg.tensor_parallel
    allreduce = {  # ring all-reduce of the connection parameters' gradients, per rank
        kind: bytes_for(conns * params[kind]["total"], cfg.dtype) * 2 * (dp - 1) / dp
        for kind in KINDS
    }
    kv = kv_cache_bytes(cfg.layers, cfg.tokens, cfg.kv_dim, cfg.dtype, cfg.batch)
    return {
        "config": asdict(cfg) | {
            "connections": conns,
            "stage_connections": cfg.stage_connections,
            "micro_batch_size": cfg.micro_batch_size,
            "attention_dim": cfg.attention_dim,
            "kv_dim": cfg.kv_dim,
            "ffn_dim": cfg.ffn_dim,
            "bits_per_element": DTYPE_BITS[cfg.dtype],
        },
        "memory_access": _memory_access_report(cfg),
        "params": _params_report(cfg, params),
        "flops": _flops_report(cfg, flops),
        "activations": activation_memory(cfg),
        "pipeline": pipeline_communication(cfg),
        "kv_cache": {
            "bytes": kv,
            "bytes_per_device": kv / tp,
            "gib": kv / 2**30,
        },
        "data_parallel": {
            "tokens_per_step": cfg.batch * cfg.tokens * dp,
            "connection_grad_allreduce_bytes_per_rank": allreduce,
        },
    }


def _memory_access_report(cfg: CostConfig) -> dict:
    """estimate()'s "memory_access": per kind the elements and bytes of one connection, the
    whole model's bytes per token and the ratio to the residual connection."""
    access = {kind: memory_access(kind, cfg.streams, cfg.hidden) for kind in KINDS}
    for a in access.values():
        a["read_bytes"] = bytes_for(a["read"], cfg.dtype)
        a["write_bytes"] = bytes_for(a["write"], cfg.dtype)
        a["total_bytes"] = bytes_for(a["total"], cfg.dtype)
    residual_total = access["residual"]["total"]
    return {
        "unit": "elements (and bytes) per token, one connection, forward",
        **access,
        "model_bytes_per_token": {
            kind: bytes_for(cfg.connections * access[kind]["total"], cfg.dtype)
            for kind in KINDS
        },
        "ratio_to_residual": {kind: access[kind]["total"] / residual_total for kind in KINDS},
    }


def _params_report(cfg: CostConfig, params: dict) -> dict:
    """estimate()'s "params": the connections' parameters against the blocks'."""
    block_p = block_params(cfg)
    model_block_params = cfg.layers * block_p["total"]
    conns = cfg.connections
    return {
        "per_connection": params,
        "model": {kind: conns * params[kind]["total"] for kind in KINDS},
        "block": block_p,
        "model_blocks": model_block_params,
        "relative_to_blocks": {
            kind: conns * params[kind]["total"] / model_block_params for kind in KINDS
        },
    }


def _flops_report(cfg: CostConfig, flops: dict) -> dict:
    """estimate()'s "flops": forward FLOPs per token, whole model, and the overheads."""
    conns, block_f = cfg.connections, block_flops(cfg)
    model_forward = {  # per token, whole model
        kind: cfg.layers * block_f["total"] + conns * flops[kind]["total"] for kind in KINDS
    }
    # Training: 3x forward; mHC with recomputation runs its kernels forward twice (4x).
    train_residual = 3 * model_forward["residual"]
    train_mhc_recompute = 3 * cfg.layers * block_f["total"] + 4 * conns * flops["mhc"]["total"]
    # Per device with tensor parallelism: the block is sharded, the connection replicated.
    per_device = {
        kind: cfg.layers * block_f["total"] / cfg.tensor_parallel + conns * flops[kind]["total"]
        for kind in KINDS
    }
    return {
        "unit": "forward FLOPs per token",
        "per_connection": flops,
        "block": block_f,
        "model_forward": model_forward,
        "overhead_forward": {
            kind: model_forward[kind] / model_forward["residual"] - 1 for kind in KINDS
        },
        "overhead_training_mhc_recompute": train_mhc_recompute / train_residual - 1,
        "overhead_forward_per_device": {
            kind: per_device[kind] / per_device["residual"] - 1 for kind in KINDS
        },
    }


def paper_27b_overhead(**overrides) -> dict:
    """What the model says about mHC against the residual network for PAPER_27B.

    Keyword arguments override the preset (e.g. tokens=8192). The paper reports 6.7% more
    training time; this model counts memory traffic and FLOPs, not time.
    """
    report = estimate(CostConfig(**(PAPER_27B | overrides)))
    access, flops = report["memory_access"], report["flops"]
    model_bytes = access["model_bytes_per_token"]
    return {
        "config": report["config"],
        "memory_traffic_ratio_to_residual_connection": access["ratio_to_residual"]["mhc"],
        "memory_traffic_extra_bytes_per_token": model_bytes["mhc"] - model_bytes["residual"],
        "flop_overhead_forward": flops["overhead_forward"]["mhc"],
        "flop_overhead_training_recompute": flops["overhead_training_mhc_recompute"],
        "param_overhead": report["params"]["relative_to_blocks"]["mhc"],
        "paper_reported_training_time_overhead": PAPER_REPORTED_TRAINING_OVERHEAD,
    }
