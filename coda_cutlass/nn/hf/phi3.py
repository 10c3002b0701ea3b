"""Phi-3: a Llama layer with q/k/v fused into one ``qkv_proj`` (rows q, then k, then v) and gate/up
into one ``gate_up_proj`` (rows gate, then up); an optional sliding window; residual and embedding
dropouts (refused when set: not implemented). Long contexts use rope_type longrope."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .family import Family, _part
from .fields import UnsupportedConfig


class Phi3(Family):
    name = "phi3"
    model_types = ("phi3",)
    fields = Family.fields - {"attention_bias", "mlp_bias"} | {
        "sliding_window", "resid_pdrop", "embd_pdrop", "original_max_position_embeddings", "partial_rotary_factor"}
    paths = {"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_up_proj",
             "down": "mlp.down_proj", "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}

    def check_config(self, config: Any, ignore: Iterable[str] = ()) -> None:
        super().check_config(config, ignore)
        for name in ("resid_pdrop", "embd_pdrop"):
            if float(getattr(config, name, 0.0) or 0.0) != 0.0:
                raise UnsupportedConfig(f"config.{name}={getattr(config, name)!r}: residual and embedding dropout are "
                                        f"not implemented (set config.{name} = 0.0 to run without them)")

    def sliding_window(self, config: Any, layer_idx: int) -> int | None:
        return getattr(config, "sliding_window", None)

    def _widths(self, layer: Any) -> tuple[int, int]:
        a = layer.self_attn
        return a.config.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim

    def read_layer(self, layer: Any) -> dict[str, torch.Tensor]:
        fused = super().read_layer(layer)
        nq, nkv = self._widths(layer)
        q, k, v = fused["qkv"].split((nq, nkv, fused["qkv"].shape[0] - nq - nkv))
        gate, up = fused["gate_up"].chunk(2)
        return {"q": q, "k": k, "v": v, "o": fused["o"], "gate": gate, "up": up, "down": fused["down"],
                "attn_norm": fused["attn_norm"], "mlp_norm": fused["mlp_norm"]}

    def write_layer(self, layer: Any, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            _part(layer, self.paths["qkv"], self.name).weight.copy_(torch.cat((weights["q"], weights["k"], weights["v"])))
            _part(layer, self.paths["gate_up"], self.name).weight.copy_(torch.cat((weights["gate"], weights["up"])))
            for name in ("o", "down", "attn_norm", "mlp_norm"):
                _part(layer, self.paths[name], self.name).weight.copy_(weights[name])


FAMILY = Phi3()
