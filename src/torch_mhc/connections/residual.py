"""The plain residual x + F(x), as a connection on a single stream (n = 1)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from torch_mhc.connections.base import Connection, check_count

__all__ = ["Residual"]


class Residual(Connection):
    """The plain residual x + F(x) on a single stream: x [..., 1, C].

    check_finite checks the input and the branch output, as every kind's does; impl is taken
    so that one make_connection call serves every kind (the residual has no maps whose ops it
    would choose)."""

    kind = "residual"

    def __init__(self, dim: int, branch: Callable, layer_index: int = 0,
                 check_finite: bool = False, impl: str = "auto"):
        super().__init__(dim, 1, branch, check_finite, impl)
        self.layer_index = check_count(layer_index, "Residual", "layer_index", 0)

    def check_input(self, x: torch.Tensor) -> None:
        try:
            super().check_input(x)
        except ValueError as err:
            if x.dim() >= 2 and x.shape[-1] == self.dim:  # n streams where one was expected
                raise ValueError(f"{err}: the residual connection carries one stream (make_"
                                 f"connection ignores streams for it); expand with "
                                 f"expand_streams(h, 1)") from None
            raise

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self.check_input(x)
        if self.check_finite:
            self._check_finite("the input streams", x)
        h = x.squeeze(-2)
        f = self.branch(h, *args, **kwargs)
        self.check_branch_output(f, h)
        return x + f.unsqueeze(-2)
