"""Whole-model state between a coda ``LlamaModel`` and a transformers checkpoint (tensors only).

coda keys: ``embed``, ``norm``, ``lm_head`` and ``blocks.<i>.<qkv|o|gate_up|down|attn_norm|mlp_norm>``
(kernel layout); transformers keys: ``model.embed_tokens.weight``, ``model.norm.weight``,
``lm_head.weight`` and ``model.layers.<i>.<path>`` of the family's parameter paths (standard
layout). A tied LM head is the embedding: transformers checkpoints omit ``lm_head.weight`` then.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .family import Family
from .fields import head_dim
from .layer import kernel_weights, standard_layout

BLOCK_PARAMS = ("qkv", "o", "gate_up", "down", "attn_norm", "mlp_norm", "qkv_bias", "q_norm", "k_norm", "post_attn_norm",
                "post_mlp_norm")


def _widths(config: Any) -> tuple[int, int, int]:
    hd = head_dim(config)
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return heads * hd, kv * hd, hd


def _key(path: str) -> str:
    return path


def to_hf_keys(state: Mapping[str, torch.Tensor], family: Family, config: Any, tied: bool) -> dict[str, torch.Tensor]:
    """coda LlamaModel state (no prefix) -> transformers state dict (standard layout)."""
    q_width, kv_width, hd = _widths(config)
    out = {_key(family.embed_path): state["embed"], _key(family.norm_path): state["norm"]}
    if not tied:
        out[_key(family.lm_head_path)] = state["lm_head"]
    for i in range(config.num_hidden_layers):
        w = {n: state[f"blocks.{i}.{n}"] for n in BLOCK_PARAMS if f"blocks.{i}.{n}" in state}
        for path, t in family.from_standard(standard_layout(w, q_width, kv_width, hd)).items():
            out[_key(f"{family.layers_path}.{i}.{path}")] = t
    return {k: v.detach() for k, v in out.items()}


def hf_layer_keys(family: Family, i: int) -> list[str]:
    return [_key(f"{family.layers_path}.{i}.{p}") for p in family.paths.values()]


def from_hf_keys(state: Mapping[str, torch.Tensor], family: Family, config: Any, tied: bool) -> dict[str, torch.Tensor]:
    """transformers state dict -> coda LlamaModel state (kernel layout); a missing key is an error
    that names it."""
    missing = [k for k in _expected(family, config, tied) if k not in state]
    if missing:
        raise KeyError(f"the {family.name} state dict lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    _, _, hd = _widths(config)
    out = {"embed": state[_key(family.embed_path)], "norm": state[_key(family.norm_path)]}
    out["lm_head"] = out["embed"] if tied else state[_key(family.lm_head_path)]
    for i in range(config.num_hidden_layers):
        parts = {p: state[_key(f"{family.layers_path}.{i}.{p}")] for p in family.paths.values()}
        for n, t in kernel_weights(family.to_standard(parts), hd).items():
            out[f"blocks.{i}.{n}"] = t
    return out


def _expected(family: Family, config: Any, tied: bool) -> list[str]:
    keys = [_key(family.embed_path), _key(family.norm_path)] + ([] if tied else [_key(family.lm_head_path)])
    for i in range(config.num_hidden_layers):
        keys += hf_layer_keys(family, i)
    return keys


def looks_like_hf(keys: Any, family: Family) -> bool:
    """Does a state dict use transformers keys (a Trainer checkpoint being loaded back)?"""
    return any(k.startswith(family.layers_path + ".") or k == _key(family.embed_path) for k in keys)
