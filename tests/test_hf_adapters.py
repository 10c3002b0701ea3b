"""What from_hf / patch_hf cannot read is refused by name, never dropped: adapters wrapped around a
projection (the shape of PEFT's LoRA layers, stood in for here: these tests need no peft), a PEFT
wrapper around the whole model, a parameter left on the meta device (disk offload), and a wrapper
put around a coda block after conversion (PEFT ``target_parameters``). Merging the adapters into the
weights first, as the errors say, gives the adapted model's loss."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import coda_cutlass.nn as cnn
from coda_cutlass.nn import LlamaBlock
from coda_cutlass.nn.hf.fields import UnsupportedConfig
from hf_models import config, decoder_layer, hf_model


class LoraLinear(nn.Module):
    """The shape of peft's lora.Linear: the base nn.Linear wrapped, its weight forwarded (what from_hf
    reads), a low-rank A and B beside it that the forward adds."""

    def __init__(self, base: nn.Linear, r: int = 2):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})
        with torch.no_grad():
            self.lora_B["default"].weight.normal_(std=0.3)

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))

    def merged(self) -> nn.Linear:
        """What merge_and_unload makes of it: one nn.Linear of W + B @ A."""
        out = copy.deepcopy(self.base_layer)
        with torch.no_grad():
            out.weight += self.lora_B["default"].weight @ self.lora_A["default"].weight
        return out


class ScaledLinear(nn.Module):
    """A projection with a weight and nothing else, computing something other than x @ W.T."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.weight = base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * nn.functional.linear(x, self.weight)


def with_lora(hf: nn.Module, names: tuple[str, ...] = ("q_proj", "v_proj")) -> nn.Module:
    for layer in hf.model.layers:
        for name in names:
            setattr(layer.self_attn, name, LoraLinear(getattr(layer.self_attn, name)))
    return hf


def merge(hf: nn.Module) -> nn.Module:
    for module in list(hf.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoraLinear):
                setattr(module, name, child.merged())
    return hf


@pytest.mark.parametrize("convert", [cnn.from_hf, cnn.patch_hf])
def test_adapters_around_a_projection_are_refused_by_name(convert):
    hf = with_lora(hf_model())
    keep = {n: p.clone() for n, p in hf.named_parameters()}
    with pytest.raises(UnsupportedConfig, match=r"model\.layers\.0\.self_attn\.q_proj is a .*LoraLinear, not a plain "
                                                r"torch\.nn\.Linear.*lora_A.*merge_and_unload"):
        convert(hf)
    assert not hasattr(hf, "coda") and all(torch.equal(p, keep[n]) for n, p in hf.named_parameters())


def test_a_projection_that_is_no_linear_is_refused_and_so_is_its_block():
    hf = hf_model()
    hf.model.layers[1].mlp.down_proj = ScaledLinear(hf.model.layers[1].mlp.down_proj)
    with pytest.raises(UnsupportedConfig, match=r"model\.layers\.1\.mlp\.down_proj is a .*ScaledLinear, not a plain"):
        cnn.from_hf(hf)
    layer = decoder_layer(config())
    layer.self_attn.o_proj = LoraLinear(layer.self_attn.o_proj)
    with pytest.raises(UnsupportedConfig, match=r"self_attn\.o_proj is a .*LoraLinear"):
        LlamaBlock.from_hf(layer)


def test_a_parameter_coda_would_not_read_is_refused_by_name():
    hf = hf_model()
    hf.model.layers[0].post_attention_layernorm.register_parameter("shift", nn.Parameter(torch.zeros(64)))
    with pytest.raises(UnsupportedConfig, match=r"model\.layers\.0\.post_attention_layernorm\.shift"):
        cnn.from_hf(hf)

    class SavedHead(nn.Module):           # the shape of peft's ModulesToSaveWrapper (modules_to_save=["lm_head"])
        def __init__(self, head: nn.Linear):
            super().__init__()
            self.original_module = head
            self.modules_to_save = nn.ModuleDict({"default": copy.deepcopy(head)})

        @property
        def weight(self) -> torch.Tensor:
            return self.modules_to_save["default"].weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.modules_to_save["default"](x)

    hf = hf_model()
    hf.lm_head = SavedHead(hf.lm_head)
    with pytest.raises(UnsupportedConfig, match=r"lm_head is a .*SavedHead, not a plain torch\.nn\.Linear"):
        cnn.from_hf(hf)


def test_merged_adapters_convert_to_the_adapted_model():
    hf = with_lora(hf_model())
    tokens = torch.randint(0, 48, (2, 12))
    with torch.no_grad():
        want = hf(input_ids=tokens, labels=tokens).loss
        got = cnn.from_hf(merge(hf)).eval()(input_ids=tokens, labels=tokens).loss
    assert abs(got.item() - want.item()) < 1e-4 * want.item()


def test_a_peft_wrapper_is_refused_with_what_to_do():
    hf = hf_model()
    # the shape of peft.PeftModel and of its LoraModel: a module of the peft package around the model
    for name, module in (("PeftModel", "peft.peft_model"), ("LoraModel", "peft.tuners.lora.model")):
        wrapper = type(name, (nn.Module,), {"__module__": module})()
        wrapper.base_model = hf
        wrapper.config = hf.config
        for convert in (cnn.from_hf, cnn.patch_hf):
            with pytest.raises(UnsupportedConfig, match=rf"{name} is a PEFT wrapper.*merge_and_unload\(\)"):
                convert(wrapper)


@pytest.mark.parametrize("path", ["model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight"])
def test_a_parameter_on_the_meta_device_is_refused_by_name(path):
    """What accelerate leaves in place of weights offloaded to disk by a device_map."""
    hf = hf_model()
    module_path, _, attr = path.rpartition(".")
    module = hf.get_submodule(module_path)
    setattr(module, attr, nn.Parameter(torch.empty_like(getattr(module, attr), device="meta")))
    for convert in (cnn.from_hf, cnn.patch_hf):
        with pytest.raises(UnsupportedConfig, match=rf"{path.replace('.', '[.]')} is on the meta device.*load the "
                                                    r"model fully"):
            convert(hf)


def test_a_wrapper_around_a_coda_block_is_refused_by_name():
    """PEFT's target_parameters wraps coda.blocks[i] (a ParamWrapper) or coda itself (for embed)."""
    class ParamWrapper(nn.Module):
        __module__ = "peft.tuners.lora.layer"        # the shape of peft's: it hands no attribute to the block

        def __init__(self, base: nn.Module):
            super().__init__()
            self.base_layer = base

    tokens = torch.randint(0, 48, (1, 8))
    model = cnn.from_hf(hf_model())
    model.coda.blocks[1] = ParamWrapper(model.coda.blocks[1])
    with pytest.raises(TypeError, match=r"coda\.blocks\.1 is a .*ParamWrapper, not a coda LlamaBlock"
                                        r".*merge_and_unload"):
        model(input_ids=tokens, labels=tokens)
    model = cnn.from_hf(hf_model())
    model.coda = ParamWrapper(model.coda)
    with pytest.raises(TypeError, match=r"coda is a .*ParamWrapper, not a coda LlamaModel"):
        model(input_ids=tokens)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    model = cnn.from_hf(hf_model())                       # other wrappers: the coda model's own refusal
    model.coda.blocks[0] = checkpoint_wrapper(model.coda.blocks[0])
    with pytest.raises(TypeError, match=r"blocks\[0\] is a CheckpointWrapper, not a LlamaBlock.*checkpoint_blocks"):
        model(input_ids=tokens)


def test_a_peft_wrapper_around_coda_is_named_where_peft_first_asks_for_the_input_embeddings():
    """peft.get_peft_model(model, LoraConfig(target_parameters=["embed"])) wraps ``coda`` and then calls
    enable_input_require_grads(), i.e. get_input_embeddings(): that raised a bare AttributeError
    ("'ParamWrapper' object has no attribute 'input_embedding'") before the forward could name it."""
    class ParamWrapper(nn.Module):
        __module__ = "peft.tuners.lora.layer"

        def __init__(self, base: nn.Module):
            super().__init__()
            self.base_layer = base

    model = cnn.from_hf(hf_model())
    model.coda = ParamWrapper(model.coda)
    for call in (model.get_input_embeddings, model.enable_input_require_grads):
        with pytest.raises(TypeError, match=r"coda is a .*ParamWrapper, not a coda LlamaModel.*merge_and_unload"):
            call()


def test_hooks_on_a_coda_block_are_refused_not_skipped():
    """The model calls its blocks' run(), not their forward: a forward hook on model.coda.blocks[i] (an
    adapter, a steering vector, an activation probe) was silently never called, the loss that of the
    model without it. Refused by name; the hooks FSDP2 puts on a block (it wraps run) are not."""
    model = cnn.from_hf(hf_model())
    tokens = torch.randint(0, 48, (2, 8))
    adapter = nn.Linear(64, 64, bias=False)
    for register in (lambda b: b.register_forward_hook(lambda m, i, out: out + adapter(out)),
                     lambda b: b.register_forward_pre_hook(lambda m, i: None),
                     lambda b: b.register_full_backward_hook(lambda m, gi, go: None)):
        handle = register(model.coda.blocks[1])
        with pytest.raises(TypeError, match=r"blocks\[1\] has a .*hook, which would never be called"):
            model(input_ids=tokens, labels=tokens)
        handle.remove()
    model(input_ids=tokens, labels=tokens).loss.backward()


def test_resizing_the_vocabulary_says_to_resize_the_transformers_model_first():
    model = cnn.from_hf(hf_model())
    with pytest.raises(NotImplementedError, match=r"resize_token_embeddings on the transformers model before from_hf"):
        model.resize_token_embeddings(64)


def test_neftune_noise_through_the_input_embeddings_trains_as_transformers():
    """Trainer's NEFTune (and enable_input_require_grads, PEFT) hook get_input_embeddings(): the
    module coda's forward calls, so the noise lands where transformers puts it. Same seed, same noise:
    the loss matches transformers' with NEFTune, and differs from the loss without it."""
    from transformers.integrations.neftune import activate_neftune
    hf = hf_model().train()
    model = cnn.from_hf(copy.deepcopy(hf)).train()
    tokens = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(1))
    plain = model(input_ids=tokens, labels=tokens).loss.item()
    for m in (hf, model):
        activate_neftune(m, 50.0)
    losses = []
    for m in (hf, model):
        torch.manual_seed(7)
        losses.append(m(input_ids=tokens, labels=tokens).loss)
    assert abs(losses[1].item() - losses[0].item()) < 1e-4 * losses[0].item()
    assert abs(losses[1].item() - plain) > 1e-3 * plain
    losses[1].backward()
    assert model.coda.embed.grad is not None
    model.eval()                                            # NEFTune is off in eval: the plain loss again
    assert abs(model(input_ids=tokens, labels=tokens).loss.item() - plain) < 1e-5 * plain


def test_the_input_embeddings_are_the_models_embed_and_keep_no_state():
    model = cnn.from_hf(hf_model())
    emb = model.get_input_embeddings()
    assert emb.weight is model.coda.embed and (emb.num_embeddings, emb.embedding_dim) == tuple(model.coda.embed.shape)
    assert not any("input_embedding" in k for k in model.state_dict())
    tokens = torch.randint(0, 48, (2, 5))
    assert torch.equal(emb(tokens), model.coda.embed[tokens])
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert other.get_input_embeddings().weight is other.coda.embed
    model.coda.embed.requires_grad_(False)                  # what PEFT + reentrant checkpointing needs
    model.enable_input_require_grads()
    seen = []
    emb.register_forward_hook(lambda m, i, o: seen.append(o.requires_grad))
    model(input_ids=tokens, labels=tokens)
    assert seen == [True]
    with pytest.raises(NotImplementedError, match="replacing the embedding module is not supported"):
        model.set_input_embeddings(torch.nn.Embedding(48, 32))


@pytest.mark.parametrize("convert", ["from_hf", "patch_hf"])
def test_replacing_the_output_embeddings_is_refused_as_the_input_embeddings(convert):
    """transformers' set_output_embeddings raised "object has no attribute 'lm_head'"."""
    model = getattr(cnn, convert)(hf_model())
    with pytest.raises(NotImplementedError, match="replacing the output embedding module is not supported.*coda.lm_head"):
        model.set_output_embeddings(torch.nn.Linear(32, 48, bias=False))


def test_ignore_fields_must_be_a_list_of_names_and_a_misspelt_name_is_said():
    hf = hf_model()
    with pytest.raises(TypeError, match="ignore_fields must be a list of config field names, got 'mlp_bias'"):
        cnn.from_hf(hf, ignore_fields="mlp_bias")
    with pytest.warns(UserWarning, match="has no field.*'no_such_field'"):
        cnn.from_hf(hf, ignore_fields=["no_such_field"])


def test_a_whole_decoder_given_to_the_block_says_to_give_one_layer():
    hf = hf_model()
    with pytest.raises(ValueError, match=r"is a whole decoder, not one decoder layer.*\.layers\[i\]"):
        LlamaBlock.from_hf(hf.model)
    with pytest.raises(ValueError, match="is it a transformers decoder layer"):
        LlamaBlock.from_hf(torch.nn.Linear(2, 2))
