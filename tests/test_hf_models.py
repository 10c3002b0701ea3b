"""coda_cutlass.nn.from_hf / patch_hf on whole transformers causal LMs (CPU, fp32, large weights):
loss, logits and every gradient against the transformers model (tied embeddings and the padding
token's embedding included), checkpoints that AutoModelForCausalLM loads back to the same tensors,
load_state_dict of such a checkpoint, and transformers' Trainer."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import coda_cutlass.nn as cnn
from coda_cutlass.errors import ConfigError
from coda_cutlass.nn.hf.fields import UnsupportedConfig
from hf_models import coda_grads_hf, config, draw, hf_model, rel, transformers

TOL = 1e-4


def check_model(hf, model, tokens, labels, **inputs) -> None:
    ref = hf(input_ids=tokens, labels=labels, **inputs)
    out = model(input_ids=tokens, labels=labels, **inputs)
    assert out.logits is None and abs(out.loss.item() - ref.loss.item()) < TOL * ref.loss.item()
    ref.loss.backward()
    out.loss.backward()
    ours = coda_grads_hf(model)
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(ours) == set(hf_grads)
    for name, g in hf_grads.items():
        assert rel(ours[name], g) < TOL, name


@pytest.mark.parametrize("model_type,fields", [
    ("llama", {}), ("llama", {"tie_word_embeddings": True}), ("mistral", {"sliding_window": 5}), ("phi3", {}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}), ("gemma", {}), ("qwen3", {}),
    ("gemma2", {"attn_logit_softcapping": None, "final_logit_softcapping": None, "sliding_window": 5}),
    ("gemma2", {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, "sliding_window": 5}),
    ("gemma3_text", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}),
    # transformers 5's Gemma 3 attention never applies attn_logit_softcapping (Gemma 2's does)
    ("gemma3_text", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6,
                     "attn_logit_softcapping": 3.0}),
    ("gemma", {"hidden_act": "relu", "hidden_activation": "gelu_pytorch_tanh"}),   # transformers 5 reads hidden_act
    ("llama", {"hidden_act": "relu", "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                          "original_max_position_embeddings": 8}})])
def test_loss_and_every_gradient_match_the_transformers_model(model_type, fields):
    hf = hf_model(model_type, pad_token_id=0, **fields)
    model = cnn.from_hf(hf)
    tokens = torch.randint(0, 48, (2, 12))
    tokens[0, 3] = 0                                   # the padding token: its embedding gets no gradient
    labels = tokens.clone()
    labels[1, :4] = -100
    check_model(hf, model, tokens, labels)
    if not model.coda_tied:                           # (tied: the LM head's gradient reaches row 0 too)
        assert model.coda.embed.grad[0].abs().sum() == 0
    with torch.no_grad():
        assert rel(model(input_ids=tokens).logits, hf(input_ids=tokens).logits) < TOL


def test_tied_embeddings_share_one_parameter():
    model = cnn.from_hf(hf_model(tie_word_embeddings=True))
    assert model.coda.lm_head is model.coda.embed and model.coda_tied
    assert len(list(model.parameters())) == 2 + 6 * 2        # embed, norm, 6 per block


@pytest.mark.parametrize("convert", [cnn.from_hf, cnn.patch_hf])
def test_tie_weights_ties_again_what_load_state_dict_assign_untied(convert, tmp_path):
    """load_state_dict(assign=True) (loading into a model made on the meta device) puts the embedding and
    the head in as two tensors, as it does for transformers' models, whose tie_weights() then ties them
    again. coda's tie_weights did nothing: the head trained on its own and save_pretrained, writing the
    tied model's embedding alone, lost it."""
    model = convert(hf_model(tie_word_embeddings=True))
    other = hf_model(tie_word_embeddings=True, seed=7)
    model.load_state_dict(other.state_dict(), assign=True)
    model.tie_weights()
    assert model.coda.lm_head is model.coda.embed and len(list(model.parameters())) == 2 + 6 * 2
    tokens = torch.randint(0, 48, (2, 8))
    with torch.no_grad():
        assert abs(model(input_ids=tokens, labels=tokens).loss - other(input_ids=tokens, labels=tokens).loss) < 1e-4
    untied = cnn.from_hf(hf_model())               # an untied model stays so
    untied.tie_weights()
    assert untied.coda.lm_head is not untied.coda.embed


@pytest.mark.parametrize("model_type", ["llama", "gemma"])
def test_a_head_untied_by_hand_stays_untied_whatever_the_config_says(model_type, tmp_path):
    """The usual recipe unties the head without editing config.tie_word_embeddings: transformers then
    trains a separate head, saves it and loads it back untied. coda ties by parameter identity too."""
    hf = hf_model(model_type, tie_word_embeddings=True)
    embed = hf.model.embed_tokens.weight
    hf.lm_head.weight = torch.nn.Parameter(embed.detach() + 0.1 * torch.randn_like(embed))
    assert hf.config.tie_word_embeddings and hf.lm_head.weight is not embed
    model = cnn.from_hf(hf)
    assert not model.coda_tied and model.coda.lm_head is not model.coda.embed
    tokens = torch.randint(0, 48, (2, 12))
    check_model(hf, model, tokens, tokens)
    for saved in (model, hf):
        saved.save_pretrained(tmp_path / type(saved).__name__)
    ours, theirs = (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / type(m).__name__) for m in (model, hf))
    for back in (ours, theirs):
        assert back.lm_head.weight is not back.model.embed_tokens.weight
    assert set(ours.state_dict()) == set(theirs.state_dict())
    for k, v in model.hf_state_dict().items():
        assert torch.equal(ours.state_dict()[k], v) and torch.equal(theirs.state_dict()[k], v), k
    again = model.to_hf()
    assert again.lm_head.weight is not again.model.embed_tokens.weight
    assert torch.equal(again.lm_head.weight, hf.lm_head.weight) and torch.equal(again.model.embed_tokens.weight, embed)
    patched = cnn.patch_hf(copy.deepcopy(hf))
    assert not patched.coda_tied and torch.equal(patched.coda.lm_head, hf.lm_head.weight)


def test_save_pretrained_round_trips_through_auto_model(tmp_path):
    for fields in ({}, {"tie_word_embeddings": True}):
        hf = hf_model(**fields)
        model = cnn.from_hf(hf)
        with torch.no_grad():
            model.coda.blocks[1].qkv.mul_(1.5)              # trained weights, not the ones it started from
        model.save_pretrained(tmp_path / str(len(fields)))
        back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / str(len(fields)),
                                                                       output_loading_info=True)
        assert type(back) is type(hf) and not info["missing_keys"] and not info["unexpected_keys"]
        want = model.hf_state_dict()
        got = back.state_dict()
        for k, v in want.items():
            assert torch.equal(got[k], v), k
        tokens = torch.randint(0, 48, (1, 8))
        with torch.no_grad():
            assert rel(back(input_ids=tokens).logits, model(input_ids=tokens).logits) < TOL


def test_load_state_dict_takes_a_transformers_state_dict():
    """Trainer resumes a checkpoint (written by save_pretrained) with model.load_state_dict."""
    source = cnn.from_hf(hf_model(seed=5))
    model = cnn.from_hf(hf_model(seed=6))
    model.load_state_dict(source.hf_state_dict(), strict=True)
    for (name, a), b in zip(model.coda.state_dict().items(), source.coda.state_dict().values()):
        assert (a == b) if not isinstance(a, torch.Tensor) else torch.equal(a, b), name
    model.load_state_dict(source.state_dict())               # its own keys still load


def test_patch_hf_runs_coda_in_place(tmp_path):
    hf = hf_model()
    twin = copy.deepcopy(hf)
    same = cnn.patch_hf(hf)
    assert same is hf and isinstance(hf, transformers.LlamaForCausalLM) and hasattr(hf, "coda")
    assert not hasattr(hf, "model") and not hasattr(hf, "lm_head")      # the transformers weights are released
    for name in ("model", "lm_head"):           # named as replaced, not a bare "has no attribute"
        with pytest.raises(AttributeError, match=rf"no attribute '{name}': patch_hf replaced the transformers "
                                                 r"submodules \(model, lm_head\) by model.coda"):
            getattr(hf, name)
    with pytest.raises(AttributeError, match=r"no attribute 'no_such_thing'$"):
        hf.no_such_thing
    tokens = torch.randint(0, 48, (2, 10))
    check_model(twin, hf, tokens, tokens)
    hf.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in hf.hf_state_dict().items())
    with pytest.raises(ValueError, match="already runs coda"):
        cnn.patch_hf(hf)


def test_models_pickle():
    model = cnn.from_hf(hf_model())
    patched = cnn.patch_hf(hf_model())
    tokens = torch.randint(0, 48, (1, 8))
    for m in (model, patched):
        again = pickle.loads(pickle.dumps(m))
        assert type(again) is type(m)
        with torch.no_grad():
            assert torch.equal(again(input_ids=tokens).logits, m(input_ids=tokens).logits)


def test_interface_errors_are_clear():
    model = cnn.from_hf(hf_model())
    tokens = torch.randint(0, 48, (2, 8))
    with pytest.raises(ValueError, match="inputs_embeds"):
        model(input_ids=tokens, inputs_embeds=torch.zeros(2, 8, 64))
    with pytest.raises(ValueError, match="labels .* must have the shape"):
        model(input_ids=tokens, labels=tokens[:, :4])
    with pytest.raises(UnsupportedConfig, match="mixture of experts"):
        cnn.from_hf(transformers.AutoModelForCausalLM.from_config(
            config("mixtral", num_local_experts=2, num_experts_per_tok=1)))


def test_num_items_in_batch_sums_over_the_accumulated_batch():
    hf = hf_model()
    model = cnn.from_hf(hf)
    tokens = torch.randint(0, 48, (2, 8))
    a = model(input_ids=tokens, labels=tokens, num_items_in_batch=torch.tensor(28)).loss
    b = hf(input_ids=tokens, labels=tokens, num_items_in_batch=torch.tensor(28)).loss
    assert abs(a.item() - b.item()) < TOL * b.item()


def _train(model, data, out):
    args = transformers.TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, max_steps=3,
                                          gradient_accumulation_steps=2, learning_rate=1e-3, use_cpu=True,
                                          report_to=[], save_strategy="no", logging_steps=1, seed=0,
                                          dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return trainer


def test_trainer_trains_a_from_hf_model_as_it_trains_the_transformers_model(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 48, (12, 16), generator=g)]
    hf = hf_model(tie_word_embeddings=True)
    model = cnn.from_hf(copy.deepcopy(hf))
    _train(hf, data, tmp_path / "hf")
    trainer = _train(model, data, tmp_path / "coda")
    trained = model.hf_state_dict()
    for name, p in hf.state_dict().items():
        if name in trained:
            assert rel(trained[name], p) < 1e-3, name
    trainer.save_model(str(tmp_path / "saved"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in trained.items())


def test_soft_capped_logits_through_the_recomputing_lm_head():
    hf = hf_model("gemma2", attn_logit_softcapping=None, final_logit_softcapping=3.0)
    model = cnn.from_hf(hf)
    model.coda.fused_lm_head = False
    tokens = torch.randint(0, 48, (2, 10))
    check_model(hf, model, tokens, tokens)


def test_gemma_tied_embedding_gradient_in_bf16_within_twice_eager_error():
    """Issue 21 on the CPU: the bf16 model (the interpreter models the kernels' rounding) against the
    fp32 one, within twice the error of transformers' model run eagerly in bf16 (the GPU test's
    rule). Gemma's embedding is tied and scaled by sqrt(dim), so each token's own logit is large
    (~20 here): the fused LM head's softmax must be of the logits as written (this draw: 4.3x
    eager's error when its log-sum-exp came from the fp32 logits, 1.0x since; eight draws: 2.8-6.7x
    before, 1.0-2.1x since, under a bound of 2.1-2.2x)."""
    torch.manual_seed(0)
    ref32 = transformers.AutoModelForCausalLM.from_config(config("gemma")).float()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():     # embedding std 0.2 (draw's); the rest as in tests/gpu/test_hf_gpu.py
        for name, p in ref32.named_parameters():
            std = 0.2 if "embed" in name else 0.5 / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if p.dim() == 1 else 0.0))
    eager = copy.deepcopy(ref32).to(torch.bfloat16)
    model = cnn.from_hf(copy.deepcopy(eager))
    tokens = torch.randint(0, 48, (2, 32), generator=g)
    for m in (ref32, eager, model):
        m(input_ids=tokens, labels=tokens).loss.backward()
    want, eager_grad = ref32.model.embed_tokens.weight.grad, eager.model.embed_tokens.weight.grad.float()
    ours = model.coda.embed.grad.float()
    e_ours, e_eager = (ours - want).abs().max().item(), (eager_grad - want).abs().max().item()
    assert e_ours <= 2 * e_eager + 1e-3 * want.abs().max().item(), f"{e_ours:.3e} > 2 x eager's {e_eager:.3e}"


def test_from_hf_runs_the_decoder_layers_in_fp8_and_refuses_what_fp8_does_not_cover():
    dims = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 128, "vocab_size": 256}
    torch.manual_seed(0)
    hf = draw(transformers.AutoModelForCausalLM.from_config(config("llama", **dims)).float(), std=0.05)
    hf = hf.to(torch.bfloat16)
    tok = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(1))
    bf16 = cnn.from_hf(hf)(input_ids=tok, labels=tok).loss
    model = cnn.from_hf(hf, fp8="tensorwise")
    assert all(b.fp8 is not None and b.fp8.name == "tensorwise" for b in model.coda.blocks)
    out = model(input_ids=tok, labels=tok)
    out.loss.backward()
    assert abs(out.loss.item() - bf16.item()) < 0.02 * bf16.item()      # FP8 rounding, not another model
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    gemma = draw(transformers.AutoModelForCausalLM.from_config(config("gemma", **dims)).float()).to(torch.bfloat16)
    with pytest.raises(ConfigError, match="activation"):
        cnn.from_hf(gemma, fp8="tensorwise")
    keep = {n: p.clone() for n, p in gemma.named_parameters()}
    with pytest.raises(ConfigError):
        cnn.patch_hf(gemma, fp8="blockwise")                               # refused before any weight moves
    assert all(torch.equal(p, keep[n]) for n, p in gemma.named_parameters())
