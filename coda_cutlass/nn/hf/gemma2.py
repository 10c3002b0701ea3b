"""Gemma 2: Gemma's (1 + w) norms, GeGLU-tanh (``hidden_activation``) and sqrt(hidden) embedding
scale, plus sandwich norms (RMSNorms on the attention and MLP outputs before the residual adds:
``post_attention_layernorm``, ``post_feedforward_layernorm``; the MLP's input norm is
``pre_feedforward_layernorm``), a softmax scale of ``query_pre_attn_scalar ** -0.5`` and sliding-window
layers (``layer_types``). Soft-capped attention logits (``attn_logit_softcapping``) run as eager torch
attention (SDPA has no soft-cap); soft-capped final logits (``final_logit_softcapping``) in the LM
head's epilogues (``epilogues.softcap``)."""

from __future__ import annotations

from typing import Any

from .family import Family
from .gemma import Gemma


class Gemma2(Gemma):
    name = "gemma2"
    model_types = ("gemma2",)
    fields = Gemma.fields | {"query_pre_attn_scalar", "sliding_window", "layer_types", "final_logit_softcapping",
                             "attn_logit_softcapping", "sliding_window_pattern", "cache_implementation"}
    activation_field = "hidden_activation"
    paths = {**Family.paths, "mlp_norm": "pre_feedforward_layernorm.weight",
             "post_attn_norm": "post_attention_layernorm.weight",
             "post_mlp_norm": "post_feedforward_layernorm.weight"}

    def logit_softcap(self, config: Any) -> float | None:
        cap = getattr(config, "final_logit_softcapping", None)
        return None if cap is None else float(cap)

    def activation_name(self, config: Any) -> str:
        return getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"

    def attention_softcap(self, config: Any) -> float | None:
        cap = getattr(config, "attn_logit_softcapping", None)
        return None if cap is None else float(cap)

    def attention_scale(self, config: Any) -> float | None:
        return float(config.query_pre_attn_scalar) ** -0.5

    def layer_type(self, config: Any, layer_idx: int) -> str | None:
        types = getattr(config, "layer_types", None)
        if types:
            return types[layer_idx]
        return "sliding_attention" if layer_idx % 2 == 0 else "full_attention"   # transformers 4: even layers

    def sliding_window(self, config: Any, layer_idx: int) -> int | None:
        if self.layer_type(config, layer_idx) != "sliding_attention":
            return None
        return getattr(config, "sliding_window", None)


FAMILY = Gemma2()
