"""Tiny transformers models and layers for the from_hf tests (CPU, fp32, built from configs: no
downloads). Weights are drawn larger than transformers' 0.02 initialisation (std 0.2 at width 64,
about 1.6 / sqrt(fan_in)), so attention is far from uniform and RoPE or mask errors show."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

DIMS = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": 48, "num_hidden_layers": 2}

CONFIGS = {
    "llama": "LlamaConfig", "mistral": "MistralConfig", "phi3": "Phi3Config", "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config", "gemma": "GemmaConfig", "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig",
    "mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig",
}


def config(model_type: str = "llama", **fields: Any) -> Any:
    attn = "eager" if model_type == "gemma2" else "sdpa"      # Gemma 2's soft-capped attention has no SDPA path
    kw = {**DIMS, "attn_implementation": attn, "max_position_embeddings": 64, **fields}
    if model_type == "phi3":
        kw.pop("head_dim")
        kw.setdefault("pad_token_id", 0)
    return getattr(transformers, CONFIGS[model_type])(**kw)


def draw(module: torch.nn.Module, seed: int = 3, std: float = 0.2) -> torch.nn.Module:
    """Large weights (norm gains around 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if p.dim() == 1 else 0.0))
    return module


def decoder_layer(cfg: Any, layer_idx: int = 0, seed: int = 3) -> torch.nn.Module:
    """The family's transformers decoder layer (fp32, large weights)."""
    model_cls = transformers.AutoModelForCausalLM.from_config(cfg).model
    layer = model_cls.layers[layer_idx].float()
    return draw(layer, seed)


def rotary(cfg: Any) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_config(cfg).model
    return model.rotary_emb


def run_layer(layer: torch.nn.Module, cfg: Any, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The transformers layer on x (B, S, D) at positions 0..S-1 (a fresh rotary module: dynamic
    RoPE starts from its trained length; Gemma 3 keeps one per layer type)."""
    B, S, _ = x.shape
    pos = torch.arange(S)[None].expand(B, S)
    kind = getattr(layer.self_attn, "layer_type", None)
    if cfg._attn_implementation == "eager":     # eager attention adds a float mask and is not causal by itself
        keep = mask if mask is not None else window_mask(B, S, S)
        mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    emb = rotary(cfg)(x, pos, kind) if cfg.model_type == "gemma3_text" else rotary(cfg)(x, pos)
    out = layer(x, position_embeddings=emb, attention_mask=mask, position_ids=pos)
    return out[0] if isinstance(out, tuple) else out


def window_mask(B: int, S: int, window: int) -> torch.Tensor:
    """The bool (B, 1, S, S) mask of a causal sliding window (what transformers builds)."""
    i = torch.arange(S)[:, None]
    j = torch.arange(S)[None, :]
    return ((j <= i) & (j > i - window)).expand(B, 1, S, S)


def grads_by_name(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


def block_grads_as_layer(block: Any, family: Any, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The coda block's gradients written into a copy of the transformers layer: by parameter name."""
    from coda_cutlass.nn.hf.layer import standard_layout
    d = block.dims
    grads = standard_layout({n: p.grad for n, p in block.named_parameters()}, d.q_width, d.kv_width, d.head_dim)
    target = copy.deepcopy(layer)
    family.write_layer(target, grads)
    return {n: p.detach() for n, p in target.named_parameters()}


def legacy_config(cfg: Any, rope_theta: float, rope_scaling: dict | None = None, **extra: Any) -> Any:
    """A transformers-4-style copy of a config: ``rope_theta`` and ``rope_scaling`` attributes, no
    ``rope_parameters`` (transformers 4 kept them so; 5 moved them into rope_parameters)."""
    d = {k: v for k, v in cfg.to_dict().items() if k != "rope_parameters"}
    d.update(rope_theta=rope_theta, rope_scaling=rope_scaling, **extra)
    return Legacy(d)


class Legacy:
    def __init__(self, d: dict[str, Any]):
        self.__dict__.update(d)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def hf_model(model_type: str = "llama", seed: int = 3, **fields: Any) -> torch.nn.Module:
    """A tiny transformers causal LM with large weights (draw)."""
    torch.manual_seed(seed)
    return draw(transformers.AutoModelForCausalLM.from_config(config(model_type, **fields)).float(), seed)


def coda_grads_hf(model: Any) -> dict[str, torch.Tensor]:
    """A from_hf / patch_hf model's gradients under the transformers parameter names."""
    from coda_cutlass.nn.hf.checkpoint import to_hf_keys
    grads = {n: p.grad for n, p in model.coda.named_parameters(remove_duplicate=False)}
    return to_hf_keys(grads, model.coda_family, model.config, model.coda_tied)
