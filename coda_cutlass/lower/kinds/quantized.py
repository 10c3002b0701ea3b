"""FP8 outputs that quantise themselves (``cc.quantize``) and transposed outputs: stored from
registers by ``templates/coda/quant_store.hpp``. Per-tensor quantisation to a row-major output is
an ordinary store (the multiply by 1 / scale is in the program; every FP8 store saturates)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...config import KernelConfig, epilogue_tile
from ...ir.nodes import HALF_LAYOUTS, TRANSPOSED_LAYOUTS, Node
from ..graph import VisitorNode
from .base import LowerContext, NodeKind, Staging, element

if TYPE_CHECKING:
    from ..plan import KernelPlan

# Consumer threads that run the epilogue of one CTA tile, by schedule (2 or 1 warp groups).
EPILOGUE_THREADS = {"cooperative": 256, "pingpong": 128}


def _bool(b: bool) -> str:
    return "true" if b else "false"


def _store_arguments(p: dict[str, Any]) -> str:
    """QuantStoreArguments of a quantised store: the codes' pointer and row stride, and the scales'
    (nullptr for a store without block scales)."""
    scale = "nullptr, 0" if p["scale"] is None else f"static_cast<float*>(p.tensors[{p['scale']}]), p.ld[{p['scale']}]"
    return f"{{static_cast<{p['element'].cpp}*>(p.tensors[{p['slot']}]), p.ld[{p['slot']}], {scale}}}"


class QuantRowStore(NodeKind):
    """Row-major FP8 codes with 1 x block scales computed in the tile."""
    name, header = "quant_row_store", "coda/quant_store.hpp"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "store" and n.attr("quant") == "block" and n.attr("layout") not in TRANSPOSED_LAYOUTS

    def params(self, n: Node, ctx: LowerContext) -> dict[str, Any]:
        slot = ctx.slot(n.attr("name"))
        return {"slot": slot.index, "element": element(slot), "scale": ctx.slot(f"{n.attr('name')}_scale").index,
                "block": n.attr("block"), "half": n.attr("layout") in HALF_LAYOUTS, "pow2": bool(n.attr("pow2"))}

    def span(self, v: VisitorNode) -> int:
        """Tile columns one run covers."""
        return v.params["block"] * (2 if v.params["half"] else 1)

    def config_problem(self, v: VisitorNode, config: KernelConfig) -> str | None:
        if config.tile_n % self.span(v):
            what = " (half width: 128 output columns are 256 tile columns)" if v.params["half"] else ""
            return (f"its 1 x {v.params['block']} scale runs must lie inside one tile: tile_n must be a multiple "
                    f"of {self.span(v)}{what}, got {config.tile_n}")
        return None

    def comment(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"{v.comment}: FP8 codes + 1x{v.params['block']} scales, staged in shared memory"

    def smem_bytes(self, v: VisitorNode, staging: Staging) -> int:
        # one subtile's codes (at most 128 rows), rows padded by 16 bytes
        return staging.elems + 128 * 16

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        p = v.params
        threads = EPILOGUE_THREADS[plan.config.schedule]
        return (f"coda::QuantRowStore<{p['element'].cpp}, TileShape, typename EpilogueDescriptor::EpilogueTile, "
                f"{threads}, {p['block']}, /*Half=*/{_bool(p['half'])}, /*Pow2=*/{_bool(p['pow2'])}>")

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return _store_arguments(v.params)


class TransposedStore(NodeKind):
    """The transpose of a tile output (N x M), as it comes or quantised per 128 x 1 run."""
    name, header = "transposed_store", "coda/quant_store.hpp"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "store" and n.attr("layout") in TRANSPOSED_LAYOUTS

    def params(self, n: Node, ctx: LowerContext) -> dict[str, Any]:
        slot = ctx.slot(n.attr("name"))
        block = n.attr("block", 0) if n.attr("quant") == "block" else 0
        scale = ctx.slot(f"{n.attr('name')}_scale").index if block else None
        return {"slot": slot.index, "element": element(slot), "scale": scale, "block": block,
                "half": n.attr("layout") in HALF_LAYOUTS, "pow2": bool(n.attr("pow2")),
                "group": n.attr("group", 1) if block else 1}

    def config_problem(self, v: VisitorNode, config: KernelConfig) -> str | None:
        b, g = v.params["block"], v.params["group"]
        if b and config.tile_m != b:
            return f"its {b} x 1 scale runs are the tile's rows: tile_m must be {b}, got {config.tile_m}"
        if g != 1:
            cols = g * (2 if v.params["half"] else 1)
            epi_n = epilogue_tile(config)[1]
            if epi_n % cols or cols > 32:
                what = f" ({g} half-width output columns are {cols} tile columns)" if v.params["half"] else ""
                return (f"its groups of {g} columns sharing a scale must lie inside one epilogue subtile{what}: the "
                        f"epilogue tile's N must be a multiple of {cols} (and {cols} <= 32), got {epi_n}")
        return None

    def comment(self, v: VisitorNode, plan: "KernelPlan") -> str:
        b, g = v.params["block"], v.params["group"]
        if b and g != 1:
            return f"{v.comment}: transposed, {g}x{b} block scales (groups of {g} columns), staged in shared memory"
        if b:
            return f"{v.comment}: transposed, {b}x1 scales, staged in shared memory"
        return f"{v.comment}: transposed" + (", staged in shared memory" if self._staged(v) else " from registers")

    @staticmethod
    def _staged(v: VisitorNode) -> bool:
        """One-byte codes leave through shared memory (quant_store.hpp: TransposedStore::Staged)."""
        return bool(v.params["block"]) or v.params["element"].bits == 8

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        p = v.params
        threads = EPILOGUE_THREADS[plan.config.schedule]
        return (f"coda::TransposedStore<{p['element'].cpp}, TileShape, typename EpilogueDescriptor::EpilogueTile, "
                f"{threads}, /*Block=*/{p['block']}, /*Half=*/{_bool(p['half'])}, /*Pow2=*/{_bool(p['pow2'])}"
                + (f", /*Group=*/{p['group']}>" if p["group"] != 1 else ">"))

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return _store_arguments(v.params)

    def smem_bytes(self, v: VisitorNode, staging: Staging) -> int:
        # per-warp column maxima of one subtile (at most), and its codes transposed (rows padded by 16)
        if v.params["block"]:
            return 8 * 64 * 4 + 64 * 4 + staging.elems + 64 * 16
        return staging.elems + 64 * 16 if self._staged(v) else 0


class BlockScales(NodeKind):
    """The scales of a quantised output: written by its store node; an identity here (unused)."""
    name = "block_scales"
    ops = frozenset({"block_scale"})

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return "fusion::Sm90Compute<coda::identity, ElementCompute, ElementCompute, RoundStyle>"

    def comment(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"{v.comment}: written by the quantised store (this node computes nothing)"


QUANTIZED: tuple[NodeKind, ...] = (QuantRowStore(), TransposedStore(), BlockScales())
