"""The FP8 copies of a block's GEMM weights, in the two layouts the FP8 GEMMs read, made once per
optimizer step: the bf16 (or fp32) master weights stay the parameters.

FP8 tensor cores read K-major operands only, so each weight W (N, K) is needed as W itself (the
forward: K = the layer's input) and as W^T (K, N) (the dX GEMM: K = the layer's output). Both come
from one quantisation in 128 x 128 tiles: W^T's tiles are W's tiles transposed, with the same amax,
so its codes and scales are W's transposed (exactly). Under per-tensor scaling ("tensorwise") the
scale is W's current amax over fp8_max and W^T is the same codes transposed.

A copy is remade when the weight may have changed: after every optimizer step (a global
``torch.optim`` step post-hook moves a generation counter that is part of each copy's stamp: fused
optimizers and FSDP2's re-gathers change parameters without moving their version counters), when
its version counter, storage, shape, dtype or device moves (a load_state_dict, an in-place edit
under no_grad), and after ``weights_changed()`` (edits that show in none of these: through
``.data``, or a hand-written update outside any torch optimizer).

``halves=True`` (the gate/up weight of a per-tensor block, rows interleaved gate, up, gate, ...):
W^T's columns are ordered gate rows first, then up rows, matching dz written as its two halves by
the down-proj dX epilogue (epilogues/fp8_tensorwise.py: swiglu_backward_t).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ...quantization import quantize_tiles
from ..precision import no_autocast
from .copies import (blocks_tensor_copies, tensor_copies, tensor_copies_all, tensor_scale, tensor_scales_all,
                     weight_tiles, weight_tiles_all)
from .kernels import programs
from .recipe import Fp8Recipe

_generation = 0          # moved by every optimizer step and by weights_changed(): part of each stamp
_hook: Any = None


def weights_changed() -> None:
    """Every FP8 weight copy of every FP8 block is made again on its next use. Call it after changing
    parameters in a way their version counters do not show: through ``.data`` (``p.data.add_(...)``,
    a hand-written update or initialisation, an EMA swap), or by an optimizer that is not a
    ``torch.optim.Optimizer``. Steps of torch optimizers (fused and foreach ones included) call it
    themselves; in-place edits of the parameters (``with torch.no_grad(): p.mul_(2)``) and
    ``load_state_dict`` are seen anyway."""
    global _generation
    _generation += 1


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    weights_changed()


def _watch_optimizer_steps() -> None:
    """Register the global optimizer step post-hook once per process (on the first FP8 block)."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_post_hook(_after_optimizer_step)


@dataclass(frozen=True)
class Fp8Weight:
    """W (N, K) in FP8 with its 128 x 128 scales (N/128, K/128), and W^T (K, N) with (K/128, N/128);
    per tensor: both scales the same 0-dim tensor."""
    w: torch.Tensor
    scale: torch.Tensor
    wt: torch.Tensor
    scale_t: torch.Tensor


class Fp8Weights:
    """A cache of FP8 weight copies keyed by the parameter: quantised again only when it may have
    changed (the module docstring). Copies and pickles of it start empty (the keys are the objects'
    ids)."""

    def __init__(self, recipe: Fp8Recipe):
        self.recipe = recipe
        self._cache: dict[tuple[int, bool], tuple[tuple, Fp8Weight]] = {}
        _watch_optimizer_steps()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _watch_optimizer_steps()

    def get(self, w: torch.Tensor, *, halves: bool = False, runner: Any = None) -> Fp8Weight:
        """W's FP8 copies, made again when W may have changed (compiled torch; the blocks take a
        block's four together, ``get_all``); per tensor by ``runner``'s map kernel (``_per_tensor``)
        when one is given."""
        hit = self._cached(w, halves)
        if hit is not None:
            return hit
        with torch.no_grad(), no_autocast(w.device):
            if self.recipe.scaling == "tensor":
                entry = _per_tensor(w.detach(), self.recipe, halves, runner)
            elif self.recipe.pow2 and w.shape[0] % 128 == 0 and w.shape[1] % 128 == 0:
                entry = Fp8Weight(*weight_tiles(w.detach(), self.recipe.weight))
            else:
                q, s = quantize_tiles(w.detach(), self.recipe.weight, 128, self.recipe.pow2)
                entry = Fp8Weight(q, s, q.t().contiguous(), s.t().contiguous())
        self._cache[(id(w), halves)] = (_stamp(w), entry)
        return entry

    def get_all(self, ws: list[tuple[torch.Tensor, bool]], *, runner: Any = None) -> list[Fp8Weight]:
        """(W, halves) pairs' copies, as ``get`` makes them one by one; the stale ones together, in one
        compiled call on a GPU (a block's four weights after every optimizer step: one host call
        instead of four). With a runner (per tensor), their scales in one compiled call and the codes
        by its map kernel, a launch a weight (``_per_tensor``). Weights the batched copies do not take
        (blockwise shapes off the 128 grid, scales not powers of two) go one by one."""
        out = [self._cached(w, h) for w, h in ws]          # one freshness lookup a weight
        stale = [i for i, hit in enumerate(out) if hit is None]
        if len(stale) > 1 and self._batchable([ws[i][0] for i in stale]):
            with torch.no_grad(), no_autocast(ws[stale[0]][0].device):
                plain = [ws[i][0].detach() for i in stale]
                if self.recipe.scaling == "tensor" and runner is not None and \
                        all(w.dtype == runner.dtype for w in plain):
                    scales = tensor_scales_all(plain, self.recipe.weight, self.recipe.pow2)
                    made = [_per_tensor(w, self.recipe, ws[i][1], runner, s) for i, w, s in zip(stale, plain, scales)]
                elif self.recipe.scaling == "tensor":
                    made = [Fp8Weight(q, s, qt, s) for q, s, qt in
                            tensor_copies_all(plain, self.recipe.weight, tuple(ws[i][1] for i in stale),
                                              self.recipe.pow2)]
                else:
                    made = [Fp8Weight(*c) for c in weight_tiles_all(plain, self.recipe.weight)]
            for i, entry in zip(stale, made):
                w, h = ws[i]
                self._cache[(id(w), h)] = (_stamp(w), entry)
                out[i] = entry
        return [hit if hit is not None else self.get(w, halves=h, runner=runner) for hit, (w, h) in zip(out, ws)]

    def stale_batch(self, ws: list[tuple[torch.Tensor, bool]]) -> list[tuple[torch.Tensor, bool]]:
        """The (W, halves) pairs whose copies must be made again, when one batched call can make them
        (else none: ``get_all`` makes them)."""
        stale = [(w, h) for w, h in ws if self._cached(w, h) is None]
        return stale if stale and self._batchable([w for w, _ in stale]) else []

    def store(self, w: torch.Tensor, halves: bool, entry: Fp8Weight) -> None:
        """Copies of W made outside the cache (``make_tensor_copies_together``), stamped as ``get``'s."""
        self._cache[(id(w), halves)] = (_stamp(w), entry)

    def _cached(self, w: torch.Tensor, halves: bool) -> Fp8Weight | None:
        """W's copies if made since W last (possibly) changed."""
        hit = self._cache.get((id(w), halves))
        return hit[1] if hit is not None and hit[0] == _stamp(w) else None

    def _batchable(self, ws: list[torch.Tensor]) -> bool:
        if len({w.device for w in ws}) != 1:
            return False
        if self.recipe.scaling == "tensor":
            return True
        return self.recipe.pow2 and all(w.shape[0] % 128 == 0 and w.shape[1] % 128 == 0 for w in ws)

    def clear(self) -> None:
        self._cache.clear()


class PinnedWeights:
    """The FP8 copies one forward used, kept for its backward: the dX GEMMs read the W^T that came
    with the W the forward read, whatever happened to the cache in between (an optimizer step of
    another model, ``weights_changed()``)."""

    def __init__(self, source: Fp8Weights):
        self.source = source
        self.used: dict[tuple[int, bool], Fp8Weight] = {}

    def get(self, w: torch.Tensor, *, halves: bool = False, runner: Any = None) -> Fp8Weight:
        key = (id(w), halves)
        hit = self.used.get(key)
        if hit is None:
            hit = self.used[key] = self.source.get(w, halves=halves, runner=runner)
        return hit

    def get_all(self, ws: list[tuple[torch.Tensor, bool]], *, runner: Any = None) -> list[Fp8Weight]:
        missing = [(w, h) for w, h in ws if (id(w), h) not in self.used]
        if missing:
            for (w, h), entry in zip(missing, self.source.get_all(missing, runner=runner)):
                self.used[(id(w), h)] = entry
        return [self.used[(id(w), h)] for w, h in ws]


def make_tensor_copies_together(caches: list[tuple[Fp8Weights, list[tuple[torch.Tensor, bool]]]],
                                per_call: int) -> None:
    """Per-tensor copies of several caches' stale weights (a model's blocks, each cache with its
    (W, halves) pairs), ``per_call`` caches' weights in one compiled call on a GPU: the copies each
    cache's ``get_all`` makes (the same function of each weight), with a call's host cost (guards, a
    launch per kernel) shared by more weights. Weights of one format, scale kind and device go
    together; the rest stays to ``get_all``."""
    # (format, power-of-two scales, device) -> the caches' stale pairs
    groups: dict[tuple[torch.dtype, bool, torch.device], list[tuple[Fp8Weights, list[tuple[torch.Tensor, bool]]]]] = \
        collections.defaultdict(list)
    for cache, ws in caches:
        stale = cache.stale_batch(ws) if cache.recipe.scaling == "tensor" else []
        if stale:
            groups[(cache.recipe.weight, cache.recipe.pow2, stale[0][0].device)].append((cache, stale))
    for (fmt, pow2, device), items in groups.items():
        for k in range(0, len(items), per_call):
            flat = [(cache, w, h) for cache, ws in items[k:k + per_call] for w, h in ws]
            with torch.no_grad(), no_autocast(device):
                made = blocks_tensor_copies([w.detach() for _, w, _ in flat], fmt, tuple(h for *_, h in flat), pow2)
            for (cache, w, h), (q, scale, qt) in zip(flat, made):
                cache.store(w, h, Fp8Weight(q, scale, qt, scale))


def _stamp(w: torch.Tensor) -> tuple:
    """What says W may have changed since its copies were made (the module docstring)."""
    return (_generation, w.data_ptr(), w._version, tuple(w.shape), w.dtype, w.device)


def _per_tensor(w: torch.Tensor, recipe: Fp8Recipe, halves: bool, runner: Any,
                scale: torch.Tensor | None = None) -> Fp8Weight:
    """W's codes with one scale from its current amax, and W^T's. With a runner and W in its dtype,
    by the ``quantize_tensor`` map kernel the blocks quantise their attention outputs with: one read of
    W, both layouts written, the transpose done in registers; under ``halves`` the kernel reads W's
    rows as gate rows, then up rows (a strided view), and writes W's codes back through the same
    view. Else, and for fp32 master weights, the compiled torch copies (what the blocks use:
    ``tensorwise.weight_copies`` says why). ``scale``: W's, made already (``tensor_scales_all``)."""
    if runner is None or w.dtype != runner.dtype:
        q, scale, qt = tensor_copies(w, recipe.weight, halves, recipe.pow2)
        return Fp8Weight(q, scale, qt, scale)
    w = w.contiguous()                             # the halves view needs W's rows in one run
    scale = tensor_scale(w, recipe.weight, recipe.pow2) if scale is None else scale
    R, C = w.shape
    q = torch.empty(R, C, dtype=recipe.weight, device=w.device)
    x, q_view = (w, q) if not halves else (_as_halves(w), _as_halves(q))
    # partial: the kernel's amax (W's, known already) stays unfinished, no launches for it
    out = runner.map("weight.quant", programs(recipe).quantize_weight, x, partial=True, out={"q": q_view}, s=scale)
    qt = out["qt"] if out["qt"].is_contiguous() else out["qt"].contiguous()   # rows padded to 16 bytes
    return Fp8Weight(q, scale, qt, scale)


def _as_halves(t: torch.Tensor) -> torch.Tensor:
    """(R, C) rows interleaved a, b, a, b, ... -> the (2, R / 2, C) view whose rows read a's, then b's."""
    R, C = t.shape
    return t.view(R // 2, 2, C).transpose(0, 1)
