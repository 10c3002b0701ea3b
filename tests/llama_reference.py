"""Test helpers over coda_cutlass.nn.reference (the plain torch Llama the modules are checked against)."""

from __future__ import annotations

import torch

from coda_cutlass.nn.reference import ReferenceLlama, coda_grads_standard, standard_block, standard_weights

__all__ = ["coda_grads_standard", "standard_block", "standard_weights", "standard_model_loss"]


def standard_model_loss(model, tokens: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100):
    """The model as a plain torch stack; returns (loss, leaves): after backward the leaves hold the
    gradients in the standard layout (embed, norm, lm_head, blocks: standard_weights names)."""
    ref = ReferenceLlama(model)
    loss = ref(tokens, targets, ignore_index=ignore_index)
    leaves = {"embed": ref.embed, "norm": ref.norm, "lm_head": ref.lm_head,
              "blocks": [dict(b.items()) for b in ref.blocks]}
    return loss, leaves
