"""The FP8 copies of a block's GEMM weights, in the two layouts the FP8 GEMMs read, made once per
optimizer step: the bf16 (or fp32) master weights stay the parameters.

FP8 tensor cores read K-major operands only, so each weight W (N, K) is needed as W itself (the
forward: K = the layer's input) and as W^T (K, N) (the dX GEMM: K = the layer's output). Both come
from one quantisation in 128 x 128 tiles: W^T's tiles are W's tiles transposed, with the same amax,
so its codes and scales are W's transposed (exactly). Under per-tensor scaling ("tensorwise") the
scale is W's current amax over fp8_max and W^T is the same codes transposed. A copy is remade when
the weight's data changes (its version counter moves: an optimizer step, a load_state_dict, an
in-place edit).

``halves=True`` (the gate/up weight of a per-tensor block, rows interleaved gate, up, gate, ...):
W^T's columns are ordered gate rows first, then up rows, matching dz written as its two halves by
the down-proj dX epilogue (epilogues/fp8_tensorwise.py: swiglu_backward_t).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...quantization import quantize_tiles
from .copies import tensor_copies, weight_tiles
from .recipe import Fp8Recipe


@dataclass(frozen=True)
class Fp8Weight:
    """W (N, K) in FP8 with its 128 x 128 scales (N/128, K/128), and W^T (K, N) with (K/128, N/128);
    per tensor: both scales the same 0-dim tensor."""
    w: torch.Tensor
    scale: torch.Tensor
    wt: torch.Tensor
    scale_t: torch.Tensor


class Fp8Weights:
    """A cache of FP8 weight copies keyed by the parameter: quantised again only when it changed."""

    def __init__(self, recipe: Fp8Recipe):
        self.recipe = recipe
        self._cache: dict[tuple[int, bool], tuple[tuple, Fp8Weight]] = {}

    def get(self, w: torch.Tensor, *, halves: bool = False) -> Fp8Weight:
        stamp = (w.data_ptr(), w._version, tuple(w.shape), w.dtype, w.device)
        key = (id(w), halves)
        hit = self._cache.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        with torch.no_grad():
            if self.recipe.scaling == "tensor":
                entry = _per_tensor(w.detach(), self.recipe, halves)
            elif self.recipe.pow2 and w.shape[0] % 128 == 0 and w.shape[1] % 128 == 0:
                entry = Fp8Weight(*weight_tiles(w.detach(), self.recipe.weight))
            else:
                q, s = quantize_tiles(w.detach(), self.recipe.weight, 128, self.recipe.pow2)
                entry = Fp8Weight(q, s, q.t().contiguous(), s.t().contiguous())
        self._cache[key] = (stamp, entry)
        return entry

    def clear(self) -> None:
        self._cache.clear()


def _per_tensor(w: torch.Tensor, recipe: Fp8Recipe, halves: bool) -> Fp8Weight:
    q, scale, qt = tensor_copies(w, recipe.weight, halves, recipe.pow2)
    return Fp8Weight(q, scale, qt, scale)
