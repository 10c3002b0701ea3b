"""Gemma 3 (text): Gemma 2's layer with per-head q/k RMSNorms ((1 + w), before RoPE: ``nn.qk_norm``),
a RoPE per layer type (transformers 5: ``rope_parameters`` nested by "sliding_attention" /
"full_attention"; 4: ``rope_local_base_freq`` on sliding layers, ``rope_theta`` and ``rope_scaling``
on full ones) and sliding-window layers (``layer_types``). ``attn_logit_softcapping`` is a field of
the config that transformers 5's Gemma 3 attention never applies: it is not applied here either
(Gemma 2's is)."""

from __future__ import annotations

from typing import Any

from ..rope import Rope
from .fields import head_dim, rope_from_config
from .gemma2 import Gemma2


class Gemma3(Gemma2):
    name = "gemma3_text"
    model_types = ("gemma3_text",)
    fields = Gemma2.fields | {"rope_local_base_freq"}
    paths = {**Gemma2.paths, "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}

    def layer_type(self, config: Any, layer_idx: int) -> str | None:
        types = getattr(config, "layer_types", None)
        if types:
            return types[layer_idx]
        pattern = getattr(config, "sliding_window_pattern", None) or 6
        return "sliding_attention" if (layer_idx + 1) % pattern else "full_attention"

    def attention_softcap(self, config: Any) -> float | None:
        return None         # Gemma3Attention passes no softcap to its attention functions

    def rope(self, config: Any, layer_idx: int) -> Rope:
        kind = self.layer_type(config, layer_idx)
        params = getattr(config, "rope_parameters", None)
        if not params and kind == "sliding_attention" and getattr(config, "rope_local_base_freq", None):
            return Rope.default(head_dim(config), float(config.rope_local_base_freq))   # transformers 4
        return rope_from_config(config, kind)


FAMILY = Gemma3()
