"""Shared memory: what the epilogue stages tiles in, and the mainloop stages left beside it.

CUTLASS decides the stage counts; these are the formulas of its sm90 epilogue builder, used to
prune configurations and pick defaults before compiling. Each visitor node kind says what it stages
(``NodeKind.smem_bytes``); the collective's C and D buffers are counted here.
"""

from __future__ import annotations

from ..config import KernelConfig, epilogue_tile
from ..errors import ConfigError
from .graph import EvtGraph
from .kinds import Staging
from .mainloop import stage_bytes

SMEM_BYTES = 227 * 1024
MIN_MAINLOOP_STAGES = 2
FEASIBILITY_MARGIN = 4096




def epilogue_smem_bytes(c: KernelConfig, graph: EvtGraph) -> int:
    """Shared memory the epilogue stages tiles in (C/D, Aux loads and stores, row vectors)."""
    em, en = epilogue_tile(c)
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
    staging = Staging(elems, stages_c, stages_d, c.tile_n)
    return smem + sum(v.kind.smem_bytes(v, staging) for v in graph.nodes)


def estimate_stages(c: KernelConfig, graph: EvtGraph, margin: int = 0) -> int:
    """Mainloop stages left after the epilogue's shared memory. ``margin`` covers what the formulas
    leave out (alignment padding, pipeline barriers)."""
    stage = stage_bytes(c, graph)
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
