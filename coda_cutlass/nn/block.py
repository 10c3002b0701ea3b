"""``LlamaBlock``: a Llama decoder layer whose every non-attention op runs in a GEMM epilogue or a
map kernel, forward and backward (a ``torch.autograd.Function``).

    block = cc.nn.LlamaBlock.from_hf(hf_layer)          # or LlamaBlock(dim, heads, kv_heads, ffn)
    y = block(x)                                         # x: (B, S, D) bf16 / fp16 on a Hopper GPU
    y.sum().backward()

On a machine without a Hopper GPU (or with fp32 tensors) the same module runs the same programs
through the reference interpreter, so CPU tests check its math against a plain torch block.
Weights are kept in the kernels' layout (RoPE pairs adjacent in W_qkv, gate/up rows interleaved);
``from_hf`` / ``to_hf`` convert.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..partials import cached_tensor
from .attention import Attention
from .checks import check_block_args, check_kernel_runner, check_stream, checked_inv_freq
from .functional import BlockDims, BlockWeights, Step, block_backward, block_forward, first_norm
from .hf import block_from_hf, block_to_hf
from .runner import KernelRunner, Runner, default_runner
from .saved import flatten, unflatten
from .tuning import tune_module


def column_frequencies(inv_freq: torch.Tensor, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """RoPE frequency of every column of the fused (pair-adjacent) QKV output: each pair's frequency
    on both of its columns, for the q and k heads; 0 on v (not rotated)."""
    head = inv_freq.to(torch.float32).repeat_interleave(2)
    return torch.cat((head.repeat(n_heads + n_kv_heads), torch.zeros(n_kv_heads * head.numel())))


def positions(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """The position of every token of (batch, seq), fp32, cached."""
    return cached_tensor(("positions", batch, seq, device),
                         lambda: torch.arange(seq, dtype=torch.float32, device=device).repeat(batch))


class BlockFunction(torch.autograd.Function):
    """(x, h, r) -> (x2[, h2, r2]) for one block; the weights' gradients come from the epilogues.
    What the backward needs goes through ``save_for_backward``: autograd frees it after the backward
    (unless ``retain_graph``, which then works), checks it for in-place changes, and applies
    saved-tensor hooks (``torch.autograd.graph.save_on_cpu``)."""

    @staticmethod
    def forward(ctx: Any, x, h, r, w_qkv, w_o, w_gu, w_down, g_attn, g_mlp, g_next, step: Step):  # type: ignore[override]
        w = BlockWeights(w_qkv, w_o, w_gu, w_down, g_attn, g_mlp)
        x2, h2, r2, saved = block_forward(step, x, h, r, w, g_next)
        tensors: list[Any] = []
        ctx.layout = flatten(saved, tensors)
        ctx.save_for_backward(*tensors, w_qkv, w_o, w_gu, w_down, g_attn, g_mlp)
        ctx.step = step
        if h2 is None:
            return x2
        ctx.mark_non_differentiable(h2, r2)
        return x2, h2, r2

    @staticmethod
    def backward(ctx: Any, dx2: torch.Tensor, *unused: Any):  # type: ignore[override]
        *tensors, w_qkv, w_o, w_gu, w_down, g_attn, g_mlp = ctx.saved_tensors
        saved = unflatten(ctx.layout, iter(tensors))
        w = BlockWeights(w_qkv, w_o, w_gu, w_down, g_attn, g_mlp)
        dx, g = block_backward(ctx.step, saved, w, dx2.contiguous())
        return dx, None, None, g.qkv, g.o, g.gate_up, g.down, g.attn_norm, g.mlp_norm, None, None


class LlamaBlock(nn.Module):
    """A Llama decoder layer (pre-norm RMSNorm -> QKV + RoPE -> causal GQA attention -> out-proj +
    residual -> RMSNorm -> gate/up + SwiGLU -> down + residual) in the kernels' weight layout."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int, *, head_dim: int | None = None,
                 eps: float = 1e-5, rope_theta: float = 500000.0, inv_freq: torch.Tensor | None = None,
                 attention: str = "sdpa", device: Any = None, dtype: Any = None):
        super().__init__()
        head_dim, eps = check_block_args(dim, n_heads, n_kv_heads, head_dim, ffn_dim, eps)
        inv_freq = checked_inv_freq(head_dim, rope_theta, inv_freq)
        self.dims = BlockDims(dim, n_heads, n_kv_heads, head_dim, ffn_dim, eps)
        kw = {"device": device, "dtype": dtype}
        d = self.dims
        self.attn_norm = nn.Parameter(torch.ones(dim, **kw))
        self.qkv = nn.Parameter(torch.empty(d.qkv_width, dim, **kw))
        self.o = nn.Parameter(torch.empty(dim, d.q_width, **kw))
        self.mlp_norm = nn.Parameter(torch.ones(dim, **kw))
        self.gate_up = nn.Parameter(torch.empty(2 * ffn_dim, dim, **kw))
        self.down = nn.Parameter(torch.empty(dim, ffn_dim, **kw))
        self._inv_freq64 = inv_freq.double().cpu()
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)     # per RoPE pair, fp32
        self.register_buffer("rope_freq", torch.empty(0), persistent=False)    # per QKV column, fp32
        self._set_rope_buffers(torch.device(device) if device is not None else torch.device("cpu"))
        self.attention = Attention(attention)
        self.runner: Runner | None = None     # a runner set here replaces the default (get_runner)
        self._default: tuple[tuple[torch.device, torch.dtype], Runner] | None = None
        self.reset_parameters()

    def _set_rope_buffers(self, device: torch.device) -> None:
        d = self.dims
        self.inv_freq = self._inv_freq64.to(device, torch.float32)
        self.rope_freq = column_frequencies(self._inv_freq64, d.n_heads, d.n_kv_heads).to(device)

    def _apply(self, fn: Any, recurse: bool = True) -> "LlamaBlock":
        # module.to(dtype) would round the RoPE frequencies to bf16: keep them fp32, from the fp64 source
        super()._apply(fn, recurse)
        self._set_rope_buffers(self.qkv.device)
        return self

    def reset_parameters(self) -> None:
        for w in (self.qkv, self.o, self.gate_up, self.down):
            nn.init.normal_(w, std=1.0 / math.sqrt(w.shape[1]))
        nn.init.ones_(self.attn_norm)
        nn.init.ones_(self.mlp_norm)

    def extra_repr(self) -> str:
        d = self.dims
        return (f"dim={d.dim}, heads={d.n_heads}, kv_heads={d.n_kv_heads}, head_dim={d.head_dim}, "
                f"ffn={d.ffn_dim}, eps={d.eps}, attention={self.attention.backend}")

    # ------------------------------------------------------------------ running
    def __getstate__(self) -> dict[str, Any]:
        # The default runner is a cache (compiled kernels hold ctypes handles): made again on first
        # use, so copies, pickles and torch.save work after GPU use. A runner set on the block is
        # kept (runners drop their own caches when pickled).
        state = super().__getstate__()
        state["_default"] = None
        return state

    def get_runner(self) -> Runner:
        """``block.runner`` when set, else the default for the weights' device and dtype (kernels
        on a Hopper GPU in bf16 / fp16, the reference interpreter elsewhere), made again whenever the
        module has moved (``.to()``, ``.cuda()``, ``.half()``)."""
        if self.runner is not None:
            return self.runner
        key = (self.qkv.device, self.qkv.dtype)
        if self._default is None or self._default[0] != key:
            self._default = (key, default_runner(*key))
        return self._default[1]

    def context(self) -> str:
        """The model widths that decide kernel shapes (the key of in-sequence tuning plans)."""
        d = self.dims
        return f"llama:d{d.dim}:h{d.n_heads}/{d.n_kv_heads}:hd{d.head_dim}:f{d.ffn_dim}"

    def step(self, batch: int, seq: int, runner: Runner | None = None) -> Step:
        runner = runner or self.get_runner()
        if isinstance(runner, KernelRunner):
            check_kernel_runner(runner, self.qkv)
            runner.prepare(self.context(), batch * seq)
        return Step(self.dims, runner, self.attention, batch, seq, positions(batch, seq, self.qkv.device),
                    self.rope_freq)

    def weights(self) -> tuple[torch.Tensor, ...]:
        return (self.qkv, self.o, self.gate_up, self.down, self.attn_norm, self.mlp_norm)

    def run(self, step: Step, x: torch.Tensor, h: torch.Tensor, r: torch.Tensor,
            g_next: torch.Tensor | None) -> Any:
        """The block on an (M, D) stream with its normed copy h and rstd r (as a stack calls it).
        Without autograd (no_grad, or nothing requires a gradient) it runs the forward alone, which
        saves nothing and writes less (``block_forward(train=False)``)."""
        weights = self.weights()
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *weights)):
            return BlockFunction.apply(x, h, r, *weights, g_next, step)
        x2, h2, r2, _ = block_forward(step, x, h, r, BlockWeights(*weights), g_next, train=False)
        return x2 if h2 is None else (x2, h2, r2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, S, D) -> (B, S, D)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.dims.dim:
            raise ValueError(f"LlamaBlock expects (batch, seq, {self.dims.dim}) input, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        check_stream(x, self.qkv)
        B, S, D = x.shape
        step = self.step(B, S)
        x2d = x.reshape(B * S, D).contiguous()
        with torch.no_grad():
            h, r = first_norm(step, x2d.detach(), self.attn_norm)
        return self.run(step, x2d, h, r, None).view(B, S, D)

    def tune(self, batch: int, seq: int, *, forward_only: bool = False, **options: Any) -> dict[str, Any]:
        """Tune this block's kernels inside its own forward + backward on (batch, seq) tokens,
        sustained (coda_cutlass.nn.tuning); the plan is stored and used from then on. With
        ``forward_only``, tune the forward that runs without autograd (inference) in its own
        sequence. Options go to tune_in_sequence (iters, rounds, warmup, runtime, cache_dir, ...)."""
        x = torch.randn(batch, seq, self.dims.dim, device=self.qkv.device, dtype=self.qkv.dtype, requires_grad=True)
        return tune_module(self, self.get_runner(), lambda: self(x), torch.randn_like(x), context=self.context(),
                           M=batch * seq, forward_only=forward_only, **options)

    # ------------------------------------------------------------------ Hugging Face
    @classmethod
    def from_hf(cls, layer: Any, config: Any = None, *, attention: str = "sdpa") -> "LlamaBlock":
        """A block with the weights of a transformers ``LlamaDecoderLayer`` (q/k rows permuted to
        adjacent RoPE pairs, q/k/v fused, gate/up interleaved). RoPE frequencies come from the
        layer's config (``rope_theta``, and ``rope_scaling`` through transformers when set)."""
        return block_from_hf(cls, layer, config, attention)

    def to_hf(self, layer: Any) -> Any:
        """Copy this block's weights into a transformers ``LlamaDecoderLayer`` (inverse of from_hf)."""
        return block_to_hf(self, layer)
