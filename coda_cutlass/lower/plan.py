"""Planning: a lowered graph plus a kernel configuration (and the GEMM's weight layout) -> the kernel
to render. ``plan`` checks the configuration against the graph before anything compiles (segment
widths against the CTA tile, shared memory) and, without one, picks the heuristic default.

Lowering does not depend on the configuration; everything that does is answered here or by the
node kinds given the plan (a segment sum's node type, the coda headers, the ABI description).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..config import DEFAULT, WEIGHT_LAYOUTS, KernelConfig
from ..dtypes import DType
from ..errors import ConfigError, EpilogueError
from ..ir.nodes import Program
from .graph import ABI_VERSION, EvtGraph, TensorSlot
from .mainloop import FP8_DEFAULTS, FP8_HEADER, GROUPED_LOAD_HEADER, OVERLAP_HEADER, Mainloop, mainloop_of
from .smem import check_fits, epilogue_smem_bytes, estimate_stages, fits

# Smaller tiles for programs that do not fit DEFAULT (shared memory, segment widths), in order.
FALLBACKS: tuple[KernelConfig, ...] = (
    KernelConfig(tile_m=128, tile_n=128, tile_k=64, cluster_m=2, cluster_n=1),
    KernelConfig(tile_m=128, tile_n=128, tile_k=32, cluster_m=2, cluster_n=1),
    KernelConfig(tile_m=128, tile_n=64, tile_k=32, cluster_m=2, cluster_n=1),
    # for outputs quantised per 128 half-width columns (256 tile columns)
    KernelConfig(tile_m=128, tile_n=256, tile_k=64, cluster_m=2, cluster_n=1),
)


@dataclass(frozen=True)
class KernelPlan:
    graph: EvtGraph
    config: KernelConfig
    weight_layout: str             # "nk" (W is [N, K], nn.Linear) or "kn"

    @property
    def program(self) -> Program:
        return self.graph.program

    @property
    def dtype(self) -> DType:
        return self.graph.dtype

    @property
    def mainloop(self) -> Mainloop | None:
        """The FP8 mainloop (schedule, element types, scale layouts); None for 16-bit GEMMs."""
        return mainloop_of(self.graph, self.config)

    def segments(self, slot: int) -> int:
        """Rows of partials per N-tile of a slot (segments per tile for segment sums, else 1)."""
        partials = self.graph.tensors[slot].partials
        return partials.segments(self.config.tile_n) if partials else 1

    def headers(self) -> tuple[str, ...]:
        """The coda headers beyond the base set that the nodes need (kernels that use none of them
        include exactly the base headers, so their content keys do not change). FP8 kernels add
        coda/fp8.hpp (their host checks and block-scale layouts), cooperative blockwise ones also
        coda/block_scaled_mma.hpp (their consumer loop), with grouped W scales coda/grouped_scale_load.hpp."""
        headers = {h for v in self.graph.nodes for h in v.kind.headers(v, self)}
        if self.graph.fp8 is not None:
            headers.add(FP8_HEADER)
            mainloop = self.mainloop
            if mainloop is not None and mainloop.overlapped:
                headers.add(OVERLAP_HEADER)
            if mainloop is not None and mainloop.grouped_sfb_load:
                headers.add(GROUPED_LOAD_HEADER)
        return tuple(sorted(headers))

    def describe(self) -> dict[str, Any]:
        """What the kernel's coda_describe() returns (JSON types: the comparison after loading a
        library is with this, so tuples such as an epilogue tile appear as lists)."""
        g = self.graph
        d = {
            "abi": ABI_VERSION,
            "program": g.program.name,
            "dtype": g.dtype.name,
            "weight_layout": self.weight_layout,
            "config": self.config.build_key,
            "tensors": [t.describe(self.config.tile_n) for t in g.tensors],
            "scalars": list(g.scalars),
            "outputs": list(g.program.outputs),
            "c_slot": g.c_slot,
            "d_slot": g.d_slot,
        }
        if g.fp8 is not None:
            d["fp8"] = g.fp8.to_meta()
        return json.loads(json.dumps(d))


def plan(graph: EvtGraph, config: KernelConfig | None = None, weight_layout: str = "nk") -> KernelPlan:
    """The kernel of ``graph`` with ``config`` (None: the heuristic default), or a clear error."""
    if weight_layout not in WEIGHT_LAYOUTS:
        raise EpilogueError(f"weight_layout must be 'nk' (W is [N, K], as nn.Linear) or 'kn', got "
                            f"{weight_layout!r}", program=graph.program.name)
    if config is None:
        config = default_config(graph)
    mainloop_of(graph, config)        # an FP8 mainloop checks the configuration
    if graph.fp8 is not None and weight_layout != "nk":
        raise ConfigError(f"{graph.program.name}: W: FP8 operands must be K-major (weight_layout='nk', W as (N, K))")
    for t in graph.tensors:
        why = t.partials.check(config.tile_n) if t.partials else None
        if why:
            raise ConfigError(f"{graph.program.name}: output '{t.name}': {why}; pick a config whose tile "
                              "width fits the segment width")
    for v in graph.nodes:
        why = v.kind.config_problem(v, config)
        if why:
            raise ConfigError(f"{graph.program.name}: {v.comment}: {why}; pick another config")
    check_fits(config, graph)
    return KernelPlan(graph, config, weight_layout)


def segments_fit(config: KernelConfig, graph: EvtGraph) -> bool:
    """Segment sums need the tile width and the segment width to divide one another, and every node
    its own constraints on the tile (quantisation runs inside the tile)."""
    return all(t.partials.check(config.tile_n) is None for t in graph.tensors if t.partials) and \
        all(v.kind.config_problem(v, config) is None for v in graph.nodes)


def default_config(graph: EvtGraph) -> KernelConfig:
    """The heuristic without tuning: DEFAULT while it keeps 3 mainloop stages (and segment widths
    and its tile width divide one another); else the first fallback that keeps 2. FP8 GEMMs start
    from their own defaults (``mainloop.FP8_DEFAULTS``)."""
    if graph.fp8 is not None:
        return _fp8_default(graph)
    if estimate_stages(DEFAULT, graph) >= 3 and segments_fit(DEFAULT, graph):
        return DEFAULT
    for c in FALLBACKS:
        if fits(c, graph) and segments_fit(c, graph):
            return c
    if any(fits(c, graph) for c in FALLBACKS):
        node_problem = next(((v, v.kind.config_problem(v, c)) for c in (DEFAULT, *FALLBACKS) for v in graph.nodes
                             if fits(c, graph) and v.kind.config_problem(v, c)), None)
        if node_problem and not any(t.partials and t.partials.width for t in graph.tensors):
            v, why = node_problem
            raise ConfigError(f"{graph.program.name}: {v.comment}: no default configuration fits: {why}; pass a "
                              "config that does")
        slot = _misfit_segments(graph)
        widths = sorted({c.tile_n for c in (DEFAULT, *FALLBACKS)})
        raise ConfigError(f"{graph.program.name}: output '{slot.name}': segment width {slot.partials.width} "
                          f"and none of the default tile widths {widths} divide one another; pass a config "
                          "whose tile_n and the segment width divide one another")
    kib = min(epilogue_smem_bytes(c, graph) for c in FALLBACKS) // 1024
    raise EpilogueError(f"its tile inputs and outputs need {kib} KiB of shared memory for staging even with "
                        "the smallest tile; use fewer or 16-bit tile inputs and outputs", program=graph.program.name)


def _fp8_default(graph: EvtGraph) -> KernelConfig:
    assert graph.fp8 is not None
    first, *rest = FP8_DEFAULTS[graph.fp8.mode]
    if estimate_stages(first, graph) >= 3 and segments_fit(first, graph):
        return first
    for c in (first, *rest):
        if fits(c, graph) and segments_fit(c, graph):
            return c
    for c in (first, *rest):
        why = next((f"{v.comment}: {p}" for v in graph.nodes if (p := v.kind.config_problem(v, c))), None)
        if why and fits(c, graph):
            raise ConfigError(f"{graph.program.name}: no default FP8 configuration fits ({c.name()}: {why}); "
                              "pass a config that does, where the FP8 mainloop allows one")
    kib = epilogue_smem_bytes(rest[-1], graph) // 1024
    raise EpilogueError(f"its tile inputs and outputs need {kib} KiB of shared memory for staging (or segment "
                        "widths that no default FP8 tile width divides); pass a config", program=graph.program.name)


def _misfit_segments(graph: EvtGraph) -> TensorSlot:
    return next(t for t in graph.tensors if t.partials and any(t.partials.check(c.tile_n)
                                                               for c in (DEFAULT, *FALLBACKS)))
