"""The GEMM mainloop of a kernel plan: which CUTLASS sm90 mainloop (kernel schedule) runs, its
element types, its scale layouts, and what its shared memory stages hold.

16-bit GEMMs use the schedule of the configuration (``config.KERNEL_SCHEDULE``) and the template's
own text. FP8 GEMMs (``fp8/gemm.py``):

| scaling | mainloop (kernel schedule) | scales |
|---|---|---|
| tensor, row | ``KernelTmaWarpSpecialized{Cooperative,Pingpong}``: CUTLASS's FP8 mainloop, which adds the wgmma accumulators into a separate fp32 sum every 4 k-steps (128 of K) | in the epilogue (``kinds/fp8.py``) |
| tensor, row, fast_accum | ``...FP8FastAccum``: no promotion, one accumulator | in the epilogue |
| block, block_1x128 | ``...FP8BlockScaledAccum``: each 128-deep K block's partial product is multiplied by its A and W scales and added in fp32 | TMA / cp.async from the scale tensors (``fp8/scales.py``) |

Cooperative blockwise kernels replace that mainloop's consumer loop with
``coda::fp8::OverlappedBlockScaledMma`` (``coda/block_scaled_mma.hpp``): the same arithmetic in the
same order (bit for bit CUTLASS's results, tests/gpu/test_fp8_gpu.py), with each K block's
scale-and-add running while the next K block's wgmma does: 9-12% faster weight-gradient GEMMs
(1 x 128 scales on both operands) at Llama-3 8B / 70B shapes on the H200, level (0.99-1.02x) on the
forward ones (bench/probes/blockwise_loop.py, docs/RESULTS.md). ``CODA_CUTLASS_BLOCKWISE_LOOP=cutlass``
builds CUTLASS's own loop instead (for comparison, or should a CUTLASS update break coda's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..config import KERNEL_SCHEDULE, KernelConfig
from ..errors import ConfigError
from ..fp8.gemm import BLOCK_K, Fp8Gemm
from .graph import EvtGraph

FP8_HEADER = "coda/fp8.hpp"
OVERLAP_HEADER = "coda/block_scaled_mma.hpp"
GROUPED_LOAD_HEADER = "coda/grouped_scale_load.hpp"   # W scales in 2..16-row blocks (block_16x128)
_FP8_SCHEDULE = {
    ("cooperative", "exact"): "cutlass::gemm::KernelTmaWarpSpecializedCooperative",
    ("pingpong", "exact"): "cutlass::gemm::KernelTmaWarpSpecializedPingpong",
    ("cooperative", "fast"): "cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum",
    ("pingpong", "fast"): "cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum",
    ("cooperative", "block"): "cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8BlockScaledAccum",
    ("pingpong", "block"): "cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8BlockScaledAccum",
}


def _fp8(tm: int, tn: int, cm: int, cn: int, schedule: str) -> KernelConfig:
    return KernelConfig(tile_m=tm, tile_n=tn, tile_k=128, cluster_m=cm, cluster_n=cn, schedule=schedule)


# The FP8 heuristic defaults, first choice first (then fallbacks with less shared memory). The
# promoting mainloops (exact and block) keep a second fp32 copy of the accumulators, so a consumer
# warp group's tile stays at 64 x 128 (64 + 64 registers per thread): cooperative 128x128x128. With
# fast accumulation there is one copy, and ping-pong 128x128x128 (the 16-bit default's tile with
# the same bytes per stage: K doubles as the element halves) keeps 128 accumulator registers.
# Chosen from the register budget, not measured: bench/fp8_gemm.py and the tuner measure.
FP8_DEFAULTS: dict[str, tuple[KernelConfig, ...]] = {
    "exact": (_fp8(128, 128, 1, 2, "cooperative"), _fp8(128, 128, 2, 1, "cooperative"),
              _fp8(64, 128, 2, 1, "pingpong")),
    "block": (_fp8(128, 128, 1, 2, "cooperative"), _fp8(128, 128, 2, 1, "cooperative"),
              _fp8(64, 128, 2, 1, "pingpong")),
    "fast": (_fp8(128, 128, 1, 2, "pingpong"), _fp8(128, 128, 2, 1, "cooperative"),
             _fp8(64, 128, 2, 1, "pingpong")),
}


@dataclass(frozen=True)
class Mainloop:
    """What the template writes for an FP8 mainloop (16-bit kernels have none: ``mainloop_of``)."""
    fp8: Fp8Gemm
    kernel_schedule: str
    element_a: str
    element_b: str
    scale_granularity: tuple[int, int, int] | None     # (M, N, K) of one block scale; None: epilogue scales
    sfb_k_major: bool = False                          # W's block scales: K blocks contiguous (128 x 128)
    # The consumer loop is coda's (coda/block_scaled_mma.hpp): blockwise, cooperative, unless
    # CODA_CUTLASS_BLOCKWISE_LOOP=cutlass. Its two partial accumulators fit a consumer's registers
    # only at 64 x N warp-group tiles, which cooperative 128-row tiles give; ping-pong gives each
    # warp group a whole tile.
    overlapped: bool = False

    @property
    def blockwise(self) -> bool:
        return self.scale_granularity is not None

    @property
    def grouped_sfb_load(self) -> bool:
        """W scales in 2..16-row blocks: CUTLASS 4.2's cp.async scale loader skips every other block
        of those; coda/grouped_scale_load.hpp loads them (only with the overlapped loop)."""
        return self.overlapped and self.blockwise and 1 < self.scale_granularity[1] < 32  # type: ignore[index]

    def doc(self) -> list[str]:
        """The .cu header's lines on the mainloop and the scales it reads."""
        f = self.fp8
        if self.blockwise:
            gm, gn, gk = self.scale_granularity  # type: ignore[misc]
            how = f"A {gm}x{gk}, W {gn}x{gk} blocks; fp32 accumulation of each scaled {gk}-deep K block"
        elif f.fast_accum:
            how = "fast accumulation (in the wgmma accumulators, no fp32 promotion)"
        else:
            how = "fp32 accumulation (wgmma partial sums promoted every 128 of K)"
        lines = [f"FP8 A {f.a.name} x W {f.w.name}, {f.scaling} scaling, {how}",
                 f"           {self.kernel_schedule.rsplit('::', 1)[-1]} (CUTLASS sm90 FP8 mainloop)"]
        if self.overlapped:
            lines.append("           consumer loop coda::fp8::OverlappedBlockScaledMma: each K block's scale-and-add "
                         "runs behind the next K block's wgmma")
        if self.grouped_sfb_load:
            lines.append("           W scale loads coda::fp8::GroupedScaleLoad (one lane per W row block and K block)")
        if f.scaling == "tensor":
            lines.append("Scales     scale_a, scale_b: one fp32 each, read on the device; acc = (A @ W^T) * sa * sb")
        elif f.scaling == "row":
            lines.append("Scales     scale_a [M] and scale_b [N] fp32; acc[m, n] = (A @ W^T)[m, n] * sa[m] * sb[n]")
        else:
            gm, gn, gk = self.scale_granularity  # type: ignore[misc]
            lines.append(f"Scales     scale_a [M, K/{gk}] fp32, 1x{gk} blocks, M-major: element (m, j) at m + j * ld_a")
            if self.sfb_k_major:
                lines.append(f"           scale_b [N/{gn}, K/{gk}] fp32, {gn}x{gk} blocks, K-major: element (i, j) at "
                             "i * ld_b + j")
            elif gn > 1:
                lines.append(f"           scale_b [N/{gn}, K/{gk}] fp32, {gn}x{gk} blocks, N-major: element (i, j) at "
                             "i + j * ld_b")
            else:
                lines.append(f"           scale_b [N, K/{gk}] fp32, 1x{gk} blocks, N-major: element (n, j) at n + j * ld_b")
        return lines


def mainloop_of(graph: EvtGraph, config: KernelConfig) -> Mainloop | None:
    """The FP8 mainloop of a graph with a configuration (checked), or None for a 16-bit GEMM."""
    f = graph.fp8
    if f is None:
        return None
    check_fp8_config(f, config, graph.program.name)
    mode = f.mode
    granularity = None
    if f.blockwise:
        gn = f.w_block[0]  # type: ignore[index]
        granularity = (1, gn, BLOCK_K)
    overlapped = overlapped_loop_chosen() and f.blockwise and config.schedule == "cooperative"
    return Mainloop(f, _FP8_SCHEDULE[(config.schedule, mode)], f.a.cpp, f.w.cpp, granularity,
                    sfb_k_major=f.scaling == "block", overlapped=overlapped)


def overlapped_loop_chosen() -> bool:
    """Whether blockwise kernels get coda's overlapped consumer loop: yes unless
    $CODA_CUTLASS_BLOCKWISE_LOOP is "cutlass" (the generated source, hence the cache key, says which)."""
    v = os.environ.get("CODA_CUTLASS_BLOCKWISE_LOOP", "overlapped")
    if v not in ("cutlass", "overlapped"):
        raise ConfigError(f"CODA_CUTLASS_BLOCKWISE_LOOP must be 'overlapped' (the default) or 'cutlass', got {v!r}")
    return v == "overlapped"


def check_fp8_config(f: Fp8Gemm, c: KernelConfig, program: str) -> None:
    """What CUTLASS's FP8 mainloops need of the configuration, before anything compiles."""
    def bad(msg: str) -> ConfigError:
        return ConfigError(f"{program}: config {c.name()} with FP8 operands ({f.describe()}): {msg}")
    if c.scheduler != "persistent":
        raise bad("FP8 kernels use the persistent tile scheduler (stream-K is not built for them)")
    if f.blockwise:
        if c.tile_k != BLOCK_K:
            raise bad(f"the blockwise-scaled mainloop needs tile_k = {BLOCK_K} (one scale block per K tile)")
        gn = f.w_block[0]  # type: ignore[index]
        if c.tile_n % gn:
            raise bad(f"tile_n must be a multiple of the W scale block's {gn} rows")
        # several W scale blocks per tile fail CUTLASS 4.2's static assertion "Accumulator and scaleB
        # must have same shape" (fp8_accumulation.hpp): a 256-wide tile over 128-row blocks never
        # builds; 16-row blocks only with coda's consumer loop, which reads them per thread
        if gn == 128 and c.tile_n != gn:
            raise bad(f"tile_n must be the W scale block's {gn} rows (CUTLASS 4.2's blockwise mainloop "
                      "builds with one W scale block per tile)")
        if 1 < gn < c.tile_n and not (c.schedule == "cooperative" and overlapped_loop_chosen()):
            raise bad(f"{gn}-row W scale blocks, several per tile, need coda's overlapped consumer loop: a "
                      "cooperative schedule and CODA_CUTLASS_BLOCKWISE_LOOP unset or 'overlapped'")
    elif c.tile_k not in (64, 128):
        raise bad("tile_k must be 64 or 128 (FP8 wgmma reads K in steps of 32; 128 is the usual choice)")


def stage_bytes(c: KernelConfig, graph: EvtGraph) -> int:
    """Shared memory of one mainloop stage (A and W tiles, block scales), as CUTLASS's builder counts
    it, plus the stage's pipeline barrier."""
    f = graph.fp8
    if f is None:
        return (c.tile_m + c.tile_n) * c.tile_k * graph.dtype.bits // 8 + 64
    tiles = (c.tile_m * f.a.bits + c.tile_n * f.w.bits) * c.tile_k // 8
    if f.blockwise:
        gn = f.w_block[0]  # type: ignore[index]
        tiles += 4 * (c.tile_m + -(-c.tile_n // gn))
    return -(-tiles // 128) * 128 + 64


def kernel_schedule(c: KernelConfig, mainloop: Mainloop | None) -> str:
    return mainloop.kernel_schedule if mainloop is not None else KERNEL_SCHEDULE[c.schedule]
