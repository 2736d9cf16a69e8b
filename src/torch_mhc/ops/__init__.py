"""Op implementations behind the connections: `reference` (plain torch, the test oracle)."""

from . import reference

__all__ = ["reference"]
