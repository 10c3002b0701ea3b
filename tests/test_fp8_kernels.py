"""The FP8 block's kernel lists (nn/fp8/kernels.py, one per recipe scaling) against what the block and
model launch: every
GEMM and map kernel of a training step is listed under its site with the same program, operand
formats, scaling and partial reductions, and every listed kernel has a configuration (so a
prebuild or a first GPU step cannot stop at a program no default tile fits)."""

from __future__ import annotations

import pytest
import torch

from coda_cutlass.lower.plan import default_config, plan
from coda_cutlass.nn import LlamaModel
from coda_cutlass.nn.fp8 import RECIPES
from coda_cutlass.nn.fp8.kernels import gemm_sites, map_items, map_sites, prebuild_items
from coda_cutlass.nn.runner import gemm_options
from fp8_helpers import RecordingRunner, blocks_step
from coda_cutlass.pipeline import lower_program

BF16 = torch.bfloat16
NAMES = ("blockwise", "tensorwise")


@pytest.mark.parametrize("name", NAMES)
def test_every_launch_of_an_fp8_step_is_listed_with_its_program_and_formats(name):
    recipe = RECIPES[name]
    sites, maps = gemm_sites(recipe), map_sites(recipe)
    run = blocks_step(fp8=name)
    fp8_gemms = [g[:5] for g in run.gemms if g[4] is not None]
    # the model's last block hands a bf16 h to the LM head; a block called alone ends with down.last
    assert {g[0] for g in fp8_gemms} == set(sites) - {"down.last"}
    for site, program, layout, partial, fp8 in fp8_gemms:
        assert site in sites, f"{site} is launched but not listed"
        prog, kinds, scaling, part = sites[site]
        assert (program, layout, partial, fp8) == (prog, "nk", part, recipe.gemm(kinds, scaling)), site
    for site, program, partial in run.maps:
        if site.endswith(".quant") and site != "y.quant":
            site = "o.quant"                  # every other quantisation map kernel is the same program
        assert maps.get(site) == (program, partial), site


@pytest.mark.parametrize("name", NAMES)
def test_a_block_called_alone_ends_with_the_listed_residual_add(name):
    torch.manual_seed(0)
    m = LlamaModel(512, 256, 1, 2, 1, 512, head_dim=128, fp8=name, dtype=BF16)
    run = RecordingRunner()
    m.blocks[0].runner = run
    m.blocks[0](torch.randn(1, 128, 256).to(BF16))
    last = [g for g in run.gemms if g[0] == "down.last"]
    assert len(last) == 1 and last[0][1] is gemm_sites(RECIPES[name])["down.last"][0]


@pytest.mark.parametrize("name", NAMES)
def test_every_listed_fp8_kernel_has_a_configuration_that_plans(name):
    recipe = RECIPES[name]
    for program, opts in prebuild_items(recipe):
        o = gemm_options(BF16, "nk", (opts["dtype"], opts["scaling"], opts["fast_accum"]))
        graph = lower_program(program, o).graph
        plan(graph, default_config(graph), "nk")          # raises if nothing fits
    assert len(map_items(recipe)) == len(map_sites(recipe))


def test_the_weight_copies_are_bit_for_bit_the_tile_quantisation():
    from coda_cutlass.nn.fp8.copies import weight_tiles
    from coda_cutlass.quantization import quantize_tiles
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(384, 256, generator=g) * torch.logspace(-8, 8, 256)).to(BF16)
    w[:128, :128] = 0.0
    w[200, 130] = 448.0 * 2.0 ** 5
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q, s, qt, st = weight_tiles(w, dtype)
        q_ref, s_ref = quantize_tiles(w, dtype, 128, True)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref), dtype
        assert torch.equal(qt.view(torch.uint8), q_ref.t().contiguous().view(torch.uint8)) and torch.equal(st, s_ref.t())
