"""The configuration space the autotuner searches, and its pruning.

Build-time choices: CTA tile, cluster, schedule (cooperative / ping-pong), tile scheduler
(persistent / stream-K). Runtime choices, tried without rebuilding: raster order and swizzle.
Candidates whose shared memory would leave the mainloop fewer than 2 stages (lower/smem.py), or
whose tile width does not fit the program's segment widths, are pruned before compiling.
"""

from __future__ import annotations

from ..config import DEFAULT, KernelConfig
from ..lower.graph import EvtGraph
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

RUNTIME_CHOICES: tuple[tuple[str, int], ...] = tuple(
    (r, s) for r in ("m", "n") for s in (1, 2, 4, 8))


def candidate_configs(graph: EvtGraph) -> list[KernelConfig]:
    """The candidates that fit the program; the heuristic default when none does."""
    out = [c for c in CANDIDATES if fits(c, graph) and segments_fit(c, graph)]
    return out or [default_config(graph)]
