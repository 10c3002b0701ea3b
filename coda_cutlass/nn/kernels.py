"""Every GEMM + epilogue kernel the Llama block and model launch, by site (for prebuilding them,
e.g. into a wheel, and for tuning). Map kernels are not listed: they build in seconds."""

from __future__ import annotations

from typing import Any

import torch

from .. import epilogues as E

FORWARD_ONLY = ".infer"   # the suffix of the sites the forward without autograd launches


def forward_only_site(site: str) -> bool:
    """Is ``site`` launched by the forward without autograd (inference, evaluation)?"""
    return site.endswith(FORWARD_ONLY)

# site -> (program, weight layout)
SITES: dict[str, tuple[Any, str]] = {
    "qkv": (E.rope, "nk"),
    "o": (E.residual_norm_stats, "nk"),
    "gate_up": (E.swiglu, "nk"),
    "down": (E.residual_norm_stats, "nk"),
    "down.last": (E.residual_add, "nk"),
    "down.dgrad": (E.swiglu_backward_y, "kn"),
    "gate_up.dgrad": (E.norm_backward_h, "kn"),
    "qkv.dgrad": (E.norm_backward_h, "kn"),
    "lm_head": (E.lm_head_lse, "nk"),
    "lm_head.logits": (E.rowscale, "nk"),
    "lm_head.recompute": (E.cross_entropy_backward, "nk"),
    "lm_head.dgrad": (E.norm_backward_first, "kn"),
    "lm_head.fused": (E.lm_head_lse_logits, "nk"),      # the forward that also computes the gradients
    # the forward without autograd (inference, evaluation): its own sites, tuned apart
    "qkv.infer": (E.rope, "nk"),
    "o.infer": (E.residual_norm_stats, "nk"),
    "gate_up.infer": (E.swiglu_only, "nk"),
    "down.infer": (E.residual_norm_stats, "nk"),
    "down.last.infer": (E.residual_add, "nk"),
}


# A forward-only site with no tuned choice of its own (``tune(forward_only=True)`` tunes them) uses
# the tuned choice of the training site whose GEMM it shares: swiglu_only stages less than swiglu, so
# every configuration that fits the one fits the other.
PLAN_FALLBACK: dict[str, str] = {s + FORWARD_ONLY: s for s in ("qkv", "o", "gate_up", "down", "down.last")}


def prebuild_items(dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)) -> list[tuple[Any, dict]]:
    """(program, options) of every distinct kernel, default configuration, per dtype."""
    seen: set[tuple[str, str, torch.dtype]] = set()
    items = []
    for program, layout in SITES.values():
        for dtype in dtypes:
            if (program.name, layout, dtype) not in seen:
                seen.add((program.name, layout, dtype))
                items.append((program, {"dtype": dtype, "weight_layout": layout}))
    return items
