"""A map kernel call's checks without those of memory layout: what ``cc.map_reference`` checks
before it runs the interpreter, with the messages of ``CompiledMap`` (``map_kernel.py``).

The same names (a missing operand, an unknown one and what it was probably meant to be), dtypes
(float32 too at ``precision="fp32"``), logical shapes of 2-D / 3-D / 4-D tile arguments, devices
(any one device: the reference runs on the CPU too), ``out=`` and the overlap of what the call
writes with what it reads. Strides, alignment and the kernel's 8-column vectors (N a multiple of 8)
are not checked: the nn modules' reference path runs vocabulary shards of any width.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import CallError
from ..lower.map import MapGraph
from . import checks
from .arguments import CallSpec
from .map_kernel import MAP_CALL_KEYWORDS, check_vector_or_tile, is_x_view, logical_shape, tile_view, transposed_view


class MapReferenceCall:
    """The checks of one lowered map program (built once per program and options)."""

    def __init__(self, graph: MapGraph, keywords: tuple[str, ...] = ()):
        self.graph = graph
        self.name = graph.program.name
        self.spec = CallSpec.of(graph.program, positional=("X",))
        self.keywords = MAP_CALL_KEYWORDS + keywords     # the call's options, for misspelt operands
        self.tile_outputs = tuple(s.name for s in graph.slots if s.role == "output")
        self.slot_of = {s.name: s for s in graph.slots}
        # what a write must not overlap: the tensor operands the program reads
        self.read = tuple(o.name for o in self.spec.operands if o.used and not o.inout and not o.host_scalar)

    def check(self, X: Any, operands: Mapping[str, Any], out: Mapping[str, Any] | None, *, fp32_ok: bool
              ) -> tuple[int, int]:
        """Every check of ``k(X, out=out, **operands)`` but those of strides and alignment; (M, N)."""
        M, N = logical_shape("X", X)     # (N % 8 is the kernel's vector width, a layout rule: not checked)
        self.spec.check_extent(M, N)
        self.spec.check_names(operands, keywords=self.keywords)
        if out is not None and not isinstance(out, Mapping):
            raise CallError(f"out: expected a dict of tile output name -> tensor, got {type(out).__name__}")
        if out:
            checks.check_out_names(self.name, out, self.tile_outputs)
        device = X.device
        tile_view("X", X, M, N, self.graph.dtype.torch, device, layout=False, fp32_ok=fp32_ok)
        for o in self.spec.operands:      # every operand, read or not (as the kernel)
            if o.host_scalar:
                checks.check_scalar(o.name, operands[o.name])
                continue
            slot = self.slot_of.get(o.name)
            dtype = slot.dtype if slot is not None else (o.dtype or self.graph.dtype)
            check_vector_or_tile(o.name, o.kind, operands[o.name], dtype, M, N, device, layout=False,
                                 fp32_ok=fp32_ok)
        written = {o.name: operands[o.name] for o in self.spec.operands if o.inout}
        for name, t in (out or {}).items():
            s = self.slot_of[name]
            where = f"out['{name}']"
            if s.layout == "scale":
                raise CallError(f"{self.name}: {where}: block scales are allocated by the kernel call")
            if s.layout == "t":
                transposed_view(where, t, M, N, s.dtype.torch, device, layout=False, fp32_ok=fp32_ok)
            else:
                tile_view(where, t, M, N // 2 if s.layout == "half" else N, s.dtype.torch, device,
                          layout=False, fp32_ok=fp32_ok)
            written[name] = t
        if written:
            over_x = [n for n, t in written.items() if is_x_view(self.graph, n, t, X)]
            read = {over_x[0] if over_x else "X": X}
            read.update((n, operands[n]) for n in self.read)
            checks.check_no_overlap(written, read)
        return M, N


__all__ = ["MapReferenceCall"]
