"""Qwen 2: a Llama layer whose q, k and v projections have biases (added in the QKV epilogue before
RoPE), and an optional sliding window on the layers ``config.layer_types`` marks
"sliding_attention" (transformers 4: ``use_sliding_window`` from ``max_window_layers`` on)."""

from __future__ import annotations

from typing import Any

from .family import Family


class Qwen2(Family):
    name = "qwen2"
    model_types = ("qwen2",)
    fields = Family.fields - {"attention_bias", "mlp_bias"} | {
        "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
    paths = {**Family.paths, "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
             "v_bias": "self_attn.v_proj.bias"}

    def layer_type(self, config: Any, layer_idx: int) -> str | None:
        types = getattr(config, "layer_types", None)
        if types:
            return types[layer_idx]
        window = getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None)
        return "sliding_attention" if window and layer_idx >= config.max_window_layers else "full_attention"

    def sliding_window(self, config: Any, layer_idx: int) -> int | None:
        if self.layer_type(config, layer_idx) != "sliding_attention":
            return None
        return getattr(config, "sliding_window", None)


FAMILY = Qwen2()
