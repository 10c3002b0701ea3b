"""Qwen 3: a Llama layer (no biases by default) whose attention normalises q and k per head
(``self_attn.q_norm`` / ``k_norm``, RMSNorms over head_dim with the model's eps) before RoPE
(``nn.qk_norm``), with Qwen 2's sliding-window layers."""

from __future__ import annotations

from typing import Any, Iterable

from .fields import require
from .qwen2 import Qwen2


class Qwen3(Qwen2):
    name = "qwen3"
    model_types = ("qwen3",)
    fields = Qwen2.fields | {"attention_bias"}
    paths = {**{k: v for k, v in Qwen2.paths.items() if not k.endswith("_bias")},
             "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}

    def check_config(self, config: Any, ignore: Iterable[str] = ()) -> None:
        super().check_config(config, ignore)
        require(config, "attention_bias", (False, None), "q/k/v biases together with q/k norms are not implemented",
                False)


FAMILY = Qwen3()
