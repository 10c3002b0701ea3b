"""One transformers decoder layer to a coda ``LlamaBlock`` and back.

- q and k rows: transformers rotates half-split pairs (i, i + head_dim/2) of each head; the RoPE
  epilogue rotates adjacent columns (2i, 2i+1): the rows are permuted within each head
  (coda_cutlass.layouts.permute_rope_rows). Attention scores are unchanged because q and k get the
  same permutation, and v and o are untouched.
- q, k, v are fused into one W_qkv; gate and up are interleaved row by row into one W_gu.

The family of the layer (``registry.family_of`` its config) reads the config and the layer and
refuses, by name, whatever it cannot compute. ``to_hf`` checks that the target layer computes what
the block computes (family, widths, RoPE, window) and that every shape matches before it writes.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ...layouts import deinterleave_gate_up, interleave_gate_up, permute_rope_rows, unpermute_rope_rows
from .family import Family
from .fields import UnsupportedConfig
from .registry import family_of


def layer_config(layer: Any, config: Any = None) -> Any:
    config = config if config is not None else getattr(getattr(layer, "self_attn", None), "config", None)
    if config is None and hasattr(layer, "layers") and hasattr(layer, "config"):
        raise ValueError(f"{type(layer).__name__} is a whole decoder, not one decoder layer: LlamaBlock.from_hf takes "
                         f"one of its .layers[i]; for the whole model use coda_cutlass.nn.from_hf(causal_lm)")
    if config is None:
        raise ValueError(f"cannot find the config of {type(layer).__name__} (no self_attn.config): is it a "
                         f"transformers decoder layer? If so, pass its config: from_hf(layer, config)")
    return config


def kernel_weights(w: dict[str, torch.Tensor], head_dim: int) -> dict[str, torch.Tensor]:
    """Standard-layout weights -> the block's parameters (qkv, o, gate_up, down, attn_norm, mlp_norm)."""
    out = {"qkv": torch.cat((permute_rope_rows(w["q"], head_dim), permute_rope_rows(w["k"], head_dim), w["v"])),
           "o": w["o"], "gate_up": interleave_gate_up(w["gate"], w["up"]), "down": w["down"],
           "attn_norm": w["attn_norm"], "mlp_norm": w["mlp_norm"]}
    if "q_bias" in w:             # biases follow their rows
        out["qkv_bias"] = torch.cat((permute_rope_rows(w["q_bias"], head_dim), permute_rope_rows(w["k_bias"], head_dim),
                                     w["v_bias"]))
    for n in ("q_norm", "k_norm"):  # per-head gains follow the heads' row order
        if n in w:
            out[n] = permute_rope_rows(w[n], head_dim)
    for n in ("post_attn_norm", "post_mlp_norm"):
        if n in w:
            out[n] = w[n]
    return out


BLOCK_PARAMS = ("qkv", "o", "gate_up", "down", "attn_norm", "mlp_norm", "qkv_bias", "q_norm", "k_norm",
                "post_attn_norm", "post_mlp_norm")
# the standard-layout weights each fused block parameter is made of (the others: their own name)
FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up"), "qkv_bias": ("q_bias", "k_bias", "v_bias")}


def layer_requires_grad(w: dict[str, torch.Tensor], layer_idx: int) -> dict[str, bool]:
    """Each block parameter's requires_grad from the standard-layout weights it is made of (a
    transformers layer's parameters, or views of them). Weights fused into one parameter must agree:
    one parameter cannot be part frozen."""
    flags: dict[str, bool] = {}
    for name in BLOCK_PARAMS:
        parts = FUSED.get(name, (name,))
        if not all(p in w for p in parts):
            continue
        got = {w[p].requires_grad for p in parts}
        if len(got) > 1:
            frozen = [p for p in parts if not w[p].requires_grad]
            raise UnsupportedConfig(f"layer {layer_idx}: {', '.join(parts)} become one parameter ({name}) in coda, "
                                    f"but only {', '.join(frozen)} {'is' if len(frozen) == 1 else 'are'} frozen "
                                    "(requires_grad=False); freeze all of them or none")
        flags[name] = got.pop()
    return flags


def standard_layout(w: dict[str, torch.Tensor], q_width: int, kv_width: int, head_dim: int) -> dict[str, torch.Tensor]:
    """The block's parameters (kernel layout) -> standard-layout weights (new tensors, detached)."""
    q, k, v = w["qkv"].detach().split((q_width, kv_width, kv_width))
    gate, up = deinterleave_gate_up(w["gate_up"].detach())
    out = {"q": unpermute_rope_rows(q, head_dim), "k": unpermute_rope_rows(k, head_dim), "v": v.clone(),
           "o": w["o"].detach().clone(), "gate": gate, "up": up, "down": w["down"].detach().clone(),
           "attn_norm": w["attn_norm"].detach().clone(), "mlp_norm": w["mlp_norm"].detach().clone()}
    if w.get("qkv_bias") is not None:
        qb, kb, vb = w["qkv_bias"].detach().split((q_width, kv_width, kv_width))
        out.update(q_bias=unpermute_rope_rows(qb, head_dim), k_bias=unpermute_rope_rows(kb, head_dim), v_bias=vb.clone())
    for n in ("q_norm", "k_norm"):
        if w.get(n) is not None:
            out[n] = unpermute_rope_rows(w[n].detach(), head_dim)
    for n in ("post_attn_norm", "post_mlp_norm"):
        if w.get(n) is not None:
            out[n] = w[n].detach().clone()
    return out


def standard_weights(block: Any) -> dict[str, torch.Tensor]:
    """A block's weights in the standard layout (new tensors, detached)."""
    d = block.dims
    return standard_layout({n: p for n, p in block.named_parameters()}, d.q_width, d.kv_width, d.head_dim)


def block_from_hf(cls: Any, layer: Any, config: Any = None, *, attention: str = "sdpa",
                  ignore_fields: Iterable[str] = (), layer_idx: int | None = None) -> Any:
    """A ``cls`` (LlamaBlock) with the weights and settings of a transformers decoder layer."""
    config = layer_config(layer, config)
    family = family_of(config)
    family.check_config(config, ignore_fields)
    family.check_layer(layer)
    idx = family.layer_index(layer) if layer_idx is None else layer_idx
    options = family.block_options(config, idx)
    w = family.read_layer(layer)
    ref = w["q"]
    block = cls(**options, attention=attention, device=ref.device, dtype=ref.dtype)
    _check_shapes(block, w, f"the {family.name} layer")
    params = dict(block.named_parameters())
    with torch.no_grad():
        for name, t in kernel_weights(w, block.dims.head_dim).items():
            params[name].copy_(t)
    return block


def _check_shapes(block: Any, w: dict[str, torch.Tensor], what: str) -> None:
    mine = standard_weights(block)
    if set(w) != set(mine):
        raise ValueError(f"{what}: weights {sorted(w)}, the block has {sorted(mine)}")
    for name in mine:
        if tuple(w[name].shape) != tuple(mine[name].shape):
            raise ValueError(f"{what}: weight {name!r} has shape {tuple(w[name].shape)}, the block's is "
                             f"{tuple(mine[name].shape)} ({block.extra_repr()})")


def _check_target(block: Any, family: Family, config: Any, idx: int) -> None:
    """The layer's config computes what the block computes: refuse before writing anything."""
    options = family.block_options(config, idx)
    d = block.dims
    mine = {"dim": d.dim, "n_heads": d.n_heads, "n_kv_heads": d.n_kv_heads, "ffn_dim": d.ffn_dim,
            "head_dim": d.head_dim, "eps": d.eps, "rope": block.rope, "sliding_window": block.attention.window,
            "activation": block.mlp.name, "qkv_bias": block.qkv_bias is not None, "norm_offset": block.norm_offset,
            "qk_norm": block.q_norm is not None, "sandwich_norms": block.post_attn_norm is not None,
            "attention_scale": block._attention_args[1], "attention_softcap": block.attention.softcap}
    diff = [f"{k}: layer {options[k]!r}, block {v!r}" for k, v in mine.items() if options[k] != v]
    if diff:
        raise ValueError(f"to_hf: the target {family.name} layer does not compute what this block computes, nothing "
                         f"was written ({'; '.join(diff)})")


def block_to_hf(block: Any, layer: Any, config: Any = None, *, ignore_fields: Iterable[str] = ()) -> Any:
    """Copy a block's weights into a transformers decoder layer (the inverse of block_from_hf), after
    checking that the layer is of a supported family, computes what the block computes and has the
    block's shapes; on a mismatch nothing is written."""
    config = layer_config(layer, config)
    family = family_of(config)
    family.check_config(config, ignore_fields)
    family.check_layer(layer)
    _check_target(block, family, config, family.layer_index(layer))
    target = family.read_layer(layer)
    w = standard_weights(block)
    for name in w:
        if tuple(target[name].shape) != tuple(w[name].shape):
            raise ValueError(f"to_hf: weight {name!r} of the target layer has shape {tuple(target[name].shape)}, "
                             f"the block's is {tuple(w[name].shape)}; nothing was written")
    family.write_layer(layer, w)
    return layer


__all__ = ["block_from_hf", "block_to_hf", "kernel_weights", "layer_requires_grad", "standard_layout", "standard_weights", "layer_config",
           "UnsupportedConfig"]
