"""The configuration space and its pruning.

Build-time choices: CTA tile, cluster, schedule (cooperative / ping-pong), tile scheduler
(persistent / stream-K). Runtime choices, tried without rebuilding: raster order and swizzle.
Candidates whose shared memory would leave the mainloop fewer than 2 stages are pruned before
compiling, using the same stage formulas as CUTLASS's sm90 epilogue builder.
"""

from __future__ import annotations

from math import gcd

from ..config import KernelConfig
from ..errors import ConfigError, EpilogueError
from ..finish import check_segment_tiling
from ..lower.evt import EvtGraph

SMEM_BYTES = 227 * 1024
MIN_MAINLOOP_STAGES = 2
FEASIBILITY_MARGIN = 4096

CANDIDATES: tuple[KernelConfig, ...] = (
    KernelConfig(tile_m=128, tile_n=256, tile_k=64, cluster_m=2, cluster_n=1),
    KernelConfig(tile_m=128, tile_n=256, tile_k=64, cluster_m=1, cluster_n=2),
    KernelConfig(tile_m=256, tile_n=128, tile_k=64, cluster_m=1, cluster_n=2),
    KernelConfig(tile_m=256, tile_n=128, tile_k=64, cluster_m=2, cluster_n=1),
    KernelConfig(tile_m=128, tile_n=128, tile_k=64, cluster_m=2, cluster_n=1, schedule="pingpong"),
    KernelConfig(tile_m=128, tile_n=256, tile_k=64, cluster_m=2, cluster_n=1, scheduler="streamk"),
    # Ping-pong overlaps one warp group's epilogue with the other's mainloop; these two won some
    # norm-statistics workloads in bench/config_sweep.py (docs/results/config_sweep.json).
    KernelConfig(tile_m=64, tile_n=256, tile_k=64, cluster_m=2, cluster_n=1, schedule="pingpong"),
    KernelConfig(tile_m=128, tile_n=128, tile_k=64, cluster_m=1, cluster_n=2, schedule="pingpong"),
)

RUNTIME_CHOICES: tuple[tuple[str, int], ...] = tuple(
    (r, s) for r in ("m", "n") for s in (1, 2, 4, 8))


def _epi_tile(c: KernelConfig) -> tuple[int, int]:
    if c.epilogue_tile is not None:
        return c.epilogue_tile
    if c.schedule == "cooperative":
        return min(128, c.tile_m), gcd(min(32, c.tile_n), c.tile_n)
    return min(64, c.tile_m), gcd(min(32, c.tile_n), c.tile_n)


def epilogue_smem_bytes(c: KernelConfig, graph: EvtGraph) -> int:
    """Shared memory the epilogue stages tiles in (C/D, Aux loads and stores, row vectors)."""
    em, en = _epi_tile(c)
    epi_tiles = (c.tile_m // em) * (c.tile_n // en)
    elems = em * en
    cbits = graph.element_c.bits if graph.element_c else 0
    dbits = graph.element_d.bits if graph.element_d else graph.dtype.bits
    reuse = cbits == dbits and dbits > 8
    stages_d = min(epi_tiles, 2)
    stages_c = max(min(epi_tiles, 4), stages_d + 1) if reuse else min(epi_tiles, 4)
    smem = 0
    if graph.element_c:
        smem += elems * cbits // 8 * stages_c
    if not (reuse and graph.element_c):
        smem += elems * dbits // 8 * stages_d
    for n in graph.nodes:
        bits = n.params["element"].bits if "element" in n.params else 0
        if n.kind == "aux_load":
            smem += elems * bits // 8 * stages_c
        elif n.kind == "aux_store":
            smem += elems * bits // 8 * stages_d
        elif n.kind == "col_vec":
            smem += c.tile_n * bits // 8
    return smem


def estimate_stages(c: KernelConfig, graph: EvtGraph, margin: int = 0) -> int:
    """Mainloop stages left after the epilogue's shared memory (CUTLASS decides; this prunes and
    picks defaults, using the formulas of CUTLASS's sm90 epilogue builder). ``margin`` covers what the
    formulas leave out (alignment padding, pipeline barriers)."""
    stage = (c.tile_m + c.tile_n) * c.tile_k * graph.dtype.bits // 8 + 64
    return (SMEM_BYTES - epilogue_smem_bytes(c, graph) - 1024 - margin) // stage


def fits(c: KernelConfig, graph: EvtGraph) -> bool:
    """Whether CUTLASS will find at least 2 mainloop stages. Measured: the formulas above leave out
    between 2.3 and 2.5 KiB for 7 tile streams (a kernel with 2.3 KiB to spare failed to build, one
    with 2.5 KiB built), so feasibility keeps a 4 KiB margin."""
    return estimate_stages(c, graph, FEASIBILITY_MARGIN) >= MIN_MAINLOOP_STAGES


def check_fits(c: KernelConfig, graph: EvtGraph) -> None:
    """Refuse, before compiling, a configuration CUTLASS would reject for lack of shared memory."""
    if not fits(c, graph):
        kib = epilogue_smem_bytes(c, graph) // 1024
        raise ConfigError(f"epilogue '{graph.program.name}' with config {c.name()}: its tile inputs and outputs "
                          f"need {kib} KiB of shared memory for staging, which leaves the mainloop fewer than "
                          f"{MIN_MAINLOOP_STAGES} pipeline stages; use a smaller tile (e.g. 128x128x32) or fewer / "
                          "16-bit tile operands")


def segments_fit(config: KernelConfig, graph: EvtGraph) -> bool:
    """Segment sums need the tile width and the segment width to divide one another."""
    return all(check_segment_tiling(t.width, config.tile_n) is None for t in graph.tensors if t.width)


def candidate_configs(graph: EvtGraph) -> list[KernelConfig]:
    out = [c for c in CANDIDATES if fits(c, graph) and segments_fit(c, graph)]
    return out or [default_config(graph)]


FALLBACKS: tuple[KernelConfig, ...] = (
    KernelConfig(tile_m=128, tile_n=128, tile_k=64, cluster_m=2, cluster_n=1),
    KernelConfig(tile_m=128, tile_n=128, tile_k=32, cluster_m=2, cluster_n=1),
    KernelConfig(tile_m=128, tile_n=64, tile_k=32, cluster_m=2, cluster_n=1),
)


# The heuristic default: ping-pong 128x128x64, cluster 1x2. In the third session's benchmark runs
# (H200 at its 700 W limit, Llama-3-8B shapes, 47 workloads run 2-4 times) the tuner picked
# ping-pong 128x128 for 110 of 114 tuned kernels (74 with cluster 1x2), while cooperative 128x256
# (the earlier default, best in short runs at full clock) cost 1.02-1.76 x the tuned kernel on the
# pairwise / log-sum-exp workloads (docs/RESULTS.md).
DEFAULT = KernelConfig(tile_m=128, tile_n=128, tile_k=64, cluster_m=1, cluster_n=2, schedule="pingpong")
assert DEFAULT in CANDIDATES


def default_config(graph: EvtGraph | None = None) -> KernelConfig:
    """The heuristic without tuning: DEFAULT while it keeps 3 mainloop stages (and segment widths
    divide its tile); else the first smaller tile that keeps 2."""
    if graph is None or (estimate_stages(DEFAULT, graph) >= 3 and segments_fit(DEFAULT, graph)):
        return DEFAULT
    for c in FALLBACKS:
        if fits(c, graph) and segments_fit(c, graph):
            return c
    kib = epilogue_smem_bytes(FALLBACKS[-1], graph) // 1024
    raise EpilogueError(f"its tile inputs and outputs need {kib} KiB of shared memory for staging even with "
                        "the smallest tile; use fewer or 16-bit tile inputs and outputs", program=graph.program.name)
