"""What a model family is to coda_cutlass.nn: how to read its config and its decoder layers.

``Family`` is the Llama decoder layer (pre-norm RMSNorm, q/k/v/o projections without biases, RoPE,
causal GQA attention, SwiGLU MLP); a family module subclasses it and overrides only what differs
(``mistral``: the sliding window; ``phi3``: fused qkv and gate_up weights, residual dropout). A
family that is not implemented is refused clearly (``unsupported``).

Weights travel between a transformers layer and a block as a dict in the standard (Hugging Face)
layout: ``q k v o gate up down attn_norm mlp_norm`` (nn.Linear (out, in) weights, norm gains);
``nn.hf.layer`` converts them to the kernels' layout.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..activations import HF_NAMES
from .fields import UnsupportedConfig, check_known, head_dim, require, rope_from_config

STANDARD = ("q", "k", "v", "o", "gate", "up", "down", "attn_norm", "mlp_norm")   # (+ q_bias k_bias v_bias)


def _part(layer: Any, path: str, what: str) -> Any:
    """The submodule at ``path`` of a layer or model; ``what`` names the thing that has it ("llama
    decoder layer", "llama causal LM")."""
    obj = layer
    for name in path.split("."):
        nxt = getattr(obj, name, None)
        if nxt is None:
            raise UnsupportedConfig(f"a {what} has {path}; {type(layer).__name__} has no {path} "
                                    f"({type(obj).__name__} has no {name!r})")
        obj = nxt
    return obj


def _param(obj: Any, path: str, what: str) -> torch.Tensor:
    """The parameter at ``path`` ("self_attn.q_proj.weight") of a layer or model."""
    module, _, attr = path.rpartition(".")
    t = getattr(_part(obj, module, what), attr, None)
    if not isinstance(t, torch.Tensor):
        raise UnsupportedConfig(f"{module} of a {what} has no {attr} tensor")
    return t


class Family:
    """The Llama decoder layer. Subclasses set ``name``, ``model_types`` and override what differs."""
    name = "llama"
    model_types: tuple[str, ...] = ("llama",)
    # config fields this family reads (every other field must be inert: fields.INERT)
    fields: frozenset[str] = frozenset({
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
        "rope_parameters", "rope_theta", "rope_scaling", "attention_bias", "attention_dropout", "mlp_bias",
        "tie_word_embeddings", "pad_token_id", "pruned_heads"})
    # standard weight name -> parameter path in the transformers layer
    paths: dict[str, str] = {
        "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
        "o": "self_attn.o_proj.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
        "down": "mlp.down_proj.weight", "attn_norm": "input_layernorm.weight",
        "mlp_norm": "post_attention_layernorm.weight"}
    # the activations this family's MLP may use (transformers' names), the config field naming it
    activations: tuple[str, ...] = tuple(HF_NAMES)
    activation_field = "hidden_act"
    norm_offset = 0.0            # the RMSNorms scale by (offset + weight)

    # ------------------------------------------------------------------ config
    def check_config(self, config: Any, ignore: Iterable[str] = ()) -> None:
        """Refuse, by field, whatever this family's config sets that the block does not compute."""
        check_known(config, self.name, self.fields, ignore)
        act = self.activation_name(config)
        if act not in self.activations:
            raise UnsupportedConfig(f"config.{self.activation_field}={act!r} is not supported (the MLP is gated: "
                                    f"act(gate) * up); supported: {', '.join(map(repr, self.activations))}")
        require(config, "attention_bias", (False, None), "linear biases on q/k/v/o are not implemented", False)
        require(config, "mlp_bias", (False, None), "linear biases on gate/up/down are not implemented", False)
        if getattr(config, "pruned_heads", None):
            raise UnsupportedConfig(f"config.pruned_heads={config.pruned_heads!r}: pruned heads are not supported")
        dropout = getattr(config, "attention_dropout", 0.0) or 0.0
        if not 0.0 <= float(dropout) < 1.0:
            raise UnsupportedConfig(f"config.attention_dropout={dropout!r} must be in [0, 1)")

    def activation_name(self, config: Any) -> str:
        """transformers' name of the MLP activation this family's layers use."""
        return getattr(config, self.activation_field)

    def check_model_config(self, config: Any) -> None:
        """Model-level fields (the embedding and the LM head) that the coda model does not compute."""

    def layer_type(self, config: Any, layer_idx: int) -> str | None:
        """The layer's attention type (Gemma 2/3, Qwen 2/3 alternate sliding and full layers)."""
        return None

    def sliding_window(self, config: Any, layer_idx: int) -> int | None:
        return None

    def rope(self, config: Any, layer_idx: int) -> Any:
        """The layer's RoPE settings (per layer type where the config nests them)."""
        return rope_from_config(config, self.layer_type(config, layer_idx))

    def block_options(self, config: Any, layer_idx: int = 0) -> dict[str, Any]:
        """The LlamaBlock arguments of layer ``layer_idx``."""
        heads = config.num_attention_heads
        return {"dim": config.hidden_size, "n_heads": heads,
                "n_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
                "ffn_dim": config.intermediate_size, "head_dim": head_dim(config), "eps": float(config.rms_norm_eps),
                "rope": self.rope(config, layer_idx),
                "sliding_window": self.sliding_window(config, layer_idx),
                "attention_dropout": float(getattr(config, "attention_dropout", 0.0) or 0.0),
                "activation": HF_NAMES[self.activation_name(config)],
                "qkv_bias": "q_bias" in self.paths, "qk_norm": "q_norm" in self.paths, "norm_offset": self.norm_offset,
                "sandwich_norms": "post_attn_norm" in self.paths, "attention_scale": self.attention_scale(config),
                "attention_softcap": self.attention_softcap(config)}

    def attention_softcap(self, config: Any) -> float | None:
        """The attention logits' soft-cap (Gemma 2), None for none."""
        return None

    def attention_scale(self, config: Any) -> float | None:
        """The softmax scale (None: head_dim ** -0.5)."""
        return None

    # ------------------------------------------------------------------ layers
    def check_layer(self, layer: Any) -> None:
        """The layer has this family's parameters, and no bias the family does not read."""
        expected = set(self.paths.values())
        for path in expected:
            _param(layer, path, self.layer_what)
            if path.endswith(".weight"):
                module = _part(layer, path.rpartition(".")[0], self.layer_what)
                bias = path[:-len("weight")] + "bias"
                if getattr(module, "bias", None) is not None and bias not in expected:
                    raise UnsupportedConfig(f"{bias} exists: that linear bias is not implemented for {self.name}")

    def to_standard(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The layer's parameters by path (``paths`` values) -> the standard layout."""
        return {name: parts[path] for name, path in self.paths.items()}

    def from_standard(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Inverse of ``to_standard``: parameter path -> tensor."""
        return {path: weights[name] for name, path in self.paths.items()}

    def read_layer(self, layer: Any) -> dict[str, torch.Tensor]:
        """The layer's weights in the standard layout (views of its parameters)."""
        return self.to_standard({path: _param(layer, path, self.layer_what) for path in self.paths.values()})

    def write_layer(self, layer: Any, weights: dict[str, torch.Tensor]) -> None:
        """Copy standard-layout weights into the layer (shapes already checked)."""
        with torch.no_grad():
            for path, t in self.from_standard(weights).items():
                _param(layer, path, self.layer_what).copy_(t)

    @property
    def layer_what(self) -> str:
        return f"{self.name} decoder layer"

    def layer_index(self, layer: Any) -> int:
        return int(getattr(getattr(layer, "self_attn", None), "layer_idx", None) or 0)

    # ------------------------------------------------------------------ whole models
    # parameter paths of a transformers *ForCausalLM model's parts
    embed_path = "model.embed_tokens.weight"
    norm_path = "model.norm.weight"
    lm_head_path = "lm_head.weight"
    layers_path = "model.layers"

    def model_param(self, model: Any, path: str) -> torch.Tensor:
        return _param(model, path, f"{self.name} causal LM")

    def model_part(self, model: Any, path: str) -> Any:
        return _part(model, path, f"{self.name} causal LM")

    def logit_softcap(self, config: Any) -> float | None:
        """The final logits' soft-cap (Gemma 2), None for none."""
        return None

    def embed_scale(self, config: Any) -> float | None:
        """The factor the embedding output is multiplied by (Gemma: sqrt(hidden_size))."""
        return None
