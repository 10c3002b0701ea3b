"""Weight conversion between transformers' Llama modules and coda_cutlass.nn (kernel layout).

- q and k rows: Hugging Face rotates half-split pairs (i, i + head_dim/2) of each head; the RoPE
  epilogue rotates adjacent columns (2i, 2i+1): the rows are permuted within each head
  (coda_cutlass.layouts.permute_rope_rows). Attention scores are unchanged because q and k get the
  same permutation, and v and o are untouched.
- q, k, v are fused into one W_qkv; gate and up are interleaved row by row into one W_gu.
Only duck-typed attribute access: transformers is needed only for rope_scaling variants.
"""

from __future__ import annotations

from typing import Any

import torch

from ..layouts import deinterleave_gate_up, interleave_gate_up, permute_rope_rows, unpermute_rope_rows
from .attention import rope_inv_freq


def _config(layer: Any, config: Any) -> Any:
    config = config if config is not None else getattr(getattr(layer, "self_attn", None), "config", None)
    if config is None:
        raise ValueError("cannot find the model config: pass it (from_hf(layer, config))")
    return config


def hf_inv_freq(config: Any, head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies of a Llama config, rope_scaling included (via transformers)."""
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return rope_inv_freq(head_dim, float(getattr(config, "rope_theta", 10000.0)))
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    inv, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    if float(attention_scaling) != 1.0:
        raise ValueError(f"rope_scaling type {rope_type!r} scales attention by {attention_scaling}; not supported")
    return inv.to(torch.float64)


def dims_from_hf(config: Any) -> dict[str, Any]:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {"dim": config.hidden_size, "n_heads": heads,
            "n_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "ffn_dim": config.intermediate_size, "head_dim": head_dim, "eps": config.rms_norm_eps}


def _check_no_bias(layer: Any) -> None:
    for mod in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
        if getattr(mod, "bias", None) is not None:
            raise ValueError("linear biases (attention_bias / mlp_bias) are not supported by LlamaBlock")


def block_from_hf(cls: Any, layer: Any, config: Any, attention: str) -> Any:
    config = _config(layer, config)
    _check_no_bias(layer)
    dims = dims_from_hf(config)
    a, m = layer.self_attn, layer.mlp
    ref = a.q_proj.weight
    block = cls(**dims, inv_freq=hf_inv_freq(config, dims["head_dim"]), attention=attention,
                device=ref.device, dtype=ref.dtype)
    hd = dims["head_dim"]
    with torch.no_grad():
        block.qkv.copy_(torch.cat((permute_rope_rows(a.q_proj.weight, hd), permute_rope_rows(a.k_proj.weight, hd),
                                   a.v_proj.weight)))
        block.o.copy_(a.o_proj.weight)
        block.gate_up.copy_(interleave_gate_up(m.gate_proj.weight, m.up_proj.weight))
        block.down.copy_(m.down_proj.weight)
        block.attn_norm.copy_(layer.input_layernorm.weight)
        block.mlp_norm.copy_(layer.post_attention_layernorm.weight)
    return block


def block_to_hf(block: Any, layer: Any) -> Any:
    d = block.dims
    a, m = layer.self_attn, layer.mlp
    q, k, v = block.qkv.split((d.q_width, d.kv_width, d.kv_width))
    gate, up = deinterleave_gate_up(block.gate_up)
    with torch.no_grad():
        a.q_proj.weight.copy_(unpermute_rope_rows(q, d.head_dim))
        a.k_proj.weight.copy_(unpermute_rope_rows(k, d.head_dim))
        a.v_proj.weight.copy_(v)
        a.o_proj.weight.copy_(block.o)
        m.gate_proj.weight.copy_(gate)
        m.up_proj.weight.copy_(up)
        m.down_proj.weight.copy_(block.down)
        layer.input_layernorm.weight.copy_(block.attn_norm)
        layer.post_attention_layernorm.weight.copy_(block.mlp_norm)
    return layer
