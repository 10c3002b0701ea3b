"""Mistral: a Llama layer whose attention sees a sliding window of ``config.sliding_window`` tokens
(each token attends to itself and the window - 1 before it; None: full causal attention)."""

from __future__ import annotations

from typing import Any

from .family import Family


class Mistral(Family):
    name = "mistral"
    model_types = ("mistral",)
    # attention_bias / mlp_bias: not read by transformers' class (its linears have no biases); a config
    # that carries them anyway is checked as Llama's (False / absent), and check_layer refuses real biases
    fields = Family.fields | {"sliding_window"}

    def sliding_window(self, config: Any, layer_idx: int) -> int | None:
        return getattr(config, "sliding_window", None)


FAMILY = Mistral()
