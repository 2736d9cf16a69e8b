"""HC and mHC connections as torchtitan modules.

torchtitan builds a model on the meta device, shards it, then initialises each module through
`Module.init_states`, which calls `reset_parameters()`; `BaseModel.verify_module_protocol`
rejects any submodule that is not a `torchtitan.protocols.module.Module`, and `parallelize`
needs a declared placement for every parameter and buffer. These subclasses add exactly that
to torch_mhc's connections; the maths is unchanged.

The branch is not stored (it would register the block's attention or MLP a second time, under
a new name): the block passes it to `forward` at each call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torchtitan.protocols.module import Module
from torchtitan.protocols.sharding import ShardingConfig

from torch_mhc.connections import HyperConnection, ManifoldHyperConnection


def _branch_given_at_call(*_args, **_kwargs):
    raise RuntimeError("a torchtitan connection takes its branch as forward(x, branch, ...)")


class _TitanConnection(Module):
    """forward(x [B, T, n, C], branch, *args) -> [B, T, n, C]."""

    def forward(self, x: torch.Tensor, branch: Callable, *args) -> torch.Tensor:
        self.check_input(x)
        x = x if x.is_contiguous() else x.contiguous()
        h_in, state = self.mix_in(x)  # [B, T, C]
        f = branch(h_in, *args)
        self.check_branch_output(f, h_in)
        return self.mix_out(x, f, state)

    def declare_replicated(self, layout) -> None:
        """Every parameter and buffer placed by `layout` (a torchtitan SpmdLayout): the one
        the block's RMSNorm weight has, i.e. replicated over TP, since the maps are computed
        per token from the whole streams vector."""
        names = [n for n, _ in self.named_parameters(recurse=False)]
        names += [n for n, _ in self.named_buffers(recurse=False)]
        self._sharding_config = ShardingConfig(state_shardings={n: layout for n in names})


class TitanHyperConnection(HyperConnection, _TitanConnection):
    """HyperConnection (HC) for torchtitan blocks."""

    def __init__(self, dim: int, streams: int, layer_index: int, **kwargs):
        HyperConnection.__init__(self, dim, streams, layer_index, _branch_given_at_call,
                                 **kwargs)

    forward = _TitanConnection.forward


class TitanManifoldHyperConnection(ManifoldHyperConnection, _TitanConnection):
    """ManifoldHyperConnection (mHC) for torchtitan blocks."""

    def __init__(self, dim: int, streams: int, layer_index: int, **kwargs):
        ManifoldHyperConnection.__init__(self, dim, streams, layer_index,
                                         _branch_given_at_call, **kwargs)

    forward = _TitanConnection.forward


TITAN_CONNECTIONS = {"hc": TitanHyperConnection, "mhc": TitanManifoldHyperConnection}
