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
from .block import LlamaBlock
from .checks import check_model_args, checked_targets
from .functional import Step, first_norm, lm_head_backward, lm_head_forward
from .tuning import tune_module


class LMHeadLoss(torch.autograd.Function):
    """(x, h, r) of the final norm -> mean cross-entropy over the rows whose target is valid."""

    @staticmethod
    def forward(ctx: Any, x, h, r, w_lm, g, target, step: Step, ignore_index: int, chunk_rows: int):  # type: ignore[override]
        lse, target_logit = lm_head_forward(step, h, r, w_lm, target)
        valid = (target != ignore_index) & (target >= 0) & (target < w_lm.shape[0])
        count = valid.sum().clamp_min(1).to(torch.float32)
        loss = torch.where(valid, lse - target_logit, torch.zeros_like(lse)).sum() / count
        ctx.save_for_backward(x, h, r, w_lm, g, target, lse, valid, count)
        ctx.step, ctx.chunk_rows = step, chunk_rows
        return loss

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor):  # type: ignore[override]
        x, h, r, w_lm, g, target, lse, valid, count = ctx.saved_tensors
        scale = valid.to(torch.float32) * (dloss.to(torch.float32) / count)
        dx, dw, dg = lm_head_backward(ctx.step, x, h, r, w_lm, g, lse, target, scale, ctx.chunk_rows)
        return dx, None, None, dw, dg, None, None, None, None


class LlamaModel(nn.Module):
    """A Llama decoder stack. ``forward(tokens, targets)`` returns the mean cross-entropy (targets
    equal to ``ignore_index`` are skipped, others outside [0, vocab) raise); ``forward(tokens)``
    returns the logits (B, S, vocab)."""

    def __init__(self, vocab_size: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int, *,
                 head_dim: int | None = None, eps: float = 1e-5, rope_theta: float = 500000.0,
                 attention: str = "sdpa", ce_chunk_bytes: int = 1 << 30, device: Any = None, dtype: Any = None):
        super().__init__()
        check_model_args(vocab_size, n_layers, ce_chunk_bytes)
        kw = {"device": device, "dtype": dtype}
        self.embed = nn.Parameter(torch.empty(vocab_size, dim, **kw))
        self.blocks = nn.ModuleList(
            LlamaBlock(dim, n_heads, n_kv_heads, ffn_dim, head_dim=head_dim, eps=eps, rope_theta=rope_theta,
                       attention=attention, **kw) for _ in range(n_layers))
        self.norm = nn.Parameter(torch.ones(dim, **kw))
        self.lm_head = nn.Parameter(torch.empty(vocab_size, dim, **kw))
        self.ce_chunk_bytes = ce_chunk_bytes
        nn.init.normal_(self.embed, std=1.0)
        nn.init.normal_(self.lm_head, std=1.0 / math.sqrt(dim))

    @property
    def dims(self) -> Any:
        return self.blocks[0].dims

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
        if targets is None:
            targets = torch.randint(0, self.embed.shape[0], tokens.shape, device=tokens.device)
        first = self.blocks[0]
        return tune_module(self, first.get_runner(), lambda: self(tokens, targets), None, context=first.context(),
                           M=tokens.numel(), forward_only=forward_only, **options)

    def hidden(self, tokens: torch.Tensor) -> tuple[Step, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The final norm's inputs: (step, x, h = x * g_final, r = rstd(x)), all (B * S, D)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq), got shape {tuple(tokens.shape)}")
        B, S = tokens.shape
        first = self.blocks[0]
        step = first.step(B, S)
        x = nn.functional.embedding(tokens.reshape(-1), self.embed)
        with torch.no_grad():
            h, r = first_norm(step, x.detach(), first.attn_norm)
        for i, block in enumerate(self.blocks):
            g_next = self.blocks[i + 1].attn_norm if i + 1 < len(self.blocks) else self.norm
            x, h, r = block.run(step, x, h, r, g_next)
        return step, x, h, r

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                ignore_index: int = -100) -> torch.Tensor:
        target = None if targets is None else checked_targets(targets, tokens, self.lm_head.shape[0], ignore_index)
        step, x, h, r = self.hidden(tokens)
        if target is None:
            logits = step.runner.gemm("lm_head.logits", E.rowscale, h, self.lm_head, r=r)["D"]
            return logits.view(*tokens.shape, -1)
        chunk = max(1, self.ce_chunk_bytes // (self.lm_head.shape[0] * self.lm_head.element_size()))
        return LMHeadLoss.apply(x, h, r, self.lm_head, self.norm, target, step, ignore_index, chunk)
