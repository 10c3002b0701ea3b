"""Finishing steps of the row statistics the block's epilogues leave as per-tile partial sums."""

from __future__ import annotations

import torch

from ..partials import const_vector


def row_mean(partials: torch.Tensor, d: int, add: float = 0.0) -> torch.Tensor:
    """Per-tile row partials [tiles, M] -> (sum over tiles) / d + add, in one addmv."""
    tiles, M = partials.shape
    ones = const_vector(tiles, 1.0 / d, partials.device)
    if add == 0.0:
        return torch.mv(partials.t(), ones)
    return torch.addmv(const_vector(M, add, partials.device), partials.t(), ones)


def rstd(partials: torch.Tensor, d: int, eps: float) -> torch.Tensor:
    """RMSNorm's r = rsqrt(mean x^2 + eps) from per-tile partial sums of x^2 (two launches). Not in
    place: r is saved for the backward, and Dynamo cannot save an in-place result from a traced
    autograd.Function (the block's forward under torch.compile)."""
    return row_mean(partials, d, eps).rsqrt()
