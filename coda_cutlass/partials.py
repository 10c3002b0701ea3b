"""Reduction partials: the one description of how a kernel lays out its per-tile partial results
(``PartialLayout``, carried by the reduction's ``TensorSlot``) and how they are finished.

Reductions across CTA tiles run in partial mode (docs/DESIGN.md): each CTA writes the reduction of its
own tile into an fp32 buffer, and a small deterministic step after the kernel finishes them. The
buffer of a reduction over N (row, all, lse, segment) has one row of partials per N-tile, each
``round_up(M, tile_m)`` long; over M (col), one row per M-tile, ``round_up(N, tile_n)`` long.
Log-sum-exp partials are (max, sum exp(x - max)) pairs; segment sums hold k = segments per tile
rows per N-tile (row t * k + s for segment s of N-tile t; ``templates/coda/segments.hpp`` writes
them). The runtime allocates and finishes by this class, the generated source documents each slot
with ``doc``, the fake (meta) implementation takes its shapes, and the reference interpreter
computes the same partials with ``reference``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from .ir.nodes import REDUCTION_IDENTITY, Node


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def segments_per_tile(width: int, tile_n: int) -> int:
    """How many width-wide segments one N-tile holds (1 when a segment spans whole tiles)."""
    return tile_n // width if width < tile_n else 1


def check_segment_tiling(width: int, tile_n: int) -> str | None:
    """Why a segment width does not fit an N-tile (None when it does)."""
    if width % tile_n != 0 and tile_n % width != 0:
        return (f"segment width {width} and the CTA tile width {tile_n} must divide one another "
                "(segments may span whole tiles, or tiles hold whole segments)")
    return None


@dataclass(frozen=True)
class PartialLayout:
    """The fp32 partials buffer of one reduction output (fn over axis; width for segment sums)."""
    fn: str          # sum, max, min, lse
    axis: str        # row, col, all, segment
    width: int = 0   # segment sums: the segment width

    @classmethod
    def of(cls, n: Node) -> "PartialLayout":
        """The layout of a ``reduce`` node's output."""
        return cls(n.attr("fn"), n.attr("axis"), n.attr("width", 0) if n.attr("axis") == "segment" else 0)

    @property
    def over_n(self) -> bool:
        """Partials per N-tile, indexed by row m (all but column reductions)."""
        return self.axis != "col"

    @property
    def identity(self) -> float:
        return REDUCTION_IDENTITY[self.fn]

    def segments(self, tile_n: int) -> int:
        """Rows of partials per N-tile: segments per tile for segment sums, else 1."""
        return segments_per_tile(self.width, tile_n) if self.width else 1

    def check(self, tile_n: int) -> str | None:
        """Why this reduction cannot run with an N-tile this wide (None when it can)."""
        return check_segment_tiling(self.width, tile_n) if self.width else None

    # ---------------------------------------------------------------- shapes
    def buffer_shape(self, M: int, N: int, tile: tuple[int, int]) -> tuple[int, ...]:
        """The buffer the kernel writes: [tiles (x segments), padded length] (x 2 for lse)."""
        tm, tn = tile
        if not self.over_n:
            return (_ceil_div(M, tm), _ceil_div(max(N, 1), tn) * tn)
        shape: tuple[int, ...] = (_ceil_div(N, tn) * self.segments(tn), _ceil_div(max(M, 1), tm) * tm)
        return shape + (2,) if self.fn == "lse" else shape

    def partial_shape(self, M: int, N: int, tile: tuple[int, int]) -> tuple[int, ...]:
        """What ``partial_reductions=True`` returns: the buffer without its padding."""
        rows, *rest = self.buffer_shape(M, N, tile)
        return (rows, M if self.over_n else N, *rest[1:])

    def partial_stride(self, M: int, N: int, tile: tuple[int, int]) -> tuple[int, ...]:
        """The strides of what ``partial_reductions=True`` returns: ``partial_view`` of the padded
        buffer keeps the buffer's (contiguous) strides. The fake implementation gives the same, so
        torch.compile's stride checks hold."""
        shape = self.buffer_shape(M, N, tile)
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= max(size, 1)
        return tuple(reversed(strides))

    def result_shape(self, M: int, N: int) -> tuple[int, ...]:
        """The finished reduction's shape."""
        if self.axis == "segment":
            return (M, N // self.width)
        return {"row": (M,), "col": (N,), "all": ()}[self.axis]

    def doc(self, tile_n: int) -> str:
        """The slot's comment in the generated source."""
        what = f"{self.axis}_{self.fn}" if self.axis != "all" else f"total_{self.fn}"
        layout = ("[ceil(N / tile_n), round_up(M, tile_m)]" if self.over_n
                  else "[ceil(M / tile_m), round_up(N, tile_n)]")
        if self.fn == "lse":
            return f"fp32 (max, sum exp(x - max)) pairs of {what}, {layout} x 2"
        if self.width:
            return (f"fp32 partials of segment sums (width {self.width}), [ceil(N / tile_n) * "
                    f"{self.segments(tile_n)}, round_up(M, tile_m)], row t * segments + s for segment s of N-tile t")
        return f"fp32 partials of {what}, {layout}"

    # ---------------------------------------------------------------- finishing
    def partial_view(self, buf: torch.Tensor, M: int, N: int) -> torch.Tensor:
        """The buffer without its padding (a view)."""
        return buf[:, :M if self.over_n else N]

    def finish(self, buf: torch.Tensor, M: int, N: int, tile_n: int) -> torch.Tensor:
        """Finish a partials buffer (padded or not) into the fp32 result, with one small deterministic
        call (row sums: cuBLAS, ``sum_tiles``)."""
        n = M if self.over_n else N
        if self.fn == "lse":
            return finish_lse(buf[:, :n])
        if self.axis == "segment":
            return finish_segments(buf[:, :n], self.width, tile_n, N)
        if self.axis == "all":
            return _reduce_all(buf[:, :n], self.fn)
        if self.fn == "sum":
            return sum_tiles(buf)[:n]        # reduce the padded buffer (contiguous), then slice
        return (torch.amax(buf, 0) if self.fn == "max" else torch.amin(buf, 0))[:n]

    # ---------------------------------------------------------------- reference
    def reference(self, x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
        """The partials the kernel writes (without padding), from the full M x N fp32 values."""
        M, N = x.shape
        tm, tn = tile
        if self.fn == "lse":
            return lse_partials(x, tn)
        if self.axis == "segment":
            return segment_partials(x, self.width, tn)
        if self.over_n:
            nt = _ceil_div(N, tn)
            pad = torch.full((M, nt * tn), self.identity, dtype=x.dtype, device=x.device)
            pad[:, :N] = x
            return _reduce(pad.view(M, nt, tn), self.fn, 2).t().contiguous()
        mt = _ceil_div(M, tm)
        pad = torch.full((mt * tm, N), self.identity, dtype=x.dtype, device=x.device)
        pad[:M] = x
        return _reduce(pad.view(mt, tm, N), self.fn, 1)


def _reduce_all(x: torch.Tensor, fn: str) -> torch.Tensor:
    """A total over every element, the identity when there is none (as the kernel's empty shapes)."""
    if x.numel() == 0:
        return torch.tensor(REDUCTION_IDENTITY[fn], dtype=x.dtype, device=x.device)
    return x.sum() if fn == "sum" else (x.amax() if fn == "max" else x.amin())


def _reduce(x: torch.Tensor, fn: str, dim: int) -> torch.Tensor:
    if fn == "sum":
        return x.sum(dim)
    return x.amax(dim) if fn == "max" else x.amin(dim)


def lse_partials(x: torch.Tensor, tn: int) -> torch.Tensor:
    """Per-N-tile online log-sum-exp states (max, sum exp(x - max)), shape (ceil(N/tn), M, 2)."""
    M, N = x.shape
    nt = _ceil_div(N, tn)
    pad = torch.full((M, nt * tn), float("-inf"), dtype=x.dtype, device=x.device)
    pad[:, :N] = x
    inside = torch.zeros((M, nt * tn), dtype=torch.bool, device=x.device)
    inside[:, :N] = True
    pad, inside = pad.view(M, nt, tn), inside.view(M, nt, tn)
    m = pad.amax(2, keepdim=True)
    e = torch.where(pad == m, torch.ones_like(pad), torch.exp(pad - m))   # -inf == -inf counts 1
    s = torch.where(inside, e, torch.zeros_like(e)).sum(2)
    s = torch.where(torch.isnan(m[..., 0]), m[..., 0], s)
    return torch.stack((m[..., 0], s), -1).transpose(0, 1).contiguous()


def segment_partials(x: torch.Tensor, width: int, tn: int) -> torch.Tensor:
    """Per-(N-tile, segment-in-tile) row sums, shape (ceil(N/tn) * k, M), row t * k + s; k = segments
    per tile (1 when a segment spans whole tiles)."""
    M, N = x.shape
    nt = _ceil_div(N, tn)
    pad = torch.zeros((M, nt * tn), dtype=x.dtype, device=x.device)
    pad[:, :N] = x
    k = segments_per_tile(width, tn)
    return pad.view(M, nt * k, tn // k).sum(2).t().contiguous()


def finish_lse(partials: torch.Tensor) -> torch.Tensor:
    """[tiles, M, 2] per-tile (max m, sum exp(x - m)) states -> [M] log-sum-exp, as
    logsumexp over tiles of m + log(s). An empty or all -inf tile (s = 0) contributes -inf, so rows
    of only -inf give -inf; a +inf gives +inf and a NaN gives NaN, as torch.logsumexp."""
    return torch.logsumexp(torch.log(partials[..., 1]).add_(partials[..., 0]), 0)


def finish_segments(partials: torch.Tensor, width: int, tile_n: int, N: int) -> torch.Tensor:
    """[tiles * k, M] per-(N-tile, segment-in-tile) sums (row t * k + s) -> [M, N // width]."""
    G, M = partials.shape
    n_seg = N // width
    if width > tile_n:
        per = width // tile_n
        seg = partials[:n_seg * per].reshape(n_seg, per, M).sum(1)
    else:
        seg = partials[:n_seg]
    return seg.t().contiguous()


CACHE_LIMIT = 128      # constant tensors kept (least recently used ones go first)
_CACHED: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_PINNED: set[tuple] = set()


def cached_tensor(key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A small constant tensor made once per key (positions, ones vectors: most keys carry a
    token count), the ``CACHE_LIMIT`` most recently used kept. One made while a CUDA graph is
    being captured is not cached (no graph-pool memory in the cache); one used while capturing is
    never dropped (the graph reads its memory)."""
    t = _CACHED.get(key)
    if t is not None:
        _CACHED.move_to_end(key)
        if t.is_cuda and key not in _PINNED and torch.cuda.is_current_stream_capturing():
            _PINNED.add(key)
        return t
    t = make()
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return t
    _CACHED[key] = t
    if len(_CACHED) > CACHE_LIMIT:
        old = next((k for k in _CACHED if k not in _PINNED), None)
        if old is not None:
            del _CACHED[old]
    return t


def const_vector(n: int, value: float, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A cached constant vector for finishing reductions."""
    return cached_tensor(("full", n, value, device, dtype),
                         lambda: torch.full((n,), value, dtype=dtype, device=device))


def sum_tiles(partials: torch.Tensor) -> torch.Tensor:
    """[tiles, L] fp32 partials -> [L] sums over the tiles, as one cuBLAS matrix-vector product
    with a ones vector: deterministic like torch.sum, and cheaper right after a GEMM on an H200
    (M = 8192, 32 tiles: 6.4 us against 10.7 us for torch.sum over the tile dimension, with a
    4.1 us launch floor; bench/finish_probe.py). The reference interpreter keeps torch.sum over the
    full values; the two agree to fp32 rounding."""
    return torch.mv(partials.t(), const_vector(partials.shape[0], 1.0, partials.device, partials.dtype))
