"""torch-mhc: Manifold-Constrained Hyper-Connections (mHC), HC and the plain residual."""

from torch_mhc.connections import (
    CONNECTION_KINDS,
    Connection,
    HyperConnection,
    KromHC,
    ManifoldHyperConnection,
    MHCLite,
    MHCStaticRes,
    Residual,
    StreamHead,
    expand_streams,
    frozen_connections,
    make_connection,
    param_groups,
    reduce_streams,
)
from torch_mhc.functional.sinkhorn import sinkhorn, sinkhorn_unrolled
from torch_mhc.runtime import diagnostics
from torch_mhc.runtime.diagnostics import collect_gains, collect_health
from torch_mhc.runtime.param_updates import parameters_changed

__version__ = "0.1.0"

__all__ = [
    "CONNECTION_KINDS",
    "Connection",
    "HyperConnection",
    "KromHC",
    "MHCLite",
    "MHCStaticRes",
    "ManifoldHyperConnection",
    "Residual",
    "StreamHead",
    "collect_gains",
    "collect_health",
    "diagnostics",
    "expand_streams",
    "frozen_connections",
    "make_connection",
    "param_groups",
    "parameters_changed",
    "reduce_streams",
    "sinkhorn",
    "sinkhorn_unrolled",
]
