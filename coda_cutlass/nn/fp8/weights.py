"""The FP8 copies of a block's GEMM weights, in the two layouts the FP8 GEMMs read, made once per
optimizer step: the bf16 (or fp32) master weights stay the parameters.

FP8 tensor cores read K-major operands only, so each weight W (N, K) is needed as W itself (the
forward: K = the layer's input) and as W^T (K, N) (the dX GEMM: K = the layer's output). Both come
from one quantisation in 128 x 128 tiles: W^T's tiles are W's tiles transposed, with the same amax,
so its codes and scales are W's transposed (exactly). A copy is remade when the weight's data
changes (its version counter moves: an optimizer step, a load_state_dict, an in-place edit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...quantization import quantize_tiles
from .recipe import Fp8Recipe
from .copies import weight_tiles


@dataclass(frozen=True)
class Fp8Weight:
    """W (N, K) in FP8 with its 128 x 128 scales (N/128, K/128), and W^T (K, N) with (K/128, N/128)."""
    w: torch.Tensor
    scale: torch.Tensor
    wt: torch.Tensor
    scale_t: torch.Tensor


class Fp8Weights:
    """A cache of FP8 weight copies keyed by the parameter: quantised again only when it changed."""

    def __init__(self, recipe: Fp8Recipe):
        self.recipe = recipe
        self._cache: dict[int, tuple[tuple, Fp8Weight]] = {}

    def get(self, w: torch.Tensor) -> Fp8Weight:
        stamp = (w.data_ptr(), w._version, tuple(w.shape), w.dtype, w.device)
        hit = self._cache.get(id(w))
        if hit is not None and hit[0] == stamp:
            return hit[1]
        with torch.no_grad():
            if self.recipe.pow2 and w.shape[0] % 128 == 0 and w.shape[1] % 128 == 0:
                entry = Fp8Weight(*weight_tiles(w.detach(), self.recipe.weight))
            else:
                q, s = quantize_tiles(w.detach(), self.recipe.weight, 128, self.recipe.pow2)
                entry = Fp8Weight(q, s, q.t().contiguous(), s.t().contiguous())
        self._cache[id(w)] = (stamp, entry)
        return entry

    def clear(self) -> None:
        self._cache.clear()
