"""Whole-model state between a coda ``LlamaModel`` and a transformers checkpoint (tensors only).

coda keys: ``embed``, ``norm``, ``lm_head`` and ``blocks.<i>.<qkv|o|gate_up|down|attn_norm|mlp_norm>``
(kernel layout); transformers keys: ``model.embed_tokens.weight``, ``model.norm.weight``,
``lm_head.weight`` and ``model.layers.<i>.<path>`` of the family's parameter paths (standard
layout). A tied LM head is the embedding: transformers checkpoints omit ``lm_head.weight`` then.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ..sharding import full_value
from .family import Family
from .fields import head_dim
from .layer import BLOCK_PARAMS, kernel_weights, standard_layout


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


def hf_model_shapes(model: Any, family: Family, config: Any, tied: bool) -> dict[str, torch.Size]:
    """The shape of each transformers key of a coda LlamaModel's checkpoint: ``to_hf_keys`` of meta
    copies of its parameters (nothing is computed; a sharded parameter's whole shape)."""
    meta = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in model.named_parameters()}
    return {k: t.shape for k, t in to_hf_keys(meta, family, config, tied).items()}


def read_by_model(key: str, family: Family) -> bool:
    """Is ``key`` one the model reads or may ignore: its own keys, a tied head's ``lm_head.weight``
    (transformers' state_dict() of a tied model has it), and the RoPE ``inv_freq`` buffers older
    checkpoints saved (computed from the config, as transformers does)."""
    return key == _key(family.lm_head_path) or key.endswith("rotary_emb.inv_freq")


def from_hf_keys(state: Mapping[str, torch.Tensor], family: Family, config: Any, tied: bool, *,
                 current: Callable[[int], Mapping[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """transformers state dict -> coda LlamaModel state (kernel layout) of the keys present: the whole
    model's, or part of it (one shard of a sharded checkpoint, which transformers loads shard by
    shard); which keys must be there is the caller's to decide (load_state_dict's ``strict``).

    A layer's parameters are fused (q, k, v into one qkv; gate and up), and a shard may hold only
    some of them: a layer given in part takes its other parameters from ``current(i)`` (the model's
    values under transformers' paths), so shards loaded one after another build it whole; without
    ``current`` a layer given in part is an error that names what it lacks."""
    _, _, hd = _widths(config)
    out: dict[str, torch.Tensor] = {}
    for name, path in (("embed", family.embed_path), ("norm", family.norm_path)):
        if _key(path) in state:
            out[name] = state[_key(path)]
    if tied:                                        # the head is the embedding (a tied checkpoint has no head)
        if "embed" in out:
            out["lm_head"] = out["embed"]
    elif _key(family.lm_head_path) in state:
        out["lm_head"] = state[_key(family.lm_head_path)]
    for i in range(config.num_hidden_layers):
        keys = dict(zip(family.paths.values(), hf_layer_keys(family, i)))
        given = {p: state[k] for p, k in keys.items() if k in state}
        if not given:
            continue
        if len(given) < len(keys):
            lacking = [k for p, k in keys.items() if p not in given]
            if current is None:
                raise KeyError(f"the {family.name} state dict has part of layer {i}, not {lacking}")
            ref = next(iter(given.values()))
            have = current(i)
            given = {p: given[p] if p in given else have[p].to(ref.device, ref.dtype) for p in keys}
        for n, t in kernel_weights(family.to_standard(given), hd).items():
            out[f"blocks.{i}.{n}"] = t
    return out


def layer_paths(block: Any, family: Family) -> dict[str, torch.Tensor]:
    """A coda block's weights under the family's transformers layer paths (standard layout; whole
    tensors, gathered under FSDP2)."""
    d = block.dims
    w = standard_layout({n: full_value(p) for n, p in block.named_parameters()}, d.q_width, d.kv_width, d.head_dim)
    return family.from_standard(w)


def looks_like_hf(keys: Any, family: Family) -> bool:
    """Does a state dict use transformers keys (a Trainer checkpoint being loaded back, or one shard
    of it: any of the model's keys)?"""
    whole = {_key(family.embed_path), _key(family.norm_path), _key(family.lm_head_path)}
    return any(k.startswith(family.layers_path + ".") or k in whole for k in keys)
