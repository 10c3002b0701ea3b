"""Finishing per-tile partial sums (the runtime's step after the kernel; CPU here, the same call runs
on the GPU in tests/gpu)."""

import math

import torch

from coda_cutlass.partials import sum_tiles


def test_sum_tiles_matches_a_float64_sum_to_fp32_rounding():
    g = torch.Generator().manual_seed(0)
    for tiles, length in ((1, 7), (32, 8192), (33, 130)):
        p = torch.randn(tiles, length, generator=g) * 100
        exact = p.double().sum(0)
        got = sum_tiles(p)
        assert got.shape == (length,) and got.dtype == torch.float32
        # a fp32 sum of `tiles` terms: error within tiles ulps of the magnitudes summed
        bound = tiles * 2.0 ** -23 * p.double().abs().sum(0)
        assert torch.all((got.double() - exact).abs() <= bound)


def test_sum_tiles_keeps_inf_and_nan_semantics_of_a_sum():
    p = torch.zeros(4, 4)
    p[1, 0] = math.nan
    p[2, 1] = math.inf
    p[0, 2], p[3, 2] = math.inf, -math.inf
    p[0, 3] = -math.inf
    got = sum_tiles(p)
    assert math.isnan(got[0]) and got[1] == math.inf and math.isnan(got[2]) and got[3] == -math.inf


def test_sum_tiles_is_bitwise_repeatable():
    p = torch.randn(32, 1000)
    assert torch.equal(sum_tiles(p), sum_tiles(p))
