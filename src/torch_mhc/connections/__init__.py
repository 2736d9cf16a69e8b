"""The connections, as drop-in nn.Modules around a branch (attention, MLP, any block).

base (the Connection base class and the helpers the kinds share), residual, hc, mhc,
successors (mHC-lite, KromHC, static H_res), factory (build by kind, expand and reduce the
streams, the optimizer's parameter groups), stream_head (DeepSeek-V4's learned stream
reduction).
"""

from torch_mhc.connections.base import Connection, frozen_connections
from torch_mhc.connections.factory import (
    CONNECTION_KINDS,
    check_streams,
    connection_options,
    expand_streams,
    make_connection,
    param_groups,
    reduce_streams,
)
from torch_mhc.connections.hc import HyperConnection
from torch_mhc.connections.mhc import ManifoldHyperConnection
from torch_mhc.connections.residual import Residual
from torch_mhc.connections.stream_head import StreamHead
from torch_mhc.connections.successors import KromHC, MHCLite, MhcResVariant, MHCStaticRes

__all__ = [
    "CONNECTION_KINDS",
    "Connection",
    "HyperConnection",
    "KromHC",
    "MHCLite",
    "MHCStaticRes",
    "ManifoldHyperConnection",
    "MhcResVariant",
    "Residual",
    "StreamHead",
    "check_streams",
    "connection_options",
    "expand_streams",
    "frozen_connections",
    "make_connection",
    "param_groups",
    "reduce_streams",
]
