"""How a value is indexed over the GEMM output tile (M x N); see ``nodes.py``. Its own module so
that the op table and the printer, which ``nodes.py`` uses, need not import the nodes."""

from __future__ import annotations

import enum


class Kind(enum.Enum):
    SCALAR = "scalar"
    ROW = "row"
    COL = "col"
    TILE = "tile"

    def join(self, other: "Kind") -> "Kind":
        """The kind of an elementwise result of two values (broadcasting)."""
        if self == other:
            return self
        if self == Kind.SCALAR:
            return other
        if other == Kind.SCALAR:
            return self
        return Kind.TILE   # ROW x COL, or anything with TILE
