"""Gemma (1): a Llama layer whose RMSNorms scale by (1 + weight), whose MLP is GeGLU (tanh form,
``hidden_act="gelu_pytorch_tanh"``: transformers 5 reads hidden_act, not hidden_activation) and
whose embedding output is multiplied by sqrt(hidden_size) (in the compute dtype, as transformers
does); the LM head is tied to the embedding by default.
Bidirectional attention (``use_bidirectional_attention``) is refused: the block is causal."""

from __future__ import annotations

import math
from typing import Any, Iterable

from .family import Family
from .fields import UnsupportedConfig


class Gemma(Family):
    name = "gemma"
    model_types = ("gemma",)
    fields = Family.fields - {"mlp_bias"} | {"use_bidirectional_attention", "hidden_activation"}
    norm_offset = 1.0

    def check_config(self, config: Any, ignore: Iterable[str] = ()) -> None:
        super().check_config(config, ignore)
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedConfig("config.use_bidirectional_attention=True: the block's attention is causal")

    def activation_name(self, config: Any) -> str:
        # transformers 5's GemmaMLP reads hidden_act alone (a hidden_activation beside it is inert);
        # hidden_activation only where a transformers-4 style config has no hidden_act. Both read a
        # legacy hidden_act="gelu" as the tanh form (transformers 5's GemmaConfig rewrites it)
        act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        return "gelu_pytorch_tanh" if act == "gelu" else act

    def embed_scale(self, config: Any) -> float | None:
        return math.sqrt(config.hidden_size)


FAMILY = Gemma()
