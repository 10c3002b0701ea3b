"""Reading a transformers config: the fields a family uses, in the style of transformers 5
(``config.rope_parameters``) and 4 (``config.rope_theta`` and ``config.rope_scaling``), and the
check that every other field is one known not to change the math.

A field that is not known is refused by name (``UnsupportedConfig``): coda cannot tell whether it
changes the result, and a silently wrong model is worse than a refused one. A caller who knows a
field is harmless passes ``ignore_fields``.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Mapping

from ..rope import Rope


class UnsupportedConfig(ValueError):
    """A config field (or layer part) whose effect coda_cutlass.nn does not implement."""


# Fields of any transformers config that do not change a decoder's math (generation settings,
# bookkeeping, token ids other than padding, the attention implementation, initialisation).
INERT: frozenset[str] = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path", "name_or_path", "dtype", "torch_dtype",
    "use_cache", "initializer_range", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "tf_legacy_loss",
    "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "finetuning_task", "task_specific_params",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "cross_attention_hidden_size", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "auto_map", "pretraining_tp",
})


def config_dict(config: Any) -> dict[str, Any]:
    """The config's fields: ``to_dict()`` of a transformers config, else its attributes."""
    to_dict = getattr(config, "to_dict", None)
    d = to_dict() if callable(to_dict) else dict(vars(config))
    return {k: v for k, v in d.items() if not k.startswith("_")}


def check_known(config: Any, family: str, known: Iterable[str], ignore: Iterable[str] = ()) -> None:
    """Refuse a config with a field that is neither read by the family nor known to be inert."""
    names = () if isinstance(ignore, (str, bytes)) else tuple(ignore)
    if isinstance(ignore, (str, bytes)) or not all(isinstance(k, str) for k in names):
        raise TypeError(f"ignore_fields must be a list of config field names, got {ignore!r}")
    fields = config_dict(config)
    absent = [k for k in names if k not in fields]
    if absent:          # a misspelt name ignores nothing: said, not refused (one list may serve several models)
        warnings.warn(f"ignore_fields: the {family} config has no field(s) {', '.join(map(repr, absent))}; "
                      "nothing is ignored for them", stacklevel=5)
    allowed = set(known) | INERT | set(names)
    unknown = {k: v for k, v in fields.items() if k not in allowed}
    if unknown:
        shown = ", ".join(f"{k}={v!r}" for k, v in sorted(unknown.items()))
        raise UnsupportedConfig(
            f"{family} config field(s) {shown} are not known to coda_cutlass.nn, which cannot tell whether they "
            f"change the model's math, so the model is refused; if they do not, pass "
            f"ignore_fields={tuple(sorted(unknown))!r}")


def require(config: Any, name: str, allowed: Iterable[Any], why: str, default: Any = None) -> Any:
    """config.<name> (``default`` when absent), refused by name unless it is one of ``allowed``."""
    value = getattr(config, name, default)
    options = tuple(allowed)
    if value not in options:
        raise UnsupportedConfig(f"config.{name}={value!r} is not supported ({why}); supported: "
                                f"{', '.join(repr(o) for o in options)}")
    return value


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# ---------------------------------------------------------------------------------------------- RoPE
def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE parameters of a config as one flat dict (rope_type, rope_theta, ...), from
    ``rope_parameters`` (transformers 5; nested by layer type for models such as Gemma 3) or from
    ``rope_theta`` and ``rope_scaling`` (transformers 4). A config with neither is refused: the
    theta of a checkpoint is never guessed."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, Mapping) and params:
        nested = all(isinstance(v, Mapping) or v is None for v in params.values())
        if nested:
            if layer_type is None or params.get(layer_type) is None:
                raise UnsupportedConfig(f"config.rope_parameters is given per layer type ({sorted(params)}); "
                                        f"this layer's type {layer_type!r} has none")
            p = dict(params[layer_type])
            # transformers' yarn reads `truncate` from the top level of rope_parameters, never from a
            # layer type's own dict (modeling_rope_utils._compute_yarn_parameters, transformers 5): a
            # layer type's truncate=False is ignored there and the correction range truncated, so coda drops it too
            p.pop("truncate", None)
        else:
            p = dict(params)
    else:
        theta = getattr(config, "rope_theta", None)
        if theta is None:
            raise UnsupportedConfig("the config has neither rope_parameters (transformers 5) nor rope_theta "
                                    "(transformers 4): the RoPE base of the checkpoint is unknown")
        p = dict(getattr(config, "rope_scaling", None) or {})
        p["rope_theta"] = theta
    p["rope_type"] = p.get("rope_type") or p.get("type") or "default"
    p.pop("type", None)
    if p.get("rope_theta") is None:
        raise UnsupportedConfig("config.rope_parameters has no rope_theta: the RoPE base of the checkpoint is unknown")
    # transformers 4 kept partial_rotary_factor and (Phi-3) original_max_position_embeddings beside the
    # scaling dict; transformers 5 moves them in
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):
        if key not in p and getattr(config, key, None) is not None:
            p[key] = getattr(config, key)
    return p


def rope_from_config(config: Any, layer_type: str | None = None) -> Rope:
    """The block's ``Rope`` for a config (every rope type transformers has; the others refused by
    name, as a partial rotary factor other than 1)."""
    p = rope_parameters(config, layer_type)
    rope_type = p["rope_type"]
    partial = float(p.pop("partial_rotary_factor", 1.0) or 1.0)
    if rope_type == "proportional":
        p["partial_rotary_factor"] = partial
    elif partial != 1.0:
        raise UnsupportedConfig(f"partial_rotary_factor={partial} (RoPE on part of each head) is not supported")
    if rope_type in ("dynamic", "yarn", "longrope"):
        p["max_position_embeddings"] = config.max_position_embeddings
    if rope_type in ("llama3", "yarn", "longrope"):
        p.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    else:
        p.pop("original_max_position_embeddings", None)
    if rope_type == "explicit":
        raise UnsupportedConfig("rope_type 'explicit' is coda's own table, not a transformers rope type")
    try:
        return Rope.from_params(head_dim(config), p)
    except ValueError as e:
        raise UnsupportedConfig(f"config RoPE parameters {p}: {e}") from None
