"""A whole transformers causal LM through coda in one call.

    model = coda_cutlass.nn.from_hf(hf_model)     # a new model; hf_model is left as it was
    coda_cutlass.nn.patch_hf(hf_model)            # or in place: the same object now runs coda

Either way the model keeps transformers' interface: ``model(input_ids=, labels=, attention_mask=,
position_ids=)`` returns a ``CausalLMOutputWithPast`` with ``.loss`` (labels shifted inside, as
transformers does; ``num_items_in_batch`` for gradient accumulation) and the logits, differentiable,
unless it trains on labels alone (then the fused LM head writes none). It is a ``PreTrainedModel``,
so transformers' ``Trainer`` takes it (activation checkpointing included); ``generate()`` runs
without a KV cache (``generation_config.use_cache`` is False); ``save_pretrained`` writes a
transformers checkpoint of the original class, which ``AutoModelForCausalLM.from_pretrained`` loads
back to the same tensors, and ``load_state_dict`` takes such a checkpoint's state dict, or one shard
of it (Trainer's resume). The weights live in the kernels' layout inside (``model.coda``, a
``LlamaModel``) and keep their ``requires_grad``; a tied LM head is the embedding parameter.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from ...errors import ConfigError
from ..block import LlamaBlock
from ..model import LlamaModel, per_layer_recipes
from ..sharding import full_value, sharded_like
from .checkpoint import from_hf_keys, hf_model_shapes, layer_paths, looks_like_hf, read_by_model, to_hf_keys
from .family import Family
from .fields import UnsupportedConfig, head_dim
from .layer import kernel_weights, layer_requires_grad
from .registry import family_of


def _transformers() -> Any:
    """transformers, imported on first use: importing it takes seconds, and the rest of
    coda_cutlass.nn does not need it."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("coda_cutlass.nn.from_hf needs the transformers package (pip install transformers)") from e
    return transformers


def build_coda_model(hf_model: Any, *, attention: str = "sdpa", ignore_fields: Iterable[str] = (),
                     compute_dtype: torch.dtype | None = None, free: bool = False, fp8: Any = None
                     ) -> tuple[LlamaModel, Family, bool]:
    """A coda LlamaModel with the weights and settings of a transformers causal LM; (model, family,
    tied). With ``free``, each transformers layer's weights are released once copied (in place).
    ``fp8``: every decoder layer's linears in FP8 with this recipe (nn.fp8), or a list with one recipe
    (or None) per layer; a layer the FP8 block does not cover is refused by name before any weight
    is touched."""
    if isinstance(hf_model, CodaCausalLM):
        raise ValueError(f"this {type(hf_model).__name__} is already a coda model (from_hf or patch_hf made it): use "
                         "it as it is; model.to_hf() gives a transformers model of its weights")
    _check_not_peft(hf_model)
    config = hf_model.config
    family = family_of(config)
    family.check_config(config, ignore_fields)
    family.check_model_config(config)
    _check_causal_lm(hf_model, family)
    family.check_model(hf_model)
    layers = family.model_part(hf_model, family.layers_path)
    if len(layers) != config.num_hidden_layers:
        raise UnsupportedConfig(f"the model has {len(layers)} layers, config.num_hidden_layers is "
                                f"{config.num_hidden_layers}")
    for i, layer in enumerate(layers):
        family.check_layer(layer, f"{family.layers_path}.{i}.")
    trainable = [layer_requires_grad(family.read_layer(layer), i) for i, layer in enumerate(layers)]
    embed = family.model_param(hf_model, family.embed_path)
    lm_head = family.model_param(hf_model, family.lm_head_path)
    # tied is what the model computes, not what the config says: a head untied by hand (a new
    # Parameter, config.tie_word_embeddings left True) is trained, saved and loaded separately by
    # transformers, and so by coda
    tied = lm_head is embed
    device, dtype = embed.device, embed.dtype
    heads = config.num_attention_heads
    model = LlamaModel(config.vocab_size, config.hidden_size, 0, heads, getattr(config, "num_key_value_heads", heads),
                       config.intermediate_size, head_dim=head_dim(config), eps=float(config.rms_norm_eps),
                       attention=attention, compute_dtype=compute_dtype, device="meta", dtype=dtype)
    recipes = per_layer_recipes(fp8, config.num_hidden_layers)    # one recipe for all, or one per layer
    model.blocks = nn.ModuleList(LlamaBlock(**family.block_options(config, i), attention=attention,
                                            compute_dtype=compute_dtype, fp8=recipes[i], device="meta", dtype=dtype)
                                 for i in range(config.num_hidden_layers))
    model.to_empty(device=device)
    # the embedding module's own padding_idx (its row gets no gradient), not config.pad_token_id: recipes
    # set pad_token_id = eos after loading, which leaves transformers' EOS row trainable
    pad = getattr(family.model_part(hf_model, family.embed_path.rpartition(".")[0]), "padding_idx", None)
    model.padding_idx = pad if isinstance(pad, int) and 0 <= pad < config.vocab_size else None
    model.embed_scale = family.embed_scale(config)
    model.logit_softcap = family.logit_softcap(config)
    model.norm_offset = family.norm_offset
    with torch.no_grad():
        model.embed.copy_(embed)
        model.norm.copy_(family.model_param(hf_model, family.norm_path))
        if tied:
            model.lm_head = model.embed
        else:
            model.lm_head.copy_(lm_head)
        hd = head_dim(config)
        for layer, block, flags in zip(layers, model.blocks, trainable):
            params = dict(block.named_parameters())
            for name, t in kernel_weights(family.read_layer(layer), hd).items():
                params[name].copy_(t)
                params[name].requires_grad_(flags[name])
            if free:
                for p in layer.parameters():
                    p.data = torch.empty(0, device=p.device, dtype=p.dtype)
    # frozen parameters stay frozen (a tied head is the embedding: its flag)
    model.embed.requires_grad_(embed.requires_grad)
    model.norm.requires_grad_(family.model_param(hf_model, family.norm_path).requires_grad)
    if not tied:
        model.lm_head.requires_grad_(lm_head.requires_grad)
    return model, family, tied


def _is_peft(obj: Any) -> bool:
    """Whether ``obj`` is a PEFT object (a wrapper or adapter layer of the peft package)."""
    return type(obj).__module__.split(".")[0] == "peft"


def _check_not_peft(hf_model: Any) -> None:
    """A PEFT wrapper (PeftModel, LoraModel) around the transformers model: named, with the way to
    convert what it computes."""
    cls = type(hf_model)
    if _is_peft(hf_model):
        raise UnsupportedConfig(f"{cls.__name__} is a PEFT wrapper ({cls.__module__}.{cls.__qualname__}): from_hf "
                                "and patch_hf take the transformers model with the adapters merged into its weights, "
                                "model = peft_model.merge_and_unload(); adapters on a coda model are not supported "
                                "yet")


def _check_causal_lm(hf_model: Any, family: Family) -> None:
    """A transformers causal LM (a *ForCausalLM: the decoder and an LM head), named as such when it is
    not one (a base model, a classifier), before any part of it is read."""
    def has(path: str) -> bool:
        obj = hf_model
        for name in path.split("."):
            obj = getattr(obj, name, None)
            if obj is None:
                return False
        return True
    what = type(hf_model).__name__
    head = family.lm_head_path.rpartition(".")[0]
    if has(family.layers_path) and has(head):
        return
    if not has(family.layers_path) and has(family.layers_path.rpartition(".")[2]):
        raise UnsupportedConfig(f"{what} is a base model (the decoder without its LM head): from_hf and patch_hf "
                                f"take the causal LM around it, e.g. transformers.AutoModelForCausalLM")
    lacks = " and ".join(p for p in (family.layers_path, head) if not has(p))
    raise UnsupportedConfig(f"from_hf and patch_hf take a causal LM (a *ForCausalLM, with {family.layers_path} and "
                            f"{head}); {what} has no {lacks}")


class CodaCausalLM:
    """transformers' causal-LM interface over ``self.coda`` (a LlamaModel); mixed into
    ``CodaForCausalLM`` and, in place, into the model's own class (``patch_hf``)."""
    coda: LlamaModel
    coda_family: Family
    coda_tied: bool
    coda_hf_class: type

    def _init_coda(self, coda: LlamaModel, family: Family, tied: bool, hf_class: type) -> None:
        self.coda = coda
        self.coda_family, self.coda_tied, self.coda_hf_class = family, tied, hf_class
        self.register_load_state_dict_pre_hook(_hf_state_to_coda)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
                return_logits: bool | None = None, num_items_in_batch: Any = None,
                logits_to_keep: int | torch.Tensor = 0,
                inputs_embeds: Any = None, cache: Any = None, past_key_values: Any = None,
                use_cache: bool | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None, **kwargs: Any) -> Any:
        """As a transformers *ForCausalLM: the loss of next-token prediction when ``labels`` are given
        (labels[:, 1:] predicted from positions :-1, or ``shift_labels`` as given, already shifted;
        ``ignore_index`` ignored; no valid label: nan, as transformers), and the logits,
        differentiable, when no labels are given, with ``return_logits``, or in eval mode (Trainer's
        compute_metrics and predict read them). In training with labels alone the LM head writes no
        logits (the fused loss)."""
        _check_coda_modules(self.coda)
        # loss keywords through **kwargs, as transformers takes them: Trainer reads every forward
        # parameter named like "*label*" as a label column (find_labels)
        shift_labels: torch.Tensor | None = kwargs.pop("shift_labels", None)
        ignore_index: int = kwargs.pop("ignore_index", -100)
        _check_loss_keywords(kwargs)
        if input_ids is None:
            raise ValueError("coda models take input_ids (inputs_embeds is not supported)")
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds is not supported by coda models (token ids only)")
        for name, value in (("cache", cache), ("past_key_values", past_key_values)):
            if value is not None:       # a swallowed cache would make generate() feed one token of context
                raise ValueError(f"{name}: coda models keep no KV cache; generate with use_cache=False (the default "
                                 "of from_hf / patch_hf models: model.generation_config.use_cache), which passes "
                                 "the whole sequence every step")
        for name, value in (("output_attentions", output_attentions), ("output_hidden_states", output_hidden_states)):
            if value:
                raise ValueError(f"{name}=True is not supported by coda models")
            if value is None and getattr(self.config, name, False):    # transformers reads the config then
                raise ValueError(f"config.{name}=True is not supported by coda models (they return neither hidden "
                                 f"states nor attentions); set model.config.{name} = False")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        where = {"position_ids": position_ids, "attention_mask": attention_mask}
        loss = logits = targets = None
        if shift_labels is not None and labels is None:    # transformers would compute no loss: say so, not nan
            raise ValueError("shift_labels given without labels: transformers' causal LMs compute a loss only when "
                             "labels are given; pass labels too (shift_labels are then the targets)")
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
            if shift_labels is not None:            # already shifted (context parallelism, padding-free collators)
                if shift_labels.shape != input_ids.shape:
                    raise ValueError(f"shift_labels {tuple(shift_labels.shape)} must have the shape of input_ids "
                                     f"{tuple(input_ids.shape)}")
                targets = shift_labels.to(input_ids.device)
            else:
                targets = torch.full_like(labels, ignore_index)
                targets[:, :-1] = labels[:, 1:]
        if targets is None:
            logits = self.coda(input_ids, **where)
        elif self.training and not return_logits:   # the fused LM head: no logits written
            loss = self.coda(input_ids, targets, ignore_index=ignore_index, **where)
        else:                                       # eval (Trainer's metrics and predictions) or asked for
            loss, logits = self.coda(input_ids, targets, ignore_index=ignore_index, return_logits=True, **where)
        if loss is not None:
            valid = (targets != ignore_index).sum()
            if num_items_in_batch is not None:      # sum over the whole (accumulated) batch / its token count
                loss = loss * (valid.clamp_min(1) / torch.as_tensor(num_items_in_batch, device=loss.device))
            else:                                   # the mean of no tokens: nan, as transformers' loss
                loss = torch.where(valid > 0, loss, torch.full_like(loss, float("nan")))
        if logits is not None:
            logits = _kept_logits(logits, logits_to_keep)
        from transformers.modeling_outputs import CausalLMOutputWithPast
        out = CausalLMOutputWithPast(loss=loss, logits=logits)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        return out if return_dict else out.to_tuple()

    # ------------------------------------------------------------------ checkpoints
    def hf_state_dict(self, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The weights as a transformers state dict of the original class (standard layout). Under
        FSDP2 the shards are gathered (an all-gather per tensor: every rank calls this, in the same
        order), since the layout conversion permutes rows across the shards."""
        if state_dict is None:
            state = {k: full_value(v) for k, v in self.coda.state_dict().items() if isinstance(v, torch.Tensor)}
        else:                                       # e.g. gathered by Trainer / accelerate: our own keys
            state = {k[len("coda."):] if k.startswith("coda.") else k: full_value(v) for k, v in state_dict.items()
                     if isinstance(v, torch.Tensor)}
        return to_hf_keys(state, self.coda_family, self.config, self.coda_tied)

    def save_pretrained(self, save_directory: Any, state_dict: dict[str, torch.Tensor] | None = None,
                        **kwargs: Any) -> None:
        """Write a transformers checkpoint of the original class (config.json + safetensors) that
        ``AutoModelForCausalLM.from_pretrained`` loads back to the same tensors. A model sharded by
        FSDP2 is saved by calling this on every rank (its shards are gathered; rank 0 writes, unless
        ``is_main_process`` says otherwise), as transformers saves its own sharded models."""
        kwargs.setdefault("is_main_process", not dist.is_initialized() or dist.get_rank() == 0)
        config = copy.deepcopy(self.config)
        config.architectures = [self.coda_hf_class.__name__]
        with torch.device("meta"):      # in the weights' dtype: config.json's "dtype" is read from the shell
            shell = self.coda_hf_class(config).to(self.coda.embed.dtype)
        shell.save_pretrained(save_directory, state_dict=self.hf_state_dict(state_dict), **kwargs)

    def to_hf(self) -> Any:
        """A transformers model of the original class with these weights (a new object, built on
        the weights' device and dtype)."""
        ref = self.coda.embed
        with torch.device(ref.device):
            hf = self.coda_hf_class(copy.deepcopy(self.config)).to(ref.dtype)
        # tied as this model is, whatever config.tie_word_embeddings made of the new one (a head untied by
        # hand must not be loaded into the embedding it would share)
        family = self.coda_family
        head = family.model_part(hf, family.lm_head_path.rpartition(".")[0])
        embed = family.model_param(hf, family.embed_path)
        if self.coda_tied and head.weight is not embed:
            head.weight = embed
        elif not self.coda_tied and head.weight is embed:
            head.weight = nn.Parameter(torch.empty_like(embed), requires_grad=embed.requires_grad)
        missing, unexpected = hf.load_state_dict(self.hf_state_dict(), strict=False)
        tied = {self.coda_family.lm_head_path} if self.coda_tied else set()
        if set(missing) - tied or unexpected:
            raise RuntimeError(f"to_hf: {type(hf).__name__} did not take the weights (missing {sorted(missing)}, "
                               f"unexpected {sorted(unexpected)})")
        return hf.train(self.training)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' generate(), refused up front on FP8 blocks: they take token counts in
        multiples of 128 and generation adds one token a step, so it stopped with a CallError at its
        second step."""
        recipes = sorted({b.fp8.name for b in self.coda.blocks if b.fp8 is not None})
        if recipes:
            raise ConfigError(f"generate(): this model's blocks run in FP8 ({', '.join(recipes)}), which takes token "
                              "counts in multiples of 128, and generation adds one token a step; generate with "
                              "model.to_hf() (a transformers model of these weights, in their dtype) or a copy "
                              "with fp8=None")
        return super().generate(*args, **kwargs)   # type: ignore[misc]

    # ------------------------------------------------------------------ pieces transformers asks for
    def __getattr__(self, name: str) -> Any:
        """A transformers submodule patch_hf replaced (``model.model``, ``model.lm_head``) is named as
        such; it raised AttributeError "object has no attribute 'model'" saying nothing of why."""
        try:
            return super().__getattr__(name)            # type: ignore[misc]
        except AttributeError:
            replaced = self.__dict__.get("coda_replaced", ())
            if name not in replaced:
                raise
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}': patch_hf replaced the "
                             f"transformers submodules ({', '.join(replaced)}) by model.coda, a coda LlamaModel "
                             "(coda.embed, coda.blocks, coda.norm, coda.lm_head); model.to_hf() gives a "
                             "transformers model of these weights")

    def get_input_embeddings(self) -> nn.Module:
        """The embedding lookup (nn.embedding.InputEmbedding: its weight is coda.embed), which the
        forward calls: its forward hooks run (NEFTune, enable_input_require_grads)."""
        _check_coda_modules(self.coda)     # PEFT wraps coda, then asks for this (enable_input_require_grads)
        return self.coda.input_embedding

    def set_input_embeddings(self, value: Any) -> None:
        raise NotImplementedError("coda models keep the embedding as coda.embed (a Parameter): replacing the "
                                  "embedding module is not supported; copy weights into coda.embed, or change the "
                                  "transformers model before from_hf / patch_hf")

    def set_output_embeddings(self, new_embeddings: Any) -> None:
        """Refused as set_input_embeddings is (transformers' own said "object has no attribute 'lm_head'")."""
        raise NotImplementedError("coda models keep the LM head as coda.lm_head (a Parameter; the embedding's when "
                                  "tied): replacing the output embedding module is not supported; copy weights into "
                                  "coda.lm_head, or change the transformers model before from_hf / patch_hf")

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("coda models keep the embedding as coda.embed (a Parameter), not an nn.Embedding: "
                                  "resizing the vocabulary is not supported; call resize_token_embeddings on the "
                                  "transformers model before from_hf / patch_hf")

    def tune(self, tokens: torch.Tensor, **options: Any) -> dict[str, Any]:
        """Tune the kernels inside the training step on these tokens (LlamaModel.tune)."""
        return self.coda.tune(tokens, **options)

    # ------------------------------------------------------------------ FP8 (LlamaModel's)
    @property
    def fp8(self) -> Any:
        """The blocks' FP8 recipe(s), read and assigned as LlamaModel.fp8 (an assignment here set a plain
        attribute before and changed no block)."""
        return self.coda.fp8

    @fp8.setter
    def fp8(self, value: Any) -> None:
        self.coda.fp8 = value

    def fp8_stats(self) -> dict[int, dict[str, Any]]:
        """LlamaModel.fp8_stats: per FP8 block, its scale statistics (host values: for logging)."""
        return self.coda.fp8_stats()

    def track_fp8_stats(self, on: bool = True) -> None:
        """LlamaModel.track_fp8_stats."""
        self.coda.track_fp8_stats(on)

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """As transformers counts them; the embedding is a Parameter here (no nn.Embedding to find)."""
        skip = {id(self.coda.embed)} if exclude_embeddings else set()
        return sum(p.numel() for p in self.parameters()
                   if id(p) not in skip and (p.requires_grad or not only_trainable))

    # ------------------------------------------------------------------ activation checkpointing
    def _activation_checkpointing_enable(self, activation_checkpointing_kwargs: Any = None, every_n_layers: int = 1,
                                         offload: bool = False) -> None:
        """transformers' switch (TrainingArguments(gradient_checkpointing=True), activation_checkpointing_enable,
        gradient_checkpointing_enable) turns on coda's own block checkpointing (nn.checkpointing): every
        ``every_n_layers``-th block recomputes its forward in the backward. torch.utils.checkpoint's
        options do not apply (coda's checkpoint is its own)."""
        if offload:
            raise ValueError("activation checkpointing with offload=True is not supported by coda models (the "
                             "checkpointed blocks keep their inputs on the device)")
        if every_n_layers < 1:
            raise ValueError(f"every_n_layers must be at least 1, got {every_n_layers}")
        blocks = self.coda.blocks
        for i, b in enumerate(blocks):
            b.activation_checkpointing = i % every_n_layers == 0

    def _activation_checkpointing_disable(self) -> None:
        for b in self.coda.blocks:
            b.activation_checkpointing = False

    @property
    def is_activation_checkpointing(self) -> bool:
        return any(b.activation_checkpointing for b in self.coda.blocks)


def _kept_logits(logits: torch.Tensor, keep: int | torch.Tensor) -> torch.Tensor:
    """transformers' ``logits_to_keep``: an int keeps the last ``keep`` positions (0: all), a 1-D
    tensor indexes the positions to keep."""
    if isinstance(keep, torch.Tensor):
        return logits[:, keep.to(logits.device)]
    return logits[:, -keep:] if keep else logits


def _check_coda_modules(coda: Any) -> None:
    """PEFT's target_parameters wraps a coda block (or coda itself, for ``embed``) in a ParamWrapper,
    which the model would fail on deep inside: named here. Other wrappers are coda's to judge
    (LlamaModel refuses a checkpoint_wrapper around a block; DDP around ``coda`` works)."""
    parts = [("coda", coda, "LlamaModel")]
    if isinstance(coda, LlamaModel):
        parts += [(f"coda.blocks.{i}", b, "LlamaBlock") for i, b in enumerate(coda.blocks)]
    for where, module, what in parts:
        if _is_peft(module):
            cls = type(module)
            raise TypeError(f"{where} is a {cls.__module__}.{cls.__qualname__}, not a coda {what}: PEFT adapters "
                            "on a coda model (target_parameters) are not supported yet; apply them to the "
                            "transformers model, merge them (model = peft_model.merge_and_unload()) and convert "
                            "that model")


# the keywords of transformers' causal-LM loss that forward takes by name (logits and vocab_size are
# the model's own to pass)
_LOSS_HONOURED = frozenset({"logits", "labels", "vocab_size", "num_items_in_batch", "ignore_index", "shift_labels"})


def _check_loss_keywords(kwargs: dict[str, Any]) -> None:
    """A keyword transformers' causal-LM loss takes (read from its signature: a newer transformers
    may add some) that coda does not honour is refused, not swallowed by **kwargs."""
    if not kwargs:
        return
    from transformers.loss import loss_utils
    params = inspect.signature(loss_utils.ForCausalLMLoss).parameters
    unknown = [n for n in kwargs if n in params and n not in _LOSS_HONOURED
               and params[n].kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
    if unknown:
        raise ValueError(f"{', '.join(f'{n}={kwargs[n]!r}' for n in unknown)}: this keyword of transformers' causal-LM "
                         "loss is not supported by coda models (the fused loss takes labels or shift_labels, "
                         "ignore_index and num_items_in_batch)")


def _hf_state_to_coda(module: Any, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                      missing_keys: list[str], *args: Any) -> None:
    """load_state_dict of a transformers-format state dict (a checkpoint save_pretrained wrote,
    which Trainer loads back when resuming; or one shard of it, loaded with strict=False): converted
    to the coda keys in place. What it lacks keeps its values and is reported missing under its
    transformers key (a layer given in part: a shard boundary inside it); a key the model does not
    read (a bias, another family's q_norm) stays as it is, for load_state_dict to report unexpected."""
    ours = {k[len(prefix):]: k for k in state_dict if k.startswith(prefix)}
    if not looks_like_hf(ours, module.coda_family) or any(k.startswith("coda.") for k in ours):
        return
    family, blocks = module.coda_family, module.coda.blocks
    error_msgs = args[1]                                     # after unexpected_keys
    shapes = hf_model_shapes(module.coda, family, module.config, module.coda_tied)
    given = {}
    for k, full in ours.items():
        if k in shapes and tuple(state_dict[full].shape) != tuple(shapes[k]):     # as torch words its own check
            error_msgs.append(f"size mismatch for {full}: copying a param with shape {tuple(state_dict[full].shape)} "
                              f"from checkpoint, the shape in current model is {tuple(shapes[k])}.")
        else:
            given[k] = state_dict[full]
    converted = from_hf_keys(given, family, module.config, module.coda_tied,
                             current=lambda i: layer_paths(blocks[i], family))
    missing_keys.extend(prefix + k for k in shapes if k not in ours)
    for k, full in ours.items():
        if k in shapes or read_by_model(k, family):
            del state_dict[full]
    for k, v in module.coda.state_dict().items():           # the settings (RoPE, window) stay as they are
        state_dict[f"{prefix}coda.{k}"] = sharded_like(converted[k], v) if k in converted else v


class _CodaPreTrained(CodaCausalLM):
    """What both coda model classes set on transformers' PreTrainedModel: the weights come from the
    checkpoint (no initialisation) and a tied head is tied by sharing the Parameter."""
    _no_split_modules = ["LlamaBlock"]
    supports_gradient_checkpointing = True      # coda's own, per block (_activation_checkpointing_enable)

    def _init_weights(self, module: nn.Module) -> None:
        pass

    def init_weights(self) -> None:
        pass

    def tie_weights(self, *args: Any, **kwargs: Any) -> None:
        """A tied model's head is its embedding Parameter again, as transformers' tie_weights makes it
        after load_state_dict(assign=True) put the two in as separate tensors (else the head trained on
        its own, and save_pretrained, writing the embedding alone, lost it). An untied model stays so."""
        coda = self.__dict__.get("_modules", {}).get("coda")     # None while transformers' __init__ runs
        if getattr(self, "coda_tied", False) and isinstance(coda, LlamaModel) and coda.lm_head is not coda.embed:
            coda.lm_head = coda.embed

    def _get_name(self) -> str:
        """The transformers class's name: Trainer's label smoother (label_smoothing_factor, in
        training and evaluation) shifts the labels only for a model whose name is a causal LM's of
        transformers' auto mapping; under the coda class's name it smoothed unshifted labels."""
        hf_class = getattr(self, "coda_hf_class", None)
        return type(self).__name__ if hf_class is None else hf_class.__name__

    def __repr__(self) -> str:
        """Module's repr under the coda class's name (_get_name is the transformers class's)."""
        text = super().__repr__()
        return type(self).__name__ + text[len(self._get_name()):]


_CLASSES: dict[str, type] = {}


def coda_class(hf_class: type | None = None) -> type:
    """``CodaForCausalLM`` (a PreTrainedModel; hf_class None), or the in-place class of a
    transformers model class, ``Coda<name>`` (a subclass of it). Made on first use, found again by
    name (so the models pickle)."""
    name = "CodaForCausalLM" if hf_class is None else f"Coda{hf_class.__name__}"
    cls = _CLASSES.get(name)
    if cls is None:
        if hf_class is None:
            t = _transformers()

            def init(self: Any, config: Any, coda: LlamaModel, family: Family, tied: bool, original: type) -> None:
                t.PreTrainedModel.__init__(self, config)
                self._init_coda(coda, family, tied, original)
                self.post_init()

            body = {"config_class": t.PretrainedConfig, "base_model_prefix": "coda", "main_input_name": "input_ids",
                    "_supports_sdpa": True, "_supports_flash_attn": True, "_supports_flex_attn": True,
                    "__init__": init, "__doc__": "A transformers causal LM computed by coda_cutlass.nn (from_hf)."}
            bases: tuple[type, ...] = (_CodaPreTrained, t.PreTrainedModel, t.GenerationMixin)
        else:
            body = {"__doc__": f"{hf_class.__name__} computed by coda_cutlass.nn (patch_hf)."}
            bases = (_CodaPreTrained, hf_class)
        cls = _CLASSES[name] = type(name, bases, {"__module__": __name__, "__qualname__": name, **body})
    return cls


def __getattr__(name: str) -> Any:
    """``CodaForCausalLM`` and the ``Coda<transformers class>`` classes by name (unpickling)."""
    if name == "CodaForCausalLM":
        return coda_class()
    if name.startswith("Coda") and hasattr(_transformers(), name[4:]):
        return coda_class(getattr(_transformers(), name[4:]))
    raise AttributeError(name)


def from_hf(hf_model: Any, *, attention: str = "sdpa", ignore_fields: Iterable[str] = (),
            compute_dtype: torch.dtype | None = None, fp8: Any = None) -> Any:
    """A coda model with the weights of a transformers causal LM (Llama, Mistral, Phi-3); the
    transformers model is left unchanged. Fields that change the math and are not implemented are
    refused by name (``ignore_fields``: fields you know are inert). ``fp8``: a recipe name
    ("tensorwise", "blockwise", "blockwise_g16") or an nn.fp8.Fp8Recipe for the decoder layers' GEMMs,
    or a list with one per layer (None: a bf16 layer); FP8 layers need widths that are multiples of 128
    (docs/FP8.md)."""
    coda, family, tied = build_coda_model(hf_model, attention=attention, ignore_fields=ignore_fields,
                                          compute_dtype=compute_dtype, fp8=fp8)
    model = coda_class()(copy.deepcopy(hf_model.config), coda, family, tied, type(hf_model))
    if getattr(hf_model, "generation_config", None) is not None:      # the checkpoint's generation defaults
        model.generation_config = copy.deepcopy(hf_model.generation_config)
    _generate_without_cache(model)
    model.train(hf_model.training)
    return model


def _generate_without_cache(model: Any) -> None:
    """generate() passes the whole sequence every step (coda keeps no KV cache; forward refuses one)."""
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.use_cache = False


def patch_hf(hf_model: Any, *, attention: str = "sdpa", ignore_fields: Iterable[str] = (),
             compute_dtype: torch.dtype | None = None, fp8: Any = None) -> Any:
    """In place: ``hf_model`` (the same object, still an instance of its class) runs coda from now
    on; its transformers submodules are replaced by ``hf_model.coda``, their memory released."""
    if isinstance(hf_model, CodaCausalLM):
        raise ValueError("this model already runs coda")
    cls = type(hf_model)
    coda, family, tied = build_coda_model(hf_model, attention=attention, ignore_fields=ignore_fields,
                                          compute_dtype=compute_dtype, free=True, fp8=fp8)
    replaced = tuple(name for name, _ in hf_model.named_children())
    for name in replaced:
        delattr(hf_model, name)
    hf_model.__class__ = coda_class(cls)
    hf_model.coda_replaced = replaced
    hf_model._init_coda(coda, family, tied, cls)
    _generate_without_cache(hf_model)
    coda.train(hf_model.training)
    return hf_model
