"""Phi-3: a Llama layer with q/k/v fused into one ``qkv_proj`` (rows q, then k, then v) and gate/up
into one ``gate_up_proj`` (rows gate, then up); an optional sliding window; residual and embedding
dropouts (refused when set: not implemented). Long contexts use rope_type longrope."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .family import Family
from .fields import UnsupportedConfig


class Phi3(Family):
    name = "phi3"
    model_types = ("phi3",)
    # attention_bias / mlp_bias: not read by transformers' class (its linears have no biases); a config
    # that carries them anyway is checked as Llama's (False / absent), and check_layer refuses real biases
    fields = Family.fields | {
        "sliding_window", "resid_pdrop", "embd_pdrop", "original_max_position_embeddings", "partial_rotary_factor"}
    paths = {"qkv": "self_attn.qkv_proj.weight", "o": "self_attn.o_proj.weight", "gate_up": "mlp.gate_up_proj.weight",
             "down": "mlp.down_proj.weight", "attn_norm": "input_layernorm.weight",
             "mlp_norm": "post_attention_layernorm.weight"}

    def check_config(self, config: Any, ignore: Iterable[str] = ()) -> None:
        super().check_config(config, ignore)
        for name in ("resid_pdrop", "embd_pdrop"):
            if float(getattr(config, name, 0.0) or 0.0) != 0.0:
                raise UnsupportedConfig(f"config.{name}={getattr(config, name)!r}: residual and embedding dropout are "
                                        f"not implemented (set config.{name} = 0.0 to run without them)")

    def sliding_window(self, config: Any, layer_idx: int) -> int | None:
        return getattr(config, "sliding_window", None)

    def to_standard(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        p = self.paths
        qkv, gate_up, down = parts[p["qkv"]], parts[p["gate_up"]], parts[p["down"]]
        o = parts[p["o"]]
        nq = o.shape[1]                                    # o_proj: (hidden, heads * head_dim)
        nkv = (qkv.shape[0] - nq) // 2
        q, k, v = qkv.split((nq, nkv, nkv))
        gate, up = gate_up.chunk(2)
        return {"q": q, "k": k, "v": v, "o": o, "gate": gate, "up": up, "down": down,
                "attn_norm": parts[p["attn_norm"]], "mlp_norm": parts[p["mlp_norm"]]}

    def from_standard(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        p = self.paths
        return {p["qkv"]: torch.cat((weights["q"], weights["k"], weights["v"])),
                p["gate_up"]: torch.cat((weights["gate"], weights["up"])),
                **{p[n]: weights[n] for n in ("o", "down", "attn_norm", "mlp_norm")}}


FAMILY = Phi3()
