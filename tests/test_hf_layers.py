"""LlamaBlock.from_hf against real transformers decoder layers (CPU, fp32, large weights): the
output and every parameter gradient, for every RoPE type, both config styles (transformers 5's
rope_parameters, 4's rope_theta / rope_scaling), Mistral's sliding window and Phi-3's fused weights;
every config field or layer part that would change the math is refused by name; state_dict keeps
the RoPE settings; to_hf checks its target before it writes."""

from __future__ import annotations

import pytest
import torch

from coda_cutlass.nn import LlamaBlock
from coda_cutlass.nn.hf.fields import UnsupportedConfig, rope_from_config
from coda_cutlass.nn.hf.registry import family_of
from coda_cutlass.nn.rope import Rope
from hf_models import (block_grads_as_layer, config, decoder_layer, grads_by_name, legacy_config, rotary,
                       run_layer, window_mask)

TOL = 1e-4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def check_layer(cfg, S: int = 8, B: int = 2, mask=None, seed: int = 0, layer_idx: int = 0, **from_hf) -> LlamaBlock:
    """Forward and every gradient of the block against the transformers layer."""
    layer = decoder_layer(cfg, layer_idx)
    block = LlamaBlock.from_hf(layer, **from_hf)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, cfg.hidden_size, generator=g)
    dy = torch.randn(B, S, cfg.hidden_size, generator=g)
    xr, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = run_layer(layer, cfg, xr, mask)
    out = block(xc)
    assert rel(out, ref) < TOL
    ref.backward(dy)
    out.backward(dy)
    assert rel(xc.grad, xr.grad) < TOL
    ours = block_grads_as_layer(block, family_of(cfg), layer)
    for name, gr in grads_by_name(layer).items():
        assert rel(ours[name], gr) < TOL, name
    return block


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
ROPES = {
    "default-5e5": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {**LLAMA3, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.8,
                    "mscale_all_dim": 0.5, "beta_fast": 16.0, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_every_rope_type_matches_the_transformers_layer(name):
    block = check_layer(config(rope_parameters=dict(ROPES[name])), S=12)
    assert block.rope.rope_type == ROPES[name]["rope_type"]


def test_rope_frequencies_equal_transformers_tables():
    for params in ROPES.values():
        cfg = config(rope_parameters=dict(params))
        assert torch.equal(rope_from_config(cfg).inv_freq().float(), rotary(cfg).inv_freq), params


def test_dynamic_rope_past_the_trained_length():
    cfg = config(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                 max_position_embeddings=8)
    block = check_layer(cfg, S=20)                       # 20 > 8: the base grows with the length
    assert not torch.equal(block.column_freq(20), block.column_freq(8))
    check_layer(cfg, S=6)                                # within the trained length: the plain table


@pytest.mark.parametrize("S", [6, 20])
def test_longrope_short_and_long_factors(S):
    half = 8
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(half)],
              "long_factor": [1.0 + 0.7 * i for i in range(half)], "original_max_position_embeddings": 8}
    block = check_layer(config("phi3", rope_parameters=params, max_position_embeddings=32,
                               original_max_position_embeddings=8), S=S)
    assert block.rope.attention_scaling > 1.0           # longrope scales q and k: folded into the softmax scale


def test_transformers_4_config_style_gives_the_same_block():
    """transformers 4 kept rope_theta and rope_scaling as attributes (no rope_parameters)."""
    cfg = config(rope_parameters={**LLAMA3, "rope_theta": 500000.0})
    legacy = legacy_config(cfg, 500000.0, dict(LLAMA3))
    assert not hasattr(legacy, "rope_parameters")
    layer = decoder_layer(cfg)
    a, b = LlamaBlock.from_hf(layer), LlamaBlock.from_hf(layer, legacy)
    assert a.rope == b.rope and torch.equal(a.rope_freq, b.rope_freq)
    plain = legacy_config(cfg, 1000000.0, None)
    assert rope_from_config(plain) == Rope.default(16, 1e6)
    assert rope_from_config(legacy_config(cfg, 1e4, {"type": "linear", "factor": 2.0})).rope_type == "linear"
    with pytest.raises(UnsupportedConfig, match="neither rope_parameters.*nor rope_theta"):
        rope_from_config(legacy_config(cfg, None, None))


def test_llama3_theta_is_read_not_defaulted():
    """transformers 5 keeps rope_theta in rope_parameters: a Llama-3 layer gets 5e5, not 1e4."""
    block = LlamaBlock.from_hf(decoder_layer(config(rope_parameters={"rope_type": "default", "rope_theta": 5e5})))
    assert block.rope == Rope.default(16, 5e5)
    assert torch.allclose(block.inv_freq.double(), Rope.default(16, 5e5).inv_freq())


@pytest.mark.parametrize("act", ["gelu", "quick_gelu", "tanh"])
def test_other_activations_are_refused_by_name(act):
    with pytest.raises(UnsupportedConfig, match=rf"hidden_act='{act}'"):
        LlamaBlock.from_hf(decoder_layer(config(hidden_act=act)))


@pytest.mark.parametrize("act", ["relu", "gelu_pytorch_tanh", "gelu_new"])
def test_gated_activations_match_the_transformers_layer(act):
    block = check_layer(config(hidden_act=act), S=10)
    assert block.mlp.name == {"relu": "relu"}.get(act, "gelu_tanh")


def test_unknown_rope_type_is_refused_by_name():
    cfg = config()
    cfg.rope_parameters = {"rope_type": "spiral", "rope_theta": 1e4}
    with pytest.raises(UnsupportedConfig, match="rope_type 'spiral' is not supported"):
        LlamaBlock.from_hf(decoder_layer(config()), cfg)


def test_unknown_rope_parameter_and_partial_rotary_are_refused():
    cfg = config()
    cfg.rope_parameters = {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "wobble": 3}
    with pytest.raises(UnsupportedConfig, match=r"unknown RoPE parameter\(s\) \['wobble'\]"):
        rope_from_config(cfg)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    with pytest.raises(UnsupportedConfig, match="partial_rotary_factor=0.5"):
        rope_from_config(cfg)


def test_unknown_config_field_is_refused_unless_ignored():
    cfg = config()
    cfg.attn_logit_multiplier = 0.5
    layer = decoder_layer(config())
    with pytest.raises(UnsupportedConfig, match=r"attn_logit_multiplier=0.5.*ignore_fields=\('attn_logit_multiplier',\)"):
        LlamaBlock.from_hf(layer, cfg)
    LlamaBlock.from_hf(layer, cfg, ignore_fields=("attn_logit_multiplier",))


def test_biases_are_refused_by_name():
    with pytest.raises(UnsupportedConfig, match="attention_bias=True"):
        LlamaBlock.from_hf(decoder_layer(config(attention_bias=True)))
    with pytest.raises(UnsupportedConfig, match="mlp_bias=True"):
        LlamaBlock.from_hf(decoder_layer(config(mlp_bias=True)))


@pytest.mark.parametrize("model_type,reason", [
    ("mixtral", "mixture of experts"), ("qwen3_moe", "mixture of experts")])
def test_families_not_implemented_are_refused_clearly(model_type, reason):
    kw = {"num_local_experts": 2, "num_experts_per_tok": 1} if model_type == "mixtral" else {}
    if model_type == "qwen3_moe":
        kw = {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32}
    cfg = config(model_type, **kw)
    with pytest.raises(UnsupportedConfig, match=rf"model_type '{model_type}' is not supported.*{reason}"):
        LlamaBlock.from_hf(decoder_layer(cfg))


def test_mistral_sliding_window_shorter_than_the_sequence():
    cfg = config("mistral", sliding_window=5)
    block = check_layer(cfg, S=12, mask=window_mask(2, 12, 5))
    assert block.attention.window == 5 and "sliding_window=5" in repr(block)
    check_layer(config("mistral", sliding_window=64), S=12)     # a window past the sequence: plain causal


def test_qwen2_biases():
    block = check_layer(config("qwen2"), S=10)
    assert block.qkv_bias is not None


def test_qwen2_sliding_window_layers():
    cfg = config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert [family_of(cfg).sliding_window(cfg, i) for i in range(2)] == [None, 4]


def test_qwen3_per_head_q_k_norms():
    block = check_layer(config("qwen3"), S=10)
    assert block.q_norm is not None and "qk_norm=True" in repr(block)


def test_gemma_offset_norms_and_geglu():
    block = check_layer(config("gemma"), S=10)
    assert block.norm_offset == 1.0 and block.mlp.name == "gelu_tanh"


NO_SOFTCAP = {"attn_logit_softcapping": None, "final_logit_softcapping": None}


@pytest.mark.parametrize("layer_idx", [0, 1])
def test_gemma2_sandwich_norms(layer_idx):
    cfg = config("gemma2", **NO_SOFTCAP, sliding_window=4, query_pre_attn_scalar=24)
    mask = window_mask(2, 10, 4) if layer_idx == 0 else None          # even layers slide
    block = check_layer(cfg, S=10, mask=mask, layer_idx=layer_idx)
    assert block.post_attn_norm is not None and block.attention.window == (4 if layer_idx == 0 else None)


def test_gemma2_soft_capped_attention():
    cfg = config("gemma2", final_logit_softcapping=None, attn_logit_softcapping=5.0, sliding_window=4)
    block = check_layer(cfg, S=10, mask=window_mask(2, 10, 4))
    assert block.attention.softcap == 5.0


@pytest.mark.parametrize("layer_idx", [0, 1])
def test_gemma3_layers(layer_idx):
    cfg = config("gemma3_text", layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                 query_pre_attn_scalar=32)
    mask = window_mask(2, 10, 6) if layer_idx == 0 else None
    block = check_layer(cfg, S=10, mask=mask, layer_idx=layer_idx)
    assert block.q_norm is not None and block.post_attn_norm is not None
    assert block.rope.params["rope_theta"] == (10000.0 if layer_idx == 0 else 1000000.0)


def test_gemma3_ignores_attn_logit_softcapping_as_transformers():
    cfg = config("gemma3_text", layer_types=["full_attention"] * 2, attn_logit_softcapping=3.0)
    assert check_layer(cfg, S=10).attention.softcap is None


YARN_UNTRUNCATED = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16,
                    "truncate": False}


def test_yarn_truncate_is_read_where_transformers_reads_it():
    """transformers' yarn reads truncate from the top level of rope_parameters: a flat dict's
    truncate=False changes the frequencies, a layer type's own (Gemma 3's nested dict) is ignored."""
    flat = check_layer(config(head_dim=64, max_position_embeddings=32, rope_parameters=dict(YARN_UNTRUNCATED)), S=12)
    assert flat.rope.params["truncate"] is False
    nested = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
              "full_attention": dict(YARN_UNTRUNCATED)}
    cfg = config("gemma3_text", head_dim=64, layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                 max_position_embeddings=32, rope_parameters=nested)
    block = check_layer(cfg, S=12, layer_idx=1)
    assert "truncate" not in block.rope.params


def test_gemma_activation_is_hidden_act_as_in_transformers_5():
    block = check_layer(config("gemma", hidden_act="relu", hidden_activation="gelu_pytorch_tanh"), S=10)
    assert block.mlp.name == "relu"


def test_phi3_fused_weights():
    check_layer(config("phi3"), S=10)


def test_phi3_dropouts_are_refused_by_name():
    with pytest.raises(UnsupportedConfig, match="resid_pdrop=0.1"):
        LlamaBlock.from_hf(decoder_layer(config("phi3", resid_pdrop=0.1)))


def test_attention_dropout_matches_transformers_in_training():
    cfg = config(attention_dropout=0.3)
    layer = decoder_layer(cfg).train()
    block = LlamaBlock.from_hf(layer).train()
    x = torch.randn(2, 8, 64)
    pos = torch.arange(8)[None].expand(2, 8)
    emb = rotary(cfg)(x, pos)                       # built before seeding: building draws random numbers
    torch.manual_seed(7)
    ref = layer(x, position_embeddings=emb, attention_mask=None, position_ids=pos)
    torch.manual_seed(7)
    out = block(x)
    assert rel(out, ref) < TOL
    block.eval()
    layer.eval()
    assert rel(block(x), run_layer(layer, cfg, x)) < TOL and rel(block(x), out) > 1e-3


def test_state_dict_keeps_the_rope_settings():
    cfg = config("mistral", rope_parameters={**LLAMA3, "rope_theta": 5e5}, sliding_window=4)
    block = LlamaBlock.from_hf(decoder_layer(cfg))
    fresh = LlamaBlock(64, 4, 2, 96, head_dim=16)                 # default theta, no window
    fresh.load_state_dict(block.state_dict())
    assert fresh.rope == block.rope and fresh.attention.window == 4
    assert torch.equal(fresh.rope_freq, block.rope_freq)
    x = torch.randn(1, 8, 64)
    assert torch.equal(fresh(x), block(x))
    with pytest.raises(ValueError, match="head_dim 16, the block's is 32"):
        LlamaBlock(64, 2, 2, 96).load_state_dict(block.state_dict(), strict=False)


def test_to_hf_round_trips_and_checks_its_target():
    cfg = config(rope_parameters={**LLAMA3, "rope_theta": 5e5})
    layer = decoder_layer(cfg)
    block = LlamaBlock.from_hf(layer)
    other = decoder_layer(cfg, seed=9)
    block.to_hf(other)
    for (name, a), b in zip(layer.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    for bad, match in [(config(rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "rope"),
                       (config(intermediate_size=128), "ffn_dim"),
                       (config("mistral", rope_parameters={**LLAMA3, "rope_theta": 5e5}, sliding_window=4),
                        "sliding_window")]:
        target = decoder_layer(bad, seed=11)
        before = {k: v.clone() for k, v in target.state_dict().items()}
        with pytest.raises(ValueError, match=match):
            block.to_hf(target)
        assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    moe = decoder_layer(config("mixtral", num_local_experts=2, num_experts_per_tok=1))
    with pytest.raises(UnsupportedConfig, match="mixture of experts"):
        block.to_hf(moe)


def test_gemma3_transformers_4_config_style():
    """transformers 4 kept Gemma 3's local base as rope_local_base_freq and the global one as rope_theta."""
    cfg = config("gemma3_text", layer_types=["sliding_attention", "full_attention"])
    legacy = legacy_config(cfg, 1000000.0, None, rope_local_base_freq=10000.0)
    for i in (0, 1):
        layer = decoder_layer(cfg, i)
        assert LlamaBlock.from_hf(layer).rope == LlamaBlock.from_hf(layer, legacy).rope
