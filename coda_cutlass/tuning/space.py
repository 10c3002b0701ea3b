"""The configuration space the autotuner searches, and its pruning.

Build-time choices: CTA tile, cluster, schedule (cooperative / ping-pong), tile scheduler
(persistent / stream-K). Runtime choices, tried without rebuilding: raster order and swizzle.
Candidates whose shared memory would leave the mainloop fewer than 2 stages (lower/smem.py), or
whose tile width does not fit the program's segment widths, are pruned before compiling.

FP8 GEMMs have their own candidates (``FP8_CANDIDATES``), by mainloop kind: the promoting mainloops
(exact and block scaling) keep two fp32 copies of the accumulators, which caps a consumer warp
group's tile at 64 x 128 (cooperative 128x128, ping-pong 64x128); fast accumulation keeps one, as
16-bit GEMMs do, and gets the larger tiles. K tiles are 128 deep (the same bytes per stage as 64 of
16-bit; the blockwise mainloop needs one scale block per K tile). Fast accumulation itself is not
a tuning choice: it changes the numerics, so it is the caller's option (``fast_accum=True``), and
the tuner searches the tiles of the mainloop it is given.
"""

from __future__ import annotations

from ..config import DEFAULT, KernelConfig
from ..errors import ConfigError
from ..lower.graph import EvtGraph
from ..lower.mainloop import FP8_DEFAULTS, check_fp8_config
from ..lower.plan import default_config, segments_fit
from ..lower.smem import fits

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
    # Not here: 256x192 cooperative, the tile with the least shared-memory traffic per FLOP. With an
    # identity epilogue, run sustained at the power limit, it was the one configuration at or under
    # cuBLAS on Llama-70B shapes (0.98-1.01x, bench/power_probe.py); with the block's epilogues, in
    # the block's sequence, it lost at every site: 5-12% slower than the chosen configuration on
    # gate/up, 1.6-1.9x on the kn-layout dgrad sites, where only 2 mainloop stages fit
    # (docs/results/power_probe/).
)
assert DEFAULT in CANDIDATES

def _fp8(tm: int, tn: int, cm: int, cn: int, schedule: str = "cooperative") -> KernelConfig:
    return KernelConfig(tile_m=tm, tile_n=tn, tile_k=128, cluster_m=cm, cluster_n=cn, schedule=schedule)


_PROMOTING = (
    _fp8(128, 128, 1, 2), _fp8(128, 128, 2, 1),
    _fp8(64, 128, 1, 2, "pingpong"), _fp8(64, 128, 2, 1, "pingpong"),
)
FP8_CANDIDATES: dict[str, tuple[KernelConfig, ...]] = {
    "exact": _PROMOTING,
    "block": _PROMOTING,
    "fast": (
        _fp8(128, 256, 2, 1), _fp8(128, 256, 1, 2), _fp8(256, 128, 1, 2), _fp8(256, 128, 2, 1),
        _fp8(128, 128, 1, 2, "pingpong"), _fp8(128, 128, 2, 1, "pingpong"), _fp8(64, 256, 2, 1, "pingpong"),
        _fp8(128, 128, 1, 2),
        # the fastest form of the down dX epilogue on the H100 (1222 us against the cooperative
        # 128x128's 1311; docs/RESULTS.md, twenty-seventh session): half the values a thread stores
        _fp8(128, 64, 1, 2, "pingpong"),
    ),
}
assert all(FP8_DEFAULTS[mode][0] in cands for mode, cands in FP8_CANDIDATES.items())

RUNTIME_CHOICES: tuple[tuple[str, int], ...] = tuple(
    (r, s) for r in ("m", "n") for s in (1, 2, 4, 8))


def candidate_configs(graph: EvtGraph) -> list[KernelConfig]:
    """The candidates that fit the program (FP8 GEMMs: those of their mainloop); the heuristic
    default when none does."""
    if graph.fp8 is not None:
        out = [c for c in FP8_CANDIDATES[graph.fp8.mode]
               if _fp8_ok(graph, c) and fits(c, graph) and segments_fit(c, graph)]
        return out or [default_config(graph)]
    out = [c for c in CANDIDATES if fits(c, graph) and segments_fit(c, graph)]
    return out or [default_config(graph)]


def _fp8_ok(graph: EvtGraph, c: KernelConfig) -> bool:
    assert graph.fp8 is not None
    try:
        check_fp8_config(graph.fp8, c, graph.program.name)
    except ConfigError:
        return False
    return True
