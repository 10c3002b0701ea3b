"""The transformers interface of from_hf / patch_hf models beyond the fused loss (CPU, fp32, tiny
configs): gradients through the returned logits, generate(), the embedding's padding row, frozen
parameters, sharded checkpoints, eval-mode logits with the loss, the saved dtype, activation
checkpointing through transformers' switch, torch.compile of the fused LM head, config fields
transformers ignores, and errors that name the problem."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import coda_cutlass.nn as cnn
from coda_cutlass.errors import ConfigError
from coda_cutlass.nn.hf.fields import UnsupportedConfig
from coda_cutlass.nn.model import LMHeadLoss
from hf_models import coda_grads_hf, config, hf_model, rel, transformers

TOL = 1e-4


def train_args(out, **kw) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, learning_rate=1e-2,
                                          use_cpu=True, report_to=[], save_strategy="no", seed=0,
                                          dataloader_num_workers=0, disable_tqdm=True, **kw)


def dataset(n: int = 4, seq: int = 12) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": t, "labels": t} for t in torch.randint(0, 48, (n, seq), generator=g)]


@pytest.mark.parametrize("model_type,fields", [
    ("llama", {}), ("llama", {"tie_word_embeddings": True}), ("gemma", {}),
    ("gemma2", {"attn_logit_softcapping": None, "final_logit_softcapping": 3.0})])
def test_a_loss_of_the_returned_logits_trains_every_parameter_as_transformers(model_type, fields):
    hf = hf_model(model_type, **fields)
    model = cnn.from_hf(hf)
    tokens = torch.randint(0, 48, (2, 12))

    def loss(logits):       # label-smoothed cross-entropy and a logit penalty: any function of the logits
        smooth = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 48), tokens[:, 1:].reshape(-1),
                                                   label_smoothing=0.1)
        return smooth + 1e-2 * logits.square().mean()

    ours, ref = loss(model(input_ids=tokens).logits), loss(hf(input_ids=tokens).logits)
    assert abs(ours.item() - ref.item()) < TOL * ref.item()
    ours.backward()
    ref.backward()
    grads = coda_grads_hf(model)
    for name, p in hf.named_parameters():
        assert grads[name] is not None and rel(grads[name], p.grad) < TOL, name


def test_trainer_with_label_smoothing_trains_the_whole_model(tmp_path):
    """Trainer computes a label-smoothed loss from the logits (no labels reach the model)."""
    model = cnn.from_hf(hf_model())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    transformers.Trainer(model=model, args=train_args(tmp_path, max_steps=1, label_smoothing_factor=0.1),
                         train_dataset=dataset()).train()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("convert", ["patch_hf", "from_hf"])
def test_trainer_label_smoothing_shifts_the_labels_as_for_the_transformers_model(convert, tmp_path):
    """Trainer shifts the labels for its label smoother only for a model whose class name is a
    transformers causal LM (_get_name); a coda model's class was not one, so it was trained and
    evaluated on unshifted labels: each position taught to predict its own token."""
    hf = hf_model()
    losses = []
    for model in (copy.deepcopy(hf), getattr(cnn, convert)(hf)):
        trainer = transformers.Trainer(model=model, args=train_args(tmp_path, max_steps=1, label_smoothing_factor=0.1),
                                       train_dataset=dataset(), eval_dataset=dataset(2))
        losses.append((trainer.train().training_loss, trainer.evaluate()["eval_loss"]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    assert type(model).__name__.startswith("Coda") and repr(model).startswith(type(model).__name__)


@pytest.mark.parametrize("convert", ["patch_hf", "from_hf"])
def test_generate_gives_the_tokens_of_the_transformers_model(convert):
    hf = hf_model(pad_token_id=0, eos_token_id=1, bos_token_id=2).eval()
    ref = copy.deepcopy(hf)
    model = getattr(cnn, convert)(hf)
    assert model.generation_config.use_cache is False
    tokens = torch.randint(3, 48, (2, 10))
    want = ref.generate(tokens, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert torch.equal(model.generate(tokens, max_new_tokens=5, do_sample=False, min_new_tokens=5), want)
    with pytest.raises(ValueError, match="use_cache=False"):     # a KV cache is refused, not swallowed
        model.generate(tokens, max_new_tokens=2, use_cache=True)
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=tokens[:, -1:], cache=transformers.DynamicCache(config=ref.config))


def test_the_padding_row_is_the_embedding_modules_not_the_configs():
    """Recipes set config.pad_token_id = eos after loading: transformers' EOS row stays trainable."""
    hf = hf_model(eos_token_id=2)
    hf.config.pad_token_id = 2
    assert hf.model.embed_tokens.padding_idx is None
    model = cnn.from_hf(hf)
    assert model.coda.padding_idx is None
    tokens = torch.randint(3, 48, (2, 12))
    tokens[:, 5] = 2
    hf(input_ids=tokens, labels=tokens).loss.backward()
    model(input_ids=tokens, labels=tokens).loss.backward()
    want = hf.model.embed_tokens.weight.grad[2]
    assert want.abs().sum() > 0 and rel(model.coda.embed.grad[2], want) < TOL
    assert cnn.from_hf(hf_model(pad_token_id=0)).coda.padding_idx == 0      # a real padding_idx stays


@pytest.mark.parametrize("convert", ["from_hf", "patch_hf"])
def test_frozen_parameters_stay_frozen(convert):
    hf = hf_model()
    hf.model.embed_tokens.weight.requires_grad_(False)
    hf.model.norm.weight.requires_grad_(False)
    for p in hf.model.layers[0].parameters():
        p.requires_grad_(False)
    hf.model.layers[1].mlp.down_proj.weight.requires_grad_(False)
    trainable = sum(p.numel() for p in hf.parameters() if p.requires_grad)
    model = getattr(cnn, convert)(hf)
    assert model.num_parameters(only_trainable=True) == trainable
    c = model.coda
    assert not c.embed.requires_grad and not c.norm.requires_grad and c.lm_head.requires_grad
    assert not any(p.requires_grad for p in c.blocks[0].parameters())
    assert not c.blocks[1].down.requires_grad and c.blocks[1].qkv.requires_grad
    tokens = torch.randint(0, 48, (2, 8))
    model(input_ids=tokens, labels=tokens).loss.backward()
    assert c.embed.grad is None and c.blocks[0].qkv.grad is None and c.blocks[1].qkv.grad is not None


def test_weights_fused_into_one_parameter_must_be_frozen_alike():
    hf = hf_model()
    hf.model.layers[1].self_attn.k_proj.weight.requires_grad_(False)
    keep = {n: p.clone() for n, p in hf.named_parameters()}
    with pytest.raises(UnsupportedConfig, match=r"layer 1: q, k, v become one parameter \(qkv\).*only k is frozen"):
        cnn.patch_hf(hf)
    assert all(torch.equal(p, keep[n]) for n, p in hf.named_parameters())     # refused before any weight moved


@pytest.mark.parametrize("fields", [{}, {"tie_word_embeddings": True}])
def test_a_sharded_checkpoint_loads_shard_by_shard(tmp_path, fields):
    """What Trainer does to resume from a sharded checkpoint (model.safetensors.index.json):
    load_state_dict(shard, strict=False) per shard; shard boundaries fall inside fused layers."""
    source = cnn.from_hf(hf_model(seed=5, **fields))
    source.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    model = cnn.from_hf(hf_model(seed=6, **fields))
    transformers.trainer_utils.load_sharded_checkpoint(model, tmp_path, strict=False)
    for k, v in source.coda.state_dict().items():
        got = model.coda.state_dict()[k]
        assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v, k


def test_a_partial_state_dict_loads_what_it_has_and_strict_names_the_rest():
    source, model = cnn.from_hf(hf_model(seed=5)), cnn.from_hf(hf_model(seed=6))
    state = source.hf_state_dict()
    part = {k: v for k, v in state.items() if k.startswith("model.layers.1.self_attn.") and "v_proj" not in k}
    with pytest.raises(RuntimeError, match="model.layers.1.self_attn.v_proj.weight"):
        copy.deepcopy(model).load_state_dict(part, strict=True)
    before = model.coda.blocks[1].qkv.detach().clone()
    missing, unexpected = model.load_state_dict(part, strict=False)
    assert "model.layers.1.self_attn.v_proj.weight" in missing and not unexpected
    q_k = source.coda.blocks[1].qkv.shape[0] - 2 * 16               # q and k rows from the source, v (2 x 16) kept
    assert torch.equal(model.coda.blocks[1].qkv[:q_k], source.coda.blocks[1].qkv[:q_k])
    assert torch.equal(model.coda.blocks[1].qkv[q_k:], before[q_k:])
    assert torch.equal(model.coda.blocks[1].o, source.coda.blocks[1].o)


def test_keys_the_model_does_not_read_are_unexpected_not_dropped():
    """A transformers state dict with tensors the model has no place for (a biased Llama's biases,
    Qwen3's q/k norms, a stray key) is refused by strict loading and reported by strict=False: a
    first version deleted every key under the prefix, so the biases vanished without a word."""
    model = cnn.from_hf(hf_model())
    biased = hf_model(attention_bias=True, mlp_bias=True).state_dict()
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*model\.layers\.0\.self_attn\.q_proj\.bias"):
        copy.deepcopy(model).load_state_dict(biased)
    qwen3 = {**hf_model().state_dict(), "model.layers.1.self_attn.q_norm.weight": torch.ones(16), "stray": torch.zeros(1)}
    missing, unexpected = model.load_state_dict(qwen3, strict=False)
    assert not missing and sorted(unexpected) == ["model.layers.1.self_attn.q_norm.weight", "stray"]
    tied = cnn.from_hf(hf_model(tie_word_embeddings=True))       # transformers' own state_dict() has lm_head.weight
    assert "lm_head.weight" in hf_model(tie_word_embeddings=True).state_dict()
    assert tied.load_state_dict(hf_model(seed=4, tie_word_embeddings=True).state_dict()) is not None


def test_what_a_transformers_state_dict_lacks_is_named_by_its_transformers_key():
    source, model = hf_model(seed=5), cnn.from_hf(hf_model(seed=6))
    state = source.state_dict()
    state["model.nrom.weight"] = state.pop("model.norm.weight")
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "model\.norm\.weight"'):
        copy.deepcopy(model).load_state_dict(state)
    before = model.coda.blocks[1].o.detach().clone()
    without_layer = {k: v for k, v in source.state_dict().items() if not k.startswith("model.layers.1.")}
    missing, unexpected = model.load_state_dict(without_layer, strict=False)
    assert not unexpected and "model.layers.1.self_attn.o_proj.weight" in missing
    assert not any(k.startswith("coda.") for k in missing)
    assert torch.equal(model.coda.blocks[1].o, before)                # kept, as for a layer given in part
    assert torch.equal(model.coda.embed, source.model.embed_tokens.weight)


def test_a_wrongly_shaped_tensor_is_named_and_loads_nothing_in_its_place():
    source, model = hf_model(seed=5), cnn.from_hf(hf_model(seed=6))
    state = source.state_dict()
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=r"size mismatch for model\.layers\.0\.self_attn\.q_proj\.weight: .*"
                                           r"\(3, 3\).*current model"):
        model.load_state_dict(state, strict=False)


def test_eval_mode_returns_the_logits_with_the_loss(tmp_path):
    hf = hf_model().eval()
    model = cnn.from_hf(hf)
    tokens = torch.randint(0, 48, (2, 12))
    labels = tokens.clone()
    labels[0, :3] = -100
    with torch.no_grad():
        ref, out = hf(input_ids=tokens, labels=labels), model(input_ids=tokens, labels=labels)
    assert rel(out.logits, ref.logits) < TOL and abs(out.loss.item() - ref.loss.item()) < TOL * ref.loss.item()
    model.train()
    assert model(input_ids=tokens, labels=labels).logits is None       # training: the fused LM head

    seen = {}

    def metrics(p):
        seen["shape"] = p.predictions.shape
        return {"acc": float((p.predictions.argmax(-1)[:, :-1] == p.label_ids[:, 1:]).mean())}

    result = transformers.Trainer(model=model, args=train_args(tmp_path, per_device_eval_batch_size=2),
                                  eval_dataset=dataset(), compute_metrics=metrics).evaluate()
    assert seen["shape"] == (4, 12, 48) and "eval_acc" in result


def test_loss_of_no_valid_label_is_nan_as_in_transformers():
    hf = hf_model()
    model = cnn.from_hf(hf)
    tokens = torch.randint(0, 48, (1, 8))
    none = torch.full_like(tokens, -100)
    assert torch.isnan(hf(input_ids=tokens, labels=none).loss)
    for m in (model, model.eval()):
        assert torch.isnan(m(input_ids=tokens, labels=none).loss)
        assert m(input_ids=tokens, labels=none, num_items_in_batch=torch.tensor(4)).loss.item() == 0.0


def test_save_pretrained_records_the_weights_dtype(tmp_path):
    model = cnn.from_hf(hf_model().to(torch.bfloat16))
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path).dtype == torch.bfloat16


def test_transformers_activation_checkpointing_switch_checkpoints_the_coda_blocks(tmp_path):
    hf = hf_model(num_hidden_layers=3)
    plain, model = cnn.from_hf(hf), cnn.from_hf(hf)
    assert not model.is_activation_checkpointing
    with pytest.warns(FutureWarning):
        model.gradient_checkpointing_enable()
    assert model.is_activation_checkpointing and all(b.activation_checkpointing for b in model.coda.blocks)
    tokens = torch.randint(0, 48, (2, 8))
    for m in (plain, model):
        m(input_ids=tokens, labels=tokens).loss.backward()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name
    model.activation_checkpointing_disable()
    assert not model.is_activation_checkpointing
    model.activation_checkpointing_enable(every_n_layers=2)
    assert [b.activation_checkpointing for b in model.coda.blocks] == [True, False, True]
    model.activation_checkpointing_disable()
    transformers.Trainer(model=model, args=train_args(tmp_path, max_steps=1, gradient_checkpointing=True),
                         train_dataset=dataset()).train()
    assert model.is_activation_checkpointing


def test_activation_checkpointing_of_fp8_blocks_through_transformers_switch_is_exact():
    """transformers' switch on a from_hf model with FP8 blocks (refused before) checkpoints them;
    a training step gives the unwrapped model's loss and gradients bit for bit."""
    dims = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 128, "vocab_size": 256, "num_hidden_layers": 2}
    hf = hf_model(**dims).to(torch.bfloat16)
    models = [cnn.from_hf(copy.deepcopy(hf), fp8="tensorwise") for _ in range(2)]
    models[1].gradient_checkpointing_enable()
    assert models[1].is_activation_checkpointing
    tokens = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for m in models:
        out = m(input_ids=tokens, labels=tokens)
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert torch.equal(losses[0], losses[1])
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


def test_fused_lm_head_under_torch_compile_gives_the_eager_gradients():
    """torch.compile traced the fused LM head's forward into a graph whose saved dgamma aliased an
    intermediate (dgamma.to(its own dtype)): the backward failed to trace."""
    torch.manual_seed(0)
    model = cnn.LlamaModel(64, 32, 1, 2, 1, 64)
    tokens = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        step, x, h, r = model.hidden(tokens)
    x = x.clone().requires_grad_()

    def loss(x, w, g):
        return LMHeadLoss.apply(x, h, r, w, g, tokens.reshape(-1), step, -100, 256, True, None)

    inputs = (x, model.lm_head, model.norm)
    eager = torch.autograd.grad(loss(*inputs), inputs)
    compiled = torch.autograd.grad(torch.compile(loss)(*inputs), inputs)
    for a, b in zip(compiled, eager):
        assert rel(a, b) < 1e-6


@pytest.mark.parametrize("model_type", ["phi3", "mistral"])
def test_attention_bias_false_is_accepted_where_transformers_ignores_it(model_type):
    """Phi-3 and Mistral have no linear biases whatever the config says; False (or absent) is inert."""
    for fields in ({"attention_bias": False}, {"attention_bias": False, "mlp_bias": False}):
        hf = hf_model(model_type, **fields)
        model = cnn.from_hf(hf)
        tokens = torch.randint(0, 48, (1, 8))
        with torch.no_grad():
            assert rel(model(input_ids=tokens).logits, hf(input_ids=tokens).logits) < TOL
    with pytest.raises(UnsupportedConfig, match="attention_bias=True"):
        cnn.from_hf(hf_model(model_type, attention_bias=True))


def test_errors_name_what_is_wrong():
    hf = hf_model()
    model = cnn.from_hf(hf)
    for coda in (model, cnn.patch_hf(hf_model())):
        with pytest.raises(ValueError, match="already a coda model"):
            cnn.from_hf(coda)
    with pytest.raises(UnsupportedConfig, match="LlamaModel is a base model .*AutoModelForCausalLM"):
        cnn.from_hf(hf.model)
    with pytest.raises(UnsupportedConfig, match=r"take a causal LM .*LlamaForSequenceClassification has no lm_head"):
        cnn.from_hf(transformers.LlamaForSequenceClassification(hf.config))


@pytest.mark.parametrize("convert", [cnn.from_hf, cnn.patch_hf])
def test_hidden_states_asked_for_in_the_config_are_refused_not_dropped(convert):
    """transformers reads output_hidden_states from the config when the call does not pass it (a model
    loaded or configured for distillation): the coda model returned the logits without them, silently."""
    model = convert(hf_model("llama", output_hidden_states=True))
    tokens = torch.randint(0, 48, (1, 8))
    with pytest.raises(ValueError, match=r"config\.output_hidden_states=True.*not supported by coda models"):
        model(input_ids=tokens)
    assert model(input_ids=tokens, output_hidden_states=False).logits.shape == (1, 8, 48)   # the call's own word
    model.config.output_hidden_states = False
    assert model(input_ids=tokens).hidden_states is None


def test_tuples_and_parameter_counts_as_transformers():
    hf = hf_model()
    model = cnn.from_hf(hf)
    tokens = torch.randint(0, 48, (1, 8))
    loss, logits = model(input_ids=tokens, labels=tokens, return_logits=True, return_dict=False)
    assert loss.dim() == 0 and logits.shape == (1, 8, 48)
    (logits,) = model(input_ids=tokens, return_dict=False)
    for kw in ({}, {"exclude_embeddings": True}, {"only_trainable": True}):
        assert model.num_parameters(**kw) == hf.num_parameters(**kw), kw


def test_logits_to_keep_as_transformers_takes_it():
    """An int keeps the last positions (0: all); a 1-D tensor indexes the positions to keep, as
    transformers' models take it (it raised "Boolean value of Tensor ... is ambiguous")."""
    hf = hf_model().eval()
    model = cnn.from_hf(hf)
    tokens = torch.randint(0, 48, (2, 12))
    with torch.no_grad():
        for keep in (0, 1, 5, torch.tensor([0, 3, 11]), torch.tensor([7])):
            ours, ref = (m(input_ids=tokens, logits_to_keep=keep).logits for m in (model, hf))
            assert ours.shape == ref.shape and rel(ours, ref) < TOL, keep


def test_shift_labels_and_ignore_index_as_transformers():
    """transformers' causal-LM loss takes labels already shifted (``shift_labels``: Trainer's context
    parallelism, padding-free collators) and another ignored label value (``ignore_index``)."""
    from test_hf_models import check_model
    tokens = torch.randint(1, 48, (2, 12))
    tokens[:, 8:] = 0                                               # right padding with id 0, left in the labels
    shifted = torch.nn.functional.pad(tokens, (0, 1), value=-100)[:, 1:].clone()
    shifted[:, :5] = -100                                           # e.g. the prompt masked
    for kw in ({"ignore_index": 0}, {"shift_labels": shifted},
               {"shift_labels": shifted.clamp_min(0), "ignore_index": 0},
               {"shift_labels": shifted, "num_items_in_batch": torch.tensor(20)}):
        hf = hf_model()
        check_model(hf, cnn.from_hf(hf), tokens, tokens, **kw)
    hf = hf_model().eval()
    model = cnn.from_hf(hf)
    with torch.no_grad():
        ref, out = (m(input_ids=tokens, labels=tokens, shift_labels=shifted.clamp_min(0), ignore_index=0)
                    for m in (hf, model))
    assert abs(out.loss.item() - ref.loss.item()) < 1e-4 * ref.loss.item() and rel(out.logits, ref.logits) < 1e-4
    with pytest.raises(ValueError, match="shift_labels .* without labels"):
        model(input_ids=tokens, shift_labels=shifted)
    with pytest.raises(ValueError, match=r"shift_labels \(2, 11\) must have the shape of input_ids \(2, 12\)"):
        model(input_ids=tokens, labels=tokens, shift_labels=shifted[:, 1:])


def test_a_loss_keyword_coda_does_not_honour_is_refused(monkeypatch):
    """Any keyword transformers' causal-LM loss takes is honoured or refused by name, never swallowed."""
    from transformers.loss import loss_utils

    def loss_with_more(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                       z_loss=0.0, **kwargs):
        raise AssertionError("not called")

    monkeypatch.setattr(loss_utils, "ForCausalLMLoss", loss_with_more)
    model = cnn.from_hf(hf_model())
    tokens = torch.randint(0, 48, (2, 8))
    with pytest.raises(ValueError, match="z_loss=.*not supported by coda models"):
        model(input_ids=tokens, labels=tokens, z_loss=1e-4)


def test_from_hf_takes_one_fp8_recipe_per_layer():
    """As LlamaModel(fp8=[...]): a list gives each decoder layer its recipe (it was refused as "fp8 must
    be None, an Fp8Recipe or one of ...")."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=1, num_key_value_heads=1, head_dim=128)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    m = cnn.from_hf(hf, fp8=["tensorwise", None], compute_dtype=torch.bfloat16)
    assert [None if b.fp8 is None else b.fp8.name for b in m.coda.blocks] == ["tensorwise", None]
    tok = torch.randint(0, 256, (1, 128))
    loss = m(input_ids=tok, labels=tok).loss
    loss.backward()
    assert torch.isfinite(loss)
    with pytest.raises(ConfigError, match="2 layers, 3 recipes"):
        cnn.from_hf(hf, fp8=["tensorwise"] * 3)


@pytest.mark.parametrize("how", ["from_hf", "patch_hf"])
def test_the_fp8_recipe_is_read_and_assigned_on_the_hf_model(how):
    """model.fp8 = ... on a from_hf / patch_hf model set a plain attribute before, silently changing
    no block; it is LlamaModel's property now (checked, per layer), with fp8_stats and
    track_fp8_stats beside it."""
    dims = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 128, "vocab_size": 256, "num_hidden_layers": 3}
    hf = hf_model(**dims).to(torch.bfloat16)
    model = cnn.from_hf(hf, fp8=[None, "tensorwise", None]) if how == "from_hf" else \
        cnn.patch_hf(hf, fp8=[None, "tensorwise", None])
    assert [None if r is None else r.name for r in model.fp8] == [None, "tensorwise", None]
    model.fp8 = "blockwise"
    assert [b.fp8.name for b in model.coda.blocks] == ["blockwise"] * 3 and model.fp8.name == "blockwise"
    with pytest.raises(ConfigError, match="one recipe per layer"):
        model.fp8 = [None, "tensorwise"]
    assert model.fp8.name == "blockwise"
    model.track_fp8_stats()
    tokens = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(0))
    model(input_ids=tokens, labels=tokens).loss.backward()
    assert sorted(model.fp8_stats()) == [0, 1, 2]


@pytest.mark.parametrize("how", ["from_hf", "patch_hf"])
def test_generate_on_fp8_blocks_is_refused_up_front_and_to_hf_generates(how):
    """generate() on a model with FP8 blocks ran its first step (128 tokens) and stopped at 129 with
    the blocks' multiple-of-128 CallError; it is refused before any step, naming to_hf(), whose
    transformers model generates (greedy: the bf16 model's tokens)."""
    dims = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 128, "vocab_size": 256, "num_hidden_layers": 2}
    hf = hf_model(**dims).to(torch.bfloat16)
    bf16 = cnn.from_hf(copy.deepcopy(hf))
    model = cnn.from_hf(hf, fp8=[None, "tensorwise"]) if how == "from_hf" else cnn.patch_hf(hf, fp8=[None, "tensorwise"])
    prompt = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match=r"generate\(\): this model's blocks run in FP8 \(tensorwise\).*to_hf"):
        model.generate(prompt, max_new_tokens=2, do_sample=False)
    got = model.to_hf().generate(prompt, max_new_tokens=2, do_sample=False)
    assert torch.equal(got, bf16.generate(prompt, max_new_tokens=2, do_sample=False))
