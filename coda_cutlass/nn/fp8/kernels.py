"""Every kernel an FP8 block launches, by recipe scaling and site (the FP8 twin of nn/kernels.py): for
prebuilding them (a wheel, a build machine ahead of a GPU run) and for tuning. Every GEMM reads
K-major operands ("nk": the dX GEMMs read the weights' transposed FP8 copies), so one layout serves
all sites."""

from __future__ import annotations

import functools
from typing import Any

import torch

from ... import epilogues as E
from ...epilogues.fp8_tensorwise import TensorwisePrograms, tensorwise_programs
from .recipe import Fp8Recipe

# site -> (program, (A kind, W kind), scaling, partial reductions)
GEMM_SITES: dict[str, tuple[Any, tuple[str, str], str, bool]] = {
    "qkv": (E.rope, ("activation", "weight"), "block", False),
    "o": (E.residual_norm_stats_fp8, ("activation", "weight"), "block", True),
    "gate_up": (E.swiglu_fp8, ("activation", "weight"), "block", False),
    "down": (E.residual_norm_stats_fp8, ("activation", "weight"), "block", True),
    "down.to_bf16": (E.residual_norm_stats, ("activation", "weight"), "block", True),   # before the LM head
    "down.last": (E.residual_add, ("activation", "weight"), "block", False),
    "down.dgrad": (E.swiglu_backward_scaled, ("gradient", "weight"), "block", True),
    "gate_up.dgrad": (E.norm_backward_ax, ("gradient", "weight"), "block", True),  # dx quantised by a map kernel
    "o.dgrad": (E.identity, ("gradient", "weight"), "block", False),
    "qkv.dgrad": (E.norm_backward_ax, ("gradient", "weight"), "block", True),
    # weight gradients: K is the token dimension, both operands in 1 x 128 runs of their transposes
    "down.wgrad": (E.identity, ("gradient", "activation"), "block_1x128", False),
    "gate_up.wgrad": (E.identity, ("gradient", "activation"), "block_1x128", False),
    "o.wgrad": (E.identity, ("gradient", "activation"), "block_1x128", False),
    "qkv.wgrad": (E.identity, ("gradient", "activation"), "block_1x128", False),
}

def programs(recipe: Fp8Recipe) -> TensorwisePrograms:
    """The per-tensor programs storing the recipe's formats (e4m3 by default)."""
    return tensorwise_programs(recipe.activation, recipe.gradient, recipe.weight)


@functools.cache
def _tensor_gemm_sites(P: TensorwisePrograms) -> dict[str, tuple[Any, tuple[str, str], str, bool]]:
    """Recipe "tensorwise" (nn/fp8/tensorwise.py): every GEMM per-tensor scaled."""
    return {
        "qkv": (E.rope, ("activation", "weight"), "tensor", False),
        "o": (P.residual_norm_stats_t, ("activation", "weight"), "tensor", True),
        "gate_up": (P.swiglu_t, ("activation", "weight"), "tensor", True),
        "down": (P.residual_norm_stats_t, ("activation", "weight"), "tensor", True),
        "down.to_bf16": (E.residual_norm_stats, ("activation", "weight"), "tensor", True),
        "down.last": (E.residual_add, ("activation", "weight"), "tensor", False),
        "down.dgrad": (P.swiglu_backward_t, ("gradient", "weight"), "tensor", True),
        "gate_up.dgrad": (P.norm_backward_t, ("gradient", "weight"), "tensor", True),
        "o.dgrad": (E.identity, ("gradient", "weight"), "tensor", False),
        "qkv.dgrad": (P.norm_backward_t, ("gradient", "weight"), "tensor", True),
        "down.wgrad": (E.identity, ("gradient", "activation"), "tensor", False),
        "gate_up.wgrad": (E.identity, ("gradient", "activation"), "tensor", False),
        "o.wgrad": (E.identity, ("gradient", "activation"), "tensor", False),
        "qkv.wgrad": (E.identity, ("gradient", "activation"), "tensor", False),
    }


# map kernels (16-bit input): site -> (program, partial reductions)
MAP_SITES: dict[str, tuple[Any, bool]] = {
    "norm0": (E.norm_stats_fp8, True),
    "o.quant": (E.quantize_rows_t, False),        # activations: the attention output, a block's incoming h
    "h.quant": (E.quantize_rows_t, False),
    "y.quant": (E.quantize_rows, False),          # y^T comes from the gate/up epilogue
    "rope.dgrad": (E.rope_backward, True),
    **{f"{g}.quant": (E.quantize_rows_t, False) for g in ("dx2", "dz", "dx1", "dqkv", "dx")},   # gradients
}

# recipe "blockwise_g16": the activations' transposed copies in 16 x 128 blocks (their producers'
# "_g16" programs, epilogues/fp8_block_grouped.py), read by the weight gradients as 16 x 128 W scales
_G16_PROGRAMS = {"o": E.residual_norm_stats_fp8_g16, "down": E.residual_norm_stats_fp8_g16,
                 "gate_up": E.swiglu_fp8_g16}
G16_GEMM_SITES: dict[str, tuple[Any, tuple[str, str], str, bool]] = {
    site: (_G16_PROGRAMS.get(site, program), kinds, "block_16x128" if site.endswith(".wgrad") else scaling, partial)
    for site, (program, kinds, scaling, partial) in GEMM_SITES.items()
}
G16_MAP_SITES: dict[str, tuple[Any, bool]] = {
    **MAP_SITES, "norm0": (E.norm_stats_fp8_g16, True), "o.quant": (E.quantize_rows_t_g16, False),
    "h.quant": (E.quantize_rows_t_g16, False),
}
@functools.cache
def _tensor_map_sites(P: TensorwisePrograms) -> dict[str, tuple[Any, bool]]:
    return {
        "norm0": (E.norm_stats, True),                      # the first block quantises its h itself ("h.quant")
        "o.quant": (P.quantize_activation, True),           # o, and h entering the first block ("h.quant")
        "dx2.quant": (P.quantize_gradient, True),           # a gradient no coda epilogue quantised
        "weight.quant": (P.quantize_weight, True),          # the map-kernel weight copies (weights._per_tensor; the blocks use torch)
        "rope.dgrad": (P.rope_backward_t, True),
    }


def gemm_sites(recipe: Fp8Recipe) -> dict[str, tuple[Any, tuple[str, str], str, bool]]:
    if recipe.scaling == "tensor":
        return _tensor_gemm_sites(programs(recipe))
    return G16_GEMM_SITES if recipe.wgrad_group == 16 else GEMM_SITES


def map_sites(recipe: Fp8Recipe) -> dict[str, tuple[Any, bool]]:
    if recipe.scaling == "tensor":
        return _tensor_map_sites(programs(recipe))
    return G16_MAP_SITES if recipe.wgrad_group == 16 else MAP_SITES


def prebuild_items(recipe: Fp8Recipe) -> list[tuple[Any, dict]]:
    """(program, options) of every distinct FP8 GEMM kernel of ``recipe``, default configuration,
    for ``cc.compile_many``."""
    seen: set[tuple[str, Any, str, bool]] = set()
    items = []
    for program, kinds, scaling, partial in gemm_sites(recipe).values():
        dtype = recipe.gemm_dtype(*kinds)
        key = (program.name, str(dtype), scaling, partial)
        if key not in seen:
            seen.add(key)
            items.append((program, {"dtype": dtype, "scaling": scaling, "partial_reductions": partial,
                                    "fast_accum": recipe.fast_accum}))
    return items


def map_items(recipe: Fp8Recipe, dtype: torch.dtype = torch.bfloat16) -> list[tuple[Any, dict]]:
    """(program, options) of every distinct map kernel of ``recipe``, for ``cc.compile_map``."""
    sites = map_sites(recipe).values()      # one kernel per program and partials flag (sites share them)
    return [(p, {"dtype": dtype, "partial_reductions": partial}) for p, partial in dict.fromkeys(sites)]
