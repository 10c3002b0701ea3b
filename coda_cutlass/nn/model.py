"""``LlamaModel``: embedding, N ``LlamaBlock``s, the final RMSNorm and an LM head whose
cross-entropy forward and backward run in GEMM epilogues.

The residual stream's RMSNorm statistics travel from block to block: each block's down-proj
epilogue computes the next block's (or the final norm's) h = x * g and r = rstd(x), so only the
first norm after the embedding needs a kernel of its own (one map kernel, no GEMM). The LM head
never writes the (tokens x vocab) logits in the forward (log-sum-exp and the target logit come out
of its epilogue); the backward recomputes them in row chunks with the softmax gradient in the
epilogue, so dlogits exist for one chunk at a time (``ce_chunk_bytes``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .. import epilogues as E
from . import masks
from ..errors import ConfigError
from .block import LlamaBlock
from .checks import (check_model_args, check_switch, check_token_ids, check_vocab_for_kernels, checked_targets,
                     refuse_double_backward)
from .checkpointing import check_stack
from .embedding import InputEmbedding
from .functional import Step, first_norm, lm_head_backward, lm_head_forward, lm_head_fused, lm_head_programs
from .fp8.recipe import Fp8Recipe, as_recipe
from .fp8.support import begin_fp8_steps, check_block, first_norm_fp8, hands_fp8, make_weight_copies
from .fp8.support import check_compute_dtype as check_compute_dtype_fp8
from .precision import cast, check_compute_dtype, compute_dtype, no_autocast
from .tuning import tune_module


CHUNK_ROW_MULTIPLE = 256     # whole tiles of the vocab GEMMs (their M), none half empty per chunk
# Logits per LM-head chunk: 512 MiB (2048 rows of a 128k vocabulary) kept the step's speed and took
# 0.8 GiB off the peak at Llama-3-8B widths against 1 GiB chunks (H200, twenty-first session;
# 256 MiB cost 1.5-2%: every chunk's weight-gradient GEMM reads and writes the whole dW).
CE_CHUNK_BYTES = 512 << 20


def ce_chunk_rows(chunk_bytes: int, row_bytes: int) -> int:
    """Rows per LM-head chunk: as many as ``chunk_bytes`` of logits hold, rounded down to a multiple of
    256 where at least 256 fit (256 MiB at a 128k vocabulary is 1046 rows, whose last 128-row tile of
    each vocab GEMM would be 17% full)."""
    rows = max(1, chunk_bytes // row_bytes)
    return rows - rows % CHUNK_ROW_MULTIPLE if rows >= CHUNK_ROW_MULTIPLE else rows


# Elements per fp32 temporary when scaling a 16-bit gradient by dloss (256 MiB).
DLOSS_CHUNK = 1 << 26


def _scaled_by_dloss(dloss: torch.Tensor, grads: list[torch.Tensor], runner: Any = None) -> list[torch.Tensor]:
    """grads * dloss in place, each product in fp32 with dloss as given, rounded once to the gradient's
    dtype. ``g.mul_(dloss)`` would round dloss to g's dtype first (a 0-dim operand takes the tensor's
    dtype): 1/3 -> 0.333984 in bf16 (0.2% on every gradient), fp16's loss scale 65536 (GradScaler's
    default) -> inf. 16-bit gradients in the runner's dtype go through its ``scale_by`` map kernel, in
    place (one read and one write: ``Runner.in_place_maps``); others through fp32 chunks, which move
    about five times the bytes (a 128k x 2048 LM-head gradient: ~5 GB a step, ~1% of a 1B model's
    step on the H200, by arithmetic); GradScaler's unscale op, which would do this in one launch, has
    no bf16 kernel on CUDA. No host sync."""
    s = dloss.detach().to(torch.float32).reshape(())
    for g in grads:
        if g.dtype == torch.float32:
            g.mul_(s)
        elif not torch.compiler.is_compiling() and _maps_in_place(g, runner):
            # (a traced backward keeps the torch ops, which Inductor fuses: a map call with out= would
            # run eagerly, behind a graph break)
            x = g.view(-1, g.shape[-1])
            runner.map("lm_head.dloss", E.scale_by, x, out={"D": x}, s=s)
        elif not g.is_contiguous():
            g.copy_(g.float().mul_(s))
        else:
            for c in g.view(-1).split(DLOSS_CHUNK):
                c.copy_(c.float().mul_(s))
    return grads


def _maps_in_place(g: torch.Tensor, runner: Any) -> bool:
    """Whether ``runner``'s map kernels take ``g`` in one pass, in place: kernels (not the interpreter,
    whose whole-tensor fp32 temporaries the chunks bound), g in their dtype, rows of a multiple of 8
    elements, contiguous and 16-byte aligned."""
    return (getattr(runner, "in_place_maps", False) and g.dtype == runner.dtype and g.dim() >= 2
            and g.numel() > 0 and g.shape[-1] % 8 == 0 and g.is_contiguous() and g.data_ptr() % 16 == 0)


def per_layer_recipes(fp8: Any, n_layers: int) -> list[Fp8Recipe | None]:
    """``fp8`` as one recipe per layer: a recipe (name, Fp8Recipe or None) for every layer, or a list /
    tuple with one per layer (a model mixing recipes, bf16 layers included), each checked by name."""
    if isinstance(fp8, (list, tuple)):
        if len(fp8) != n_layers:
            raise ConfigError(f"fp8: one recipe per layer: {n_layers} layers, {len(fp8)} recipes given; pass one "
                              "recipe (name, Fp8Recipe or None) for every layer, or a list with one per layer")
        recipes = []
        for i, r in enumerate(fp8):
            try:
                recipes.append(as_recipe(r))
            except ConfigError as e:       # which entry of a long list is wrong
                raise ConfigError(f"fp8[{i}] (layer {i}): {e}") from None
        return recipes
    return [as_recipe(fp8)] * n_layers


class LMHeadLoss(torch.autograd.Function):
    """(x, h, r) of the final norm -> mean cross-entropy over the rows whose target is valid.

    With ``fused`` and a gradient to compute, the forward also computes the gradients for dloss = 1
    (``lm_head_fused``: the logits are written once per row chunk, never recomputed) and the
    backward only scales them; else the backward recomputes the logits chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, x, h, r, w_lm, g, target, step: Step, ignore_index: int, chunk_rows: int,  # type: ignore[override]
                fused: bool = False, softcap: float | None = None):
        valid = (target != ignore_index) & (target >= 0) & (target < w_lm.shape[0])
        count = valid.sum().clamp_min(1).to(torch.float32)
        ctx.step, ctx.chunk_rows, ctx.softcap = step, chunk_rows, softcap
        ctx.fused = fused and any(ctx.needs_input_grad[:5])
        with no_autocast(x.device):
            if ctx.fused:
                scale = valid.to(torch.float32) / count
                lse, target_logit, dx, dw, dg = lm_head_fused(step, x, h, r, w_lm, g, target, scale, chunk_rows,
                                                              softcap)
                if torch.compiler.is_compiling():
                    # dgamma.to(its own dtype) is dgamma itself: Dynamo cannot carry such an alias from the
                    # traced forward to the backward (torch.compile, TrainingArguments(torch_compile=True))
                    dg = dg.clone()
                ctx.save_for_backward(dx, dw, dg)
            else:
                lse, target_logit = lm_head_forward(step, h, r, w_lm, target, softcap)
                ctx.save_for_backward(x, h, r, w_lm, g, target, lse, valid, count)
        return torch.where(valid, lse - target_logit, torch.zeros_like(lse)).sum() / count

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor):  # type: ignore[override]
        refuse_double_backward("the LM head's loss")
        if ctx.fused:
            if getattr(ctx, "handed_out", False):
                raise RuntimeError("the fused LM head's gradients were handed out by an earlier backward; set "
                                   "model.fused_lm_head = False to run the backward more than once")
            ctx.handed_out = True
            dx, dw, dg = _scaled_by_dloss(dloss, list(ctx.saved_tensors), ctx.step.runner)
            return dx, None, None, dw, dg, None, None, None, None, None, None
        x, h, r, w_lm, g, target, lse, valid, count = ctx.saved_tensors
        scale = valid.to(torch.float32) * (dloss.to(torch.float32) / count)
        with no_autocast(x.device):
            dx, dw, dg = lm_head_backward(ctx.step, x, h, r, w_lm, g, lse, target, scale, ctx.chunk_rows,
                                          ctx.softcap)
        return dx, None, None, dw, dg, None, None, None, None, None, None


class LMHeadLogits(torch.autograd.Function):
    """(x, h, r) of the final norm -> the logits r * (h @ W_lm^T) (soft-capped where set), written by
    the LM head GEMM's epilogue. Differentiable in x (hence the whole stack), W_lm and the final norm's
    gain: a loss built from the logits (label smoothing, distillation, ...) trains every weight, as
    the fused loss does. The backward is plain torch on whatever dlogits the caller's loss gives
    (no epilogue program takes an arbitrary dlogits): the norm's gradient comes from x and r, as
    transformers' RMSNorm would give it."""

    @staticmethod
    def forward(ctx: Any, x, h, r, w_lm, g, step: Step, softcap: float | None):  # type: ignore[override]
        P = lm_head_programs(softcap)
        with no_autocast(x.device):
            logits = step.runner.gemm("lm_head.logits", P.logits, h, w_lm, r=r, **P.extra)["D"]
        ctx.softcap = softcap
        # the capped logits give the cap's derivative, 1 - (logits / cap)^2; uncapped ones are not needed
        ctx.save_for_backward(x, h, r, w_lm, g, logits if softcap is not None else None)
        return logits

    @staticmethod
    def backward(ctx: Any, dlogits: torch.Tensor):  # type: ignore[override]
        x, h, r, w_lm, g, logits = ctx.saved_tensors
        with no_autocast(x.device):
            dl = dlogits.to(w_lm.dtype)
            if ctx.softcap is not None:
                dl = dl * (1 - (logits.to(dl.dtype) / ctx.softcap).square())
            rf, xf = r.float()[:, None], x.float()
            dw = dl.t() @ (h.float() * rf).to(w_lm.dtype) if ctx.needs_input_grad[3] else None
            dn = (dl @ w_lm).float()                    # d(normed x), normed x = x * r * g
            dg = (dn * xf * rf).sum(0).to(g.dtype) if ctx.needs_input_grad[4] else None
            dx = None
            if ctx.needs_input_grad[0]:                 # RMSNorm: r * (u - x r^2 mean(u x)), u = dn * g
                u = dn * g.float()
                dx = (rf * (u - xf * rf.square() * (u * xf).mean(-1, keepdim=True))).to(x.dtype)
        return dx, None, None, dw, dg, None, None


class LlamaModel(nn.Module):
    """A Llama decoder stack. ``forward(tokens, targets)`` returns the mean cross-entropy (targets
    equal to ``ignore_index`` are skipped, others outside [0, vocab) raise; a batch whose targets are
    all ignored gives 0 and zero gradients, where torch's cross_entropy gives nan); ``forward(tokens)``
    returns the logits (B, S, vocab), differentiable like the loss; ``forward(tokens, targets,
    return_logits=True)`` both, (loss, logits), from one pass through the blocks."""

    def __init__(self, vocab_size: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int, *,
                 head_dim: int | None = None, eps: float = 1e-5, rope_theta: float | None = None,
                 attention: str = "sdpa", ce_chunk_bytes: int = CE_CHUNK_BYTES, compute_dtype: torch.dtype | None = None,
                 fp8: Any = None, device: Any = None, dtype: Any = None):
        super().__init__()
        check_model_args(vocab_size, n_layers, ce_chunk_bytes)
        self.compute_dtype = check_compute_dtype(compute_dtype)
        kw = {"device": device, "dtype": dtype}
        self.embed = nn.Parameter(torch.empty(vocab_size, dim, **kw))
        self.input_embedding = InputEmbedding(self)      # the lookup, for hooks (transformers' get_input_embeddings)
        recipes = self._checked_recipes(fp8, n_layers)
        self.blocks = nn.ModuleList(
            LlamaBlock(dim, n_heads, n_kv_heads, ffn_dim, head_dim=head_dim, eps=eps, rope_theta=rope_theta,
                       attention=attention, compute_dtype=compute_dtype, fp8=r, **kw) for r in recipes)
        self.norm = nn.Parameter(torch.ones(dim, **kw))
        self.lm_head = nn.Parameter(torch.empty(vocab_size, dim, **kw))
        self.ce_chunk_bytes = ce_chunk_bytes
        # the LM head's gradients computed in the forward from logits written once per chunk (three
        # vocab GEMMs); False: recomputed in the backward (four GEMMs, no logits chunk in memory)
        self.fused_lm_head = True
        self.padding_idx: int | None = None     # a token whose embedding gets no gradient (nn.Embedding's)
        self.embed_scale: float | None = None   # the embedding output times this (Gemma: sqrt(dim))
        self.norm_offset = 0.0                  # the final norm scales by (offset + weight): 1 for Gemma
        self.logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
        nn.init.normal_(self.embed, std=1.0)
        nn.init.normal_(self.lm_head, std=1.0 / math.sqrt(dim))

    @property
    def dims(self) -> Any:
        return self.blocks[0].dims

    @property
    def fp8(self) -> Fp8Recipe | None | tuple[Fp8Recipe | None, ...]:
        """The blocks' FP8 recipe (nn.fp8): the one they share (None: bf16), or per block, a tuple,
        when they differ. Assigning a recipe sets every block's; a sequence sets one per layer; all
        are checked before any block changes (LlamaBlock.fp8: a block given another recipe starts
        its FP8 state afresh)."""
        recipes = tuple(b.fp8 for b in self.blocks)
        return recipes if len(set(recipes)) > 1 else (recipes[0] if recipes else None)

    @fp8.setter
    def fp8(self, value: Any) -> None:
        recipes = self._checked_recipes(value, len(self.blocks))
        for b, r in zip(self.blocks, recipes):
            check_block(b, r)               # a refused recipe changes no block
        for b, r in zip(self.blocks, recipes):
            b.fp8 = r

    def _checked_recipes(self, fp8: Any, n_layers: int) -> list[Fp8Recipe | None]:
        """One recipe per layer, refused where the model computes in fp16 (its compute_dtype, or fp16
        parameters without one), before any block is made or changed."""
        recipes = per_layer_recipes(fp8, n_layers)
        dtype = self.compute_dtype or self.embed.dtype
        for r in recipes:
            if r is not None and dtype == torch.float16:
                check_compute_dtype_fp8(r, dtype)
        return recipes

    def fp8_stats(self) -> dict[int, dict[str, Any]]:
        """Per FP8 block (by index): each quantised tensor's amax history, scale and format
        ("tensorwise"), or each operand's block scales over the step's micro-batches ("blockwise"
        recipes, once ``track_fp8_stats()`` is on); LlamaBlock.fp8_stats. Host values, so this waits
        for the GPU: call it for logging."""
        return {i: st for i, b in enumerate(self.blocks) if b.fp8 is not None and (st := b.fp8_stats())}

    def track_fp8_stats(self, on: bool = True) -> None:
        """Every FP8 block keeps per-step scale statistics for ``fp8_stats`` (LlamaBlock.track_fp8_stats)."""
        check_switch(on)
        if on and all(b.fp8 is None for b in self.blocks):     # as a bf16 block refuses it: nothing to track
            raise ConfigError("track_fp8_stats: every block of this model runs in 16 bits (fp8=None); there are no "
                              "FP8 operands (set model.fp8 to a recipe first)")
        for b in self.blocks:
            if b.fp8 is not None or not on:      # off reaches the bf16 blocks too (kept for a later recipe)
                b.track_fp8_stats(on)

    def final_gain(self) -> torch.Tensor:
        """The final norm's gain: its weight plus norm_offset."""
        return self.norm if self.norm_offset == 0.0 else self.norm + self.norm_offset

    def call_dtype(self) -> torch.dtype:
        """The dtype this call computes in (nn.precision): compute_dtype, else autocast's for fp32
        parameters, else the parameters'."""
        return compute_dtype(self.embed.dtype, self.embed.device, self.compute_dtype)

    def set_runner(self, runner: Any) -> None:
        """Run every block (and the LM head) through this runner (e.g. a tuned KernelRunner)."""
        for b in self.blocks:
            b.runner = runner

    def tune(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *, forward_only: bool = False,
             **options: Any) -> dict[str, Any]:
        """Tune the kernels of the whole training step (every block and the LM head) inside the step,
        sustained, on these tokens (random targets by default); the plan is stored and used from
        then on. With ``forward_only``, tune the blocks' forward-only sites in the forward without
        autograd (inference, evaluation). Options go to coda_cutlass.nn.tuning.tune_in_sequence."""
        contexts = list(dict.fromkeys(b.context() for b in self.blocks))
        if len(contexts) > 1:       # one sequence, one plan per site name: its sites would be mixed up
            raise ConfigError(f"tune: the model's blocks are of different kinds (FP8 recipes or block variants: "
                              f"{', '.join(contexts)}); tuning times one plan per site name for one kind. Tune a "
                              "model of each kind at these widths (each plan is stored under its context); a mixed "
                              "model then runs each block with its own kind's stored plan")
        if targets is None:
            targets = torch.randint(0, self.embed.shape[0], tokens.shape, device=tokens.device)
        first = self.blocks[0]
        return tune_module(self, first.get_runner(), lambda: self(tokens, targets), None, context=first.context(),
                           M=tokens.numel(), forward_only=forward_only, **options)

    def hidden(self, tokens: torch.Tensor, *, position_ids: torch.Tensor | None = None,
               attention_mask: torch.Tensor | None = None) -> tuple[Step, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The final norm's inputs: (step, x, h = x * g_final, r = rstd(x)), all (B * S, D).
        ``position_ids`` and ``attention_mask`` as transformers takes them (nn.masks)."""
        check_token_ids(tokens, self.embed.shape[0])
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq), got shape {tuple(tokens.shape)}")
        if not len(self.blocks):
            raise ValueError("LlamaModel: the model has no blocks (n_layers=0 and none added)")
        B, S = tokens.shape
        check_stack(self.blocks, LlamaBlock)
        first = self.blocks[0]
        mask = masks.attention_mask(B, S, tokens.device, attention_mask, position_ids)
        step = first.step(B, S, dtype=self.call_dtype(), position_ids=position_ids, mask=mask)
        x = cast(self.input_embedding(tokens).reshape(B * S, self.embed.shape[1]), step.dtype)
        if self.embed_scale is not None:        # in the compute dtype, as transformers' Gemma scales it
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        begin_fp8_steps(self.blocks, x)      # outside no_grad: it folds for training forwards only
        with torch.no_grad(), no_autocast(x.device):
            make_weight_copies(self.blocks)
            norm0 = first_norm if first.fp8 is None else first_norm_fp8
            h, r = norm0(step, x.detach(), cast(first.attn_gain().detach(), step.dtype))
        for i, block in enumerate(self.blocks):
            last = i + 1 == len(self.blocks)
            g_next = self.final_gain() if last else self.blocks[i + 1].attn_gain()
            # an FP8 block quantises the next block's operand in its down-proj epilogue when that block
            # reads it as it is (the same recipe family: hands_fp8); the LM head, a bf16 block and a
            # block of another recipe get it in bf16
            hand_on = not last and hands_fp8(block.fp8, self.blocks[i + 1].fp8)
            x, h, r = block.run(step, x, h, r, g_next, next_fp8=hand_on)
        return step, x, h, r

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *, ignore_index: int = -100,
                position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                return_logits: bool = False) -> Any:
        target = None if targets is None else checked_targets(targets, tokens, self.lm_head.shape[0], ignore_index)
        if len(self.blocks):
            check_vocab_for_kernels(self.lm_head.shape[0], self.blocks[0].get_runner(self.call_dtype()))
        step, x, h, r = self.hidden(tokens, position_ids=position_ids, attention_mask=attention_mask)
        w_lm, g = cast(self.lm_head, step.dtype), cast(self.final_gain(), step.dtype)
        logits = None
        if target is None or return_logits:
            # the vocab named: an empty batch (0 rows) has no -1 to infer
            logits = LMHeadLogits.apply(x, h, r, w_lm, g, step, self.logit_softcap)
            logits = logits.view(*tokens.shape, w_lm.shape[0])
            if target is None:
                return logits
        chunk = ce_chunk_rows(self.ce_chunk_bytes, w_lm.shape[0] * w_lm.element_size())
        loss = LMHeadLoss.apply(x, h, r, w_lm, g, target, step, ignore_index, chunk, self.fused_lm_head,
                                self.logit_softcap)
        return loss if logits is None else (loss, logits)
