"""The HBM bytes an epilogue moves beyond what the bare GEMM moves, from the lowered graph: for
reading a fused kernel's time against its cuBLAS GEMM. A bare GEMM writes its M x N output once;
every other tile read or written by the epilogue (C, auxiliary loads and stores, accumulated
outputs, reduction partials) is extra traffic that the mainloop has to hide or the kernel pays for.
Row and column vectors are counted too (small next to tiles)."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ..config import DEFAULT, KernelConfig
from ..ir.nodes import Kind
from .graph import EvtGraph


@dataclass(frozen=True)
class Traffic:
    """Bytes read and written by the epilogue, and what a bare GEMM of the same shape writes."""
    read: int
    write: int
    bare_write: int

    @property
    def extra(self) -> int:
        """Bytes beyond the bare GEMM's output."""
        return self.read + self.write - self.bare_write

    def extra_seconds(self, bandwidth: float) -> float:
        """Time the extra bytes take at ``bandwidth`` bytes/s when nothing hides them."""
        return self.extra / bandwidth


def epilogue_traffic(graph: EvtGraph, M: int, N: int, config: KernelConfig = DEFAULT) -> Traffic:
    """HBM traffic of ``graph``'s epilogue on an M x N accumulator (N: the GEMM's N)."""
    read = write = 0
    for t in graph.tensors:
        elem = t.dtype.bits // 8
        if t.role == "partials" and t.partials is not None:
            write += prod(t.partials.buffer_shape(M, N, (config.tile_m, config.tile_n))) * elem
            continue
        n = M * t.columns(N) if t.kind == Kind.TILE else (M if t.kind == Kind.ROW else N)
        if t.role in ("input", "inout"):
            read += n * elem
        if t.role in ("output", "inout"):
            write += n * elem
    return Traffic(read, write, M * N * graph.dtype.bits // 8)
