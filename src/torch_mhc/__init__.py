"""torch-mhc: Manifold-Constrained Hyper-Connections (mHC), HC and the plain residual."""

from . import diagnostics
from .connections import (
    CONNECTION_KINDS,
    HyperConnection,
    ManifoldHyperConnection,
    Residual,
    expand_streams,
    make_connection,
    param_groups,
    reduce_streams,
)
from .diagnostics import collect_gains, collect_health
from .sinkhorn import sinkhorn, sinkhorn_unrolled
from .stream_head import StreamHead
from .variants import KromHC, MHCLite, MHCStaticRes

__version__ = "0.1.0"

__all__ = [
    "CONNECTION_KINDS",
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
    "make_connection",
    "param_groups",
    "reduce_streams",
    "sinkhorn",
    "sinkhorn_unrolled",
]
