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
from torch import nn

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


MERGE_ADAPTERS = ("LoRA / PEFT adapters: merge them into the weights first (model = peft_model.merge_and_unload()) "
                  "and convert that model; adapters on a coda model are not supported yet")


def check_linear(module: Any, where: str) -> None:
    """A projection coda reads as ``x @ weight.T (+ bias)`` must compute that: a module wrapped
    around the linear (PEFT's lora.Linear forwards ``.weight`` to its base layer, quantized
    linears) would have its weight read and the rest of what it computes dropped, silently."""
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return
    cls = type(module)
    extra = [n for n, _ in module.named_parameters() if n not in ("weight", "bias")]
    holds = f" (it holds {', '.join(extra[:4])}{', ...' if len(extra) > 4 else ''})" if extra else ""
    raise UnsupportedConfig(f"{where} is a {cls.__module__}.{cls.__qualname__}, not a plain torch.nn.Linear{holds}: "
                            f"coda reads its weight alone and would drop whatever else it computes. {MERGE_ADAPTERS}")


def check_read(params: Iterable[tuple[str, torch.Tensor]], read: Iterable[str], prefix: str = "") -> None:
    """Every parameter (name, tensor) of a model or layer is one coda reads (``read``: names) and
    holds data: a parameter left out (an adapter's, a wrapper's) would be silently dropped, and one
    on the meta device (offloaded to disk by a device_map) cannot be copied."""
    read = set(read)
    unread = []
    for name, p in params:
        if p.is_meta:
            raise UnsupportedConfig(f"{prefix}{name} is on the meta device (no data: offloaded to disk by a "
                                    "device_map, or made on the meta device): load the model fully first "
                                    "(from_pretrained without disk offload, e.g. device_map=None or a device that "
                                    "holds the whole model), then convert it")
        if name not in read:
            unread.append(prefix + name)
    if unread:
        raise UnsupportedConfig(f"coda does not read {', '.join(unread[:4])}{', ...' if len(unread) > 4 else ''}: "
                                f"converting would drop {'it' if len(unread) == 1 else 'them'}. {MERGE_ADAPTERS}")


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
    def check_layer(self, layer: Any, prefix: str = "") -> None:
        """The layer has this family's parameters, each projection a plain nn.Linear, no bias the
        family does not read and no other parameter (``prefix``: the layer's path in the model, for
        the errors)."""
        expected = set(self.paths.values())
        for path in self.paths.values():           # in order: the first projection is the one named
            module_path = path.rpartition(".")[0]
            module = _part(layer, module_path, self.layer_what)
            if module_path.endswith("_proj"):           # the linears (the others are norms)
                check_linear(module, prefix + module_path)
            _param(layer, path, self.layer_what)
            if path.endswith(".weight"):
                bias = path[:-len("weight")] + "bias"
                if getattr(module, "bias", None) is not None and bias not in expected:
                    raise UnsupportedConfig(f"{bias} exists: that linear bias is not implemented for {self.name}")
        check_read(layer.named_parameters(), expected, prefix)

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

    def check_model(self, model: Any) -> None:
        """The causal LM's parameters outside its layers are the embedding, the final norm and the
        LM head (a plain nn.Linear), all with data (``check_layer`` checks the layers)."""
        head = self.lm_head_path.rpartition(".")[0]
        check_linear(self.model_part(model, head), head)
        layers = self.layers_path + "."
        check_read(((n, p) for n, p in model.named_parameters() if not n.startswith(layers)),
                   (self.embed_path, self.norm_path, self.lm_head_path))

    def logit_softcap(self, config: Any) -> float | None:
        """The final logits' soft-cap (Gemma 2), None for none."""
        return None

    def embed_scale(self, config: Any) -> float | None:
        """The factor the embedding output is multiplied by (Gemma: sqrt(hidden_size))."""
        return None
