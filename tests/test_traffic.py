"""The epilogue traffic count (coda_cutlass.lower.traffic) on programs whose bytes are known."""

from __future__ import annotations

import torch

from coda_cutlass import epilogues as E
from coda_cutlass.config import KernelConfig
from coda_cutlass.lower.traffic import epilogue_traffic
from coda_cutlass.pipeline import Options, lower_program


def traffic(program, layout="nk", M=1024, N=512, config=None):
    graph = lower_program(program, Options.make(torch.bfloat16, layout)).graph
    return epilogue_traffic(graph, M, N, *(config,) if config else ())


def test_a_plain_gemm_moves_nothing_extra():
    t = traffic(E.identity)
    assert (t.read, t.write, t.bare_write, t.extra) == (0, 1024 * 512 * 2, 1024 * 512 * 2, 0)


def test_norm_backward_reads_two_tiles_and_writes_its_output_and_column_partials():
    M, N = 1024, 512
    cfg = KernelConfig(tile_m=128, tile_n=128)
    t = traffic(E.norm_backward, "kn", M, N, cfg)
    assert t.read == 2 * M * N * 2 + 2 * M * 4 + N * 2          # x, dres; r, c (fp32); g
    assert t.write == M * N * 2 + (M // 128) * N * 4             # dx; dgamma partials per M-tile
    assert t.extra == t.read + t.write - M * N * 2


def test_swiglu_layouts_count_their_real_widths():
    M, N = 256, 1024                 # N: the interleaved gate/up accumulator width
    full = traffic(E.swiglu, M=M, N=N)
    assert full.write == M * N * 2 + M * (N // 2) * 2            # z (M x N) and y (M x N/2)
    only = traffic(E.swiglu_only, M=M, N=N)
    assert only.write == M * (N // 2) * 2 and only.extra < 0    # writes less than the bare GEMM
    back = traffic(E.swiglu_backward_scaled, "kn", M=M, N=N // 2)  # acc = dy (M x F); z, dz packed M x 2F
    assert back.read >= M * N * 2 and back.write >= M * N * 2
