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
from coda_cutlass.nn.fp8 import RECIPES, Fp8Recipe
from coda_cutlass.nn.fp8.kernels import gemm_sites, map_items, map_sites, prebuild_items
from coda_cutlass.nn.runner import gemm_options
from fp8_helpers import RecordingRunner, blocks_step
from coda_cutlass.pipeline import lower_program

BF16, E4M3, E5M2 = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2
NAMES = ("blockwise", "blockwise_g16", "tensorwise")


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
        if site not in maps and site.endswith(".quant"):
            site = "o.quant"                  # tensorwise lists one program for its quantisation map kernels
        assert maps.get(site) == (program, partial), site


@pytest.mark.parametrize("formats", [(E4M3, E5M2, E4M3), (E5M2, E5M2, E5M2), (E4M3, E4M3, E5M2)])
def test_a_tensorwise_recipes_formats_reach_every_gemm_operand(formats):
    """Every FP8 GEMM of a per-tensor step reads its activation, gradient and weight operands in the
    recipe's formats (e5m2 gradients, Transformer Engine's "hybrid", included): each operand stored
    by its producer's program in that format, the programs and the weight copies listed under the
    recipe's sites. (Every quantising program once stored e4m3 whatever the recipe said.)"""
    act, grad, weight = formats
    recipe = Fp8Recipe("formats", scaling="tensor", activation=act, gradient=grad, weight=weight, fast_accum=True)
    fmt = {"activation": act, "gradient": grad, "weight": weight}
    sites, maps = gemm_sites(recipe), map_sites(recipe)
    run = blocks_step(fp8=recipe)
    fp8_gemms = [g for g in run.gemms if g[4] is not None]
    assert {g[0] for g in fp8_gemms} == set(sites) - {"down.last"}
    for site, program, layout, partial, fp8, a_dtype, w_dtype in fp8_gemms:
        kinds = sites[site][1]
        assert (a_dtype, w_dtype) == (fmt[kinds[0]], fmt[kinds[1]]), site
        assert program is sites[site][0] and fp8 == recipe.gemm(kinds, "tensor"), site
    listed = {program for program, _ in maps.values()}
    assert {program for _, program, _ in run.maps} <= listed
    assert {p.name for p in listed if p.name.startswith("quantize_tensor")} == {
        "quantize_tensor" if f == E4M3 else "quantize_tensor_e5m2" for f in formats}
    names = {program.name for program, _ in prebuild_items(recipe)}
    assert ("swiglu_backward_t_e5m2" in names) == (grad == E5M2) and ("swiglu_t_e5m2" in names) == (act == E5M2)


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
    # one kernel per program and partials flag (o.quant and weight.quant share quantize_tensor, not its flag)
    items = {(program, opts["partial_reductions"]) for program, opts in map_items(recipe)}
    assert len(items) == len(map_items(recipe)) and items == set(map_sites(recipe).values())


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


def test_the_grouped_recipe_changes_only_the_activations_transposed_copies_and_their_weight_gradients():
    from coda_cutlass import epilogues as E
    base, g16 = gemm_sites(RECIPES["blockwise"]), gemm_sites(RECIPES["blockwise_g16"])
    assert set(base) == set(g16)
    changed = {s for s in base if base[s] != g16[s]}
    assert changed == {"o", "down", "gate_up", "qkv.wgrad", "o.wgrad", "gate_up.wgrad", "down.wgrad"}
    assert all(g16[s][2] == "block_16x128" and g16[s][0] is E.identity for s in changed if s.endswith(".wgrad"))
    assert g16["gate_up"][0] is E.swiglu_fp8_g16 and g16["o"][0] is g16["down"][0] is E.residual_norm_stats_fp8_g16
    maps_base, maps_g16 = map_sites(RECIPES["blockwise"]), map_sites(RECIPES["blockwise_g16"])
    assert {s for s in maps_base if maps_base[s] != maps_g16[s]} == {"norm0", "o.quant", "h.quant"}  # activations
