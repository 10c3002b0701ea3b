"""Every kernel an FP8 block launches, by site (the FP8 twin of nn/kernels.py): for prebuilding them
(a wheel, a build machine ahead of a GPU run) and for tuning. Every GEMM reads K-major operands
("nk": the dX GEMMs read the weights' transposed FP8 copies), so one layout serves all sites."""

from __future__ import annotations

from typing import Any

import torch

from ... import epilogues as E
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
    "gate_up.dgrad": (E.norm_backward, ("gradient", "weight"), "block", True),    # dx quantised by a map kernel
    "o.dgrad": (E.identity, ("gradient", "weight"), "block", False),
    "qkv.dgrad": (E.norm_backward, ("gradient", "weight"), "block", True),
    # weight gradients: K is the token dimension, both operands in 1 x 128 runs of their transposes
    "down.wgrad": (E.identity, ("gradient", "activation"), "block_1x128", False),
    "gate_up.wgrad": (E.identity, ("gradient", "activation"), "block_1x128", False),
    "o.wgrad": (E.identity, ("gradient", "activation"), "block_1x128", False),
    "qkv.wgrad": (E.identity, ("gradient", "activation"), "block_1x128", False),
}

# map kernels (16-bit input): site -> (program, partial reductions)
MAP_SITES: dict[str, tuple[Any, bool]] = {
    "norm0": (E.norm_stats_fp8, True),
    "o.quant": (E.quantize_rows, False),          # every ".quant" site: o, y, dz, dqkv, an incoming gradient
    "rope.dgrad": (E.rope_backward, True),
}


def prebuild_items(recipe: Fp8Recipe) -> list[tuple[Any, dict]]:
    """(program, options) of every distinct FP8 GEMM kernel of ``recipe``, default configuration,
    for ``cc.compile_many``."""
    seen: set[tuple[str, Any, str, bool]] = set()
    items = []
    for program, kinds, scaling, partial in GEMM_SITES.values():
        dtype = recipe.gemm_dtype(*kinds)
        key = (program.name, str(dtype), scaling, partial)
        if key not in seen:
            seen.add(key)
            items.append((program, {"dtype": dtype, "scaling": scaling, "partial_reductions": partial}))
    return items


def map_items(dtype: torch.dtype = torch.bfloat16) -> list[tuple[Any, dict]]:
    """(program, options) of every distinct map kernel, for ``cc.compile_map``."""
    return [(p, {"dtype": dtype, "partial_reductions": partial}) for p, partial in dict(MAP_SITES.values()).items()]
