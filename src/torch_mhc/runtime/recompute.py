"""Selective recomputation of the connections' stream arithmetic (mHC paper, section 4.3).

A connection's own work (maps, pre-aggregation, post-and-merge) is cheap to compute but
saves n-stream tensors for backward: the streams x_l [..., n, C] themselves, their fp32
copies, the maps. Inside `recompute_streams(interval)` consecutive connections are grouped
L_r = interval at a time. Of each group only the input streams x_l0 are kept, together with
every branch output f_l [..., C] (which cannot be recomputed without rerunning the block).
Everything the connections' ops save for backward is replaced by a small handle; the first
backward access replays the group's stream arithmetic from x_l0 and the stored f_l

    x_{l+1} = H_res_l x_l + H_post_l^T f_l

without rerunning any block, and hands out the recomputed tensors. The blocks themselves
save what they always save.

    with recompute_streams(interval):          # None: sqrt(n L / (n + 2)), halves up
        for conn in connections:
            x = conn(x)

The replay follows the forward op for op, so the tensors it saves come out in the same
order as the forward's (the same trick as torch.utils.checkpoint's non-reentrant mode).
Residual connections have nothing to recompute and run unchanged.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

__all__ = ["recompute_streams", "optimal_interval", "RecomputeStats"]

ACTIVE: _Controller | None = None  # read by every connection's forward


def optimal_interval(streams: int, layers: int) -> int:
    """L_r* = sqrt(n L / (n + 2)) (paper section 4.3) rounded to the nearest integer, halves
    up (floor(x + 0.5), not Python's round, which takes halves to even), at least 1. The one
    definition of L_r*: `mhc cost` uses it too.

    `layers` is L in the paper's sense: the number of connections the interval is chosen
    for (a whole model has 2 per transformer block; the cost model passes one pipeline
    stage's). Exact in integers: floor(sqrt(q) + 1/2) = floor((floor(sqrt(4q)) + 1) / 2) and
    floor(sqrt(4q)) = isqrt(floor(4 n L / (n + 2))), so a half-way case (n = 6, L = 27:
    sqrt(20.25) = 4.5 -> 5) never depends on float rounding.
    """
    for name, value in (("streams", streams), ("layers", layers)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return max(1, (math.isqrt(4 * streams * layers // (streams + 2)) + 1) // 2)


@dataclass
class RecomputeStats:
    """What the groups kept alive for backward (bytes), for measurements."""

    group_inputs: int = 0  # x_l0 of each group
    branch_outputs: int = 0  # f_l of every layer
    replays: int = 0  # how many times a group was replayed in backward

    @property
    def kept(self) -> int:
        return self.group_inputs + self.branch_outputs


@dataclass
class _Layer:
    conn: object
    f: torch.Tensor | None = None  # branch output, detached
    f_requires_grad: bool = False
    packed: int = 0  # tensors packed in forward


@dataclass
class _Group:
    x0: torch.Tensor
    x0_requires_grad: bool
    autocast: tuple  # (device type, enabled, dtype) at forward time, restored in the replay
    stats: RecomputeStats
    layers: list[_Layer] = field(default_factory=list)
    replayed: dict = field(default_factory=dict)  # layer index -> list of saved tensors
    unpacked: dict = field(default_factory=dict)  # layer index -> count handed out


def _autocast_state(device_type: str) -> tuple:
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(
        device_type
    )


class _Controller:
    def __init__(self, interval: int, stats: RecomputeStats):
        self.interval, self.stats = interval, stats
        self.count = 0
        self.group: _Group | None = None

    def run(self, conn, x, args, kwargs):
        """A connection's forward with its saved tensors replaced by handles (the connection
        calls this only when autograd is recording)."""
        if self.count % self.interval == 0:
            self.group = _Group(
                x.detach(), x.requires_grad, _autocast_state(x.device.type), self.stats
            )
            self.stats.group_inputs += x.numel() * x.element_size()
        self.count += 1
        group = self.group
        k = len(group.layers)
        layer = _Layer(conn)
        group.layers.append(layer)

        def pack(t):
            layer.packed += 1
            return (group, k, layer.packed - 1)

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            h_in, state = conn.mix_in(x)
        f = conn.branch(h_in, *args, **kwargs)  # the block saves what it always saves
        conn.check_branch_output(f, h_in)
        layer.f, layer.f_requires_grad = f.detach(), f.requires_grad
        self.stats.branch_outputs += f.numel() * f.element_size()
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            return conn.mix_out(x, f, state)


def _replay(group: _Group, upto: int) -> None:
    """Rerun the stream arithmetic of layers 0..upto, keeping what each op saves."""
    dev, enabled, dtype = group.autocast
    x = group.x0.detach().requires_grad_(group.x0_requires_grad)
    with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
        for k in range(upto + 1):
            layer = group.layers[k]
            saved: list[torch.Tensor] = []

            def pack(t, saved=saved):
                # The replay's own graph never runs backward, so it keeps nothing, and the
                # list keeps a detached alias. Handing t back would leak every replayed
                # tensor: a node saving its own output would hold that output, whose grad_fn
                # is the node, a cycle through C++ that Python's collector cannot see.
                saved.append(t.detach())

            f = layer.f.detach().requires_grad_(layer.f_requires_grad)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
                _, state = layer.conn.mix_in(x)
                x = layer.conn.mix_out(x, f, state)
            if len(saved) != layer.packed:
                raise RuntimeError(
                    f"recomputation of connection {k} saved {len(saved)} tensors, the forward "
                    f"saved {layer.packed}: the connection's ops are not deterministic in "
                    "what they save"
                )
            if k not in group.replayed:
                group.replayed[k], group.unpacked[k] = saved, 0
    group.stats.replays += 1


def _unpack(handle):
    group, k, i = handle
    if k not in group.replayed:
        _replay(group, k)
    t = group.replayed[k][i]
    group.unpacked[k] += 1
    if group.unpacked[k] == group.layers[k].packed:  # all handed out: free this layer
        del group.replayed[k], group.unpacked[k]
    return t


@contextlib.contextmanager
def recompute_streams(interval: int | None = None, *, streams: int = 4,
                      layers: int | None = None):
    """Group the connections called inside into blocks of `interval` and recompute their
    stream arithmetic in backward. interval=None uses optimal_interval(streams, layers), where
    layers is the number of connections the forward calls (two per transformer block).

    Yields a RecomputeStats that counts the bytes kept for backward.
    """
    global ACTIVE
    if interval is None:
        if layers is None:
            raise ValueError("recompute_streams needs an interval, or layers (the connections "
                             "the forward calls: two per transformer block) to choose "
                             "optimal_interval(streams, layers)")
        interval = optimal_interval(streams, layers)
    if not isinstance(interval, int) or interval < 1:
        raise ValueError(f"recompute interval must be an int >= 1, got {interval!r}")
    if ACTIVE is not None:
        raise RuntimeError("recompute_streams() is already active; nesting is not supported")
    stats = RecomputeStats()
    ACTIVE = _Controller(interval, stats)
    try:
        yield stats
    finally:
        ACTIVE = None
