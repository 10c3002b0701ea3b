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

import dataclasses
import math
from typing import Any, Iterable

import torch
from torch import nn

from ..errors import ConfigError
from ..partials import cached_tensor
from .activations import activation as find_activation
from .attention import Attention
from .checkpointing import recompute_in_backward
from .functional import BlockDims, BlockWeights, Step, block_backward, block_forward, first_norm
from .fp8 import support as fp8_support
from .fp8.recipe import Fp8Recipe, as_recipe
from .hf.layer import block_from_hf, block_to_hf
from .checks import (check_block_args, check_kernel_runner, check_rope_args, check_stream, check_switch,
                     refuse_double_backward)
from .precision import cast, check_compute_dtype, compute_dtype, no_autocast, runner_for
from .rope import Rope, column_frequencies
from .runner import KernelRunner, Runner
from .saved import flatten, unflatten
from .sharding import check_stack_call, full_value
from .tuning import tune_module


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
    def forward(ctx: Any, x, h, r, w_qkv, w_o, w_gu, w_down, g_attn, g_mlp, b_qkv, g_q, g_k, g_pa, g_pm,  # type: ignore[override]
                g_next, step: Step):
        weights = (w_qkv, w_o, w_gu, w_down, g_attn, g_mlp, b_qkv, g_q, g_k, g_pa, g_pm)
        with no_autocast(x.device):
            x2, h2, r2, saved = block_forward(step, x, h, r, BlockWeights(*weights), g_next)
        tensors: list[Any] = []
        ctx.layout = flatten(saved, tensors)
        ctx.save_for_backward(*tensors, *weights)
        ctx.step, ctx.n_weights = step, len(weights)
        if h2 is None:
            return x2
        ctx.mark_non_differentiable(h2, r2)
        return x2, h2, r2

    @staticmethod
    def backward(ctx: Any, dx2: torch.Tensor, *unused: Any):  # type: ignore[override]
        refuse_double_backward("a coda LlamaBlock")
        tensors = ctx.saved_tensors
        saved = unflatten(ctx.layout, iter(tensors[:-ctx.n_weights]))
        with no_autocast(dx2.device):
            dx, g = block_backward(ctx.step, saved, BlockWeights(*tensors[-ctx.n_weights:]), dx2.contiguous())
        return (dx, None, None, g.qkv, g.o, g.gate_up, g.down, g.attn_norm, g.mlp_norm, g.qkv_bias, g.q_norm, g.k_norm,
                g.post_attn_norm, g.post_mlp_norm, None, None)


DEFAULT_ROPE_THETA = 500000.0     # Llama 3's RoPE base, when no RoPE setting is given


class LlamaBlock(nn.Module):
    """A Llama decoder layer (pre-norm RMSNorm -> QKV + RoPE -> causal GQA attention -> out-proj +
    residual -> RMSNorm -> gate/up + SwiGLU -> down + residual) in the kernels' weight layout."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int, *, head_dim: int | None = None,
                 eps: float = 1e-5, rope_theta: float | None = None, inv_freq: torch.Tensor | None = None,
                 rope: Rope | None = None, attention_scale: float | None = None, sliding_window: int | None = None,
                 attention_dropout: float = 0.0, activation: str = "silu", qkv_bias: bool = False,
                 qk_norm: bool = False, sandwich_norms: bool = False, norm_offset: float = 0.0,
                 attention_softcap: float | None = None, attention: str = "sdpa",
                 compute_dtype: torch.dtype | None = None, fp8: Any = None, device: Any = None, dtype: Any = None):
        super().__init__()
        head_dim, eps = check_block_args(dim, n_heads, n_kv_heads, head_dim, ffn_dim, eps)
        if sum(x is not None for x in (rope_theta, inv_freq, rope)) > 1:
            raise ValueError("pass at most one of rope_theta, inv_freq and rope (each sets the RoPE frequencies; "
                             "the others would be ignored)")
        if rope_theta is None and inv_freq is None and rope is None:
            rope_theta = DEFAULT_ROPE_THETA
        check_rope_args(rope_theta, inv_freq, rope)
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {attention_dropout!r}")
        self.dims = BlockDims(dim, n_heads, n_kv_heads, head_dim, ffn_dim, eps)
        kw = {"device": device, "dtype": dtype}
        d = self.dims
        self.attn_norm = nn.Parameter(torch.ones(dim, **kw))
        self.qkv = nn.Parameter(torch.empty(d.qkv_width, dim, **kw))
        self.o = nn.Parameter(torch.empty(dim, d.q_width, **kw))
        self.mlp_norm = nn.Parameter(torch.ones(dim, **kw))
        self.gate_up = nn.Parameter(torch.empty(2 * ffn_dim, dim, **kw))
        self.down = nn.Parameter(torch.empty(dim, ffn_dim, **kw))
        # q/k/v biases (Qwen 2), in the kernels' column order (RoPE pairs adjacent, as W_qkv's rows)
        self.qkv_bias = nn.Parameter(torch.zeros(d.qkv_width, **kw)) if qkv_bias else None
        # per-head RMSNorm gains of q and k before RoPE (Qwen 3), in the heads' pair order
        self.q_norm = nn.Parameter(torch.ones(head_dim, **kw)) if qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(head_dim, **kw)) if qk_norm else None
        if qk_norm and qkv_bias:
            raise ValueError("qk_norm with qkv_bias is not implemented")
        # RMSNorms on the out-proj and down-proj outputs before the residual adds (Gemma 2 / 3)
        self.post_attn_norm = nn.Parameter(torch.ones(dim, **kw)) if sandwich_norms else None
        self.post_mlp_norm = nn.Parameter(torch.ones(dim, **kw)) if sandwich_norms else None
        self.mlp = find_activation(activation)
        self.norm_offset = float(norm_offset)      # the norms scale by (offset + weight): 1 for Gemma
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)     # per RoPE pair, fp32
        self.register_buffer("rope_freq", torch.empty(0), persistent=False)    # per QKV column, fp32
        self.attention_dropout = float(attention_dropout)
        self._attention_args = (attention, attention_scale, sliding_window)
        self._softcap = attention_softcap
        self._set_rope(rope if rope is not None else Rope.explicit(inv_freq) if inv_freq is not None
                       else Rope.default(head_dim, rope_theta),
                       torch.device(device) if device is not None else torch.get_default_device())
        self.compute_dtype = check_compute_dtype(compute_dtype)
        # recompute the forward in the backward instead of keeping its activations (nn.checkpointing)
        self.activation_checkpointing = False
        self.runner: Runner | None = None          # set to pin one (a tuned KernelRunner); else one per dtype
        self._runners: dict[tuple[str, torch.dtype], Runner] = {}
        # FP8 training (nn.fp8): every linear's GEMMs in FP8 with this recipe; None: bf16
        self._fp8: Fp8Recipe | None = None
        self._fp8_path = None
        self._fp8_tracking = False         # track_fp8_stats' switch, kept while the block runs bf16
        self.fp8 = fp8
        self.reset_parameters()

    @property
    def fp8(self) -> Fp8Recipe | None:
        """The FP8 recipe of this block's linears (nn.fp8), None for bf16. Assigning one (a recipe
        name, an Fp8Recipe or None) checks it against the block first; another recipe than the
        current one starts its FP8 state afresh (weight copies, amax histories: its next training
        step calibrates), as a new block of that recipe; the same recipe keeps it."""
        return self._fp8

    @fp8.setter
    def fp8(self, value: Any) -> None:
        recipe = fp8_support.check_block(self, as_recipe(value))
        if recipe == self._fp8:
            return
        # the statistics switch is the user's, not the recipe's: it outlives the path, also across
        # a spell in bf16 (fp8=None: no path)
        if self._fp8_path is not None:
            self._fp8_tracking = self._fp8_path.tracking
        self._fp8, self._fp8_path = recipe, None
        if recipe is not None and self._fp8_tracking:
            self.fp8_path().track_stats(True)

    # ------------------------------------------------------------------ RoPE and attention settings
    def _set_rope(self, rope: Rope, device: torch.device) -> None:
        if rope.head_dim != self.dims.head_dim:
            raise ValueError(f"the RoPE settings are for head_dim {rope.head_dim}, the block's is {self.dims.head_dim}")
        self.rope = rope
        self._freq_cache: dict[int, torch.Tensor] = {}
        self._set_rope_buffers(device)
        backend, scale, window = self._attention_args
        base = self.dims.head_dim ** -0.5 if scale is None else scale
        # yarn / longrope scale cos and sin: q . k grows by the square (folded into the softmax scale)
        factor = rope.attention_scaling ** 2
        self.attention = Attention(backend, scale=None if scale is None and factor == 1.0 else base * factor,
                                   window=window, softcap=self._softcap)

    def _set_rope_buffers(self, device: torch.device) -> None:
        d = self.dims
        with torch.device("cpu"):       # computed on the host (also under `with torch.device("meta")`)
            inv = self.rope.inv_freq()
            freq = column_frequencies(inv, d.n_heads, d.n_kv_heads)
        self.inv_freq = inv.to(device, torch.float32)
        self.rope_freq = freq.to(device)
        self._freq_cache = {}

    def column_freq(self, seq: int) -> torch.Tensor:
        """The per-column RoPE frequencies for a call whose largest position is seq - 1 (they depend
        on it for the dynamic and longrope types)."""
        if not self.rope.depends_on_length:
            return self.rope_freq
        key = self.rope.length_key(seq)
        f = self._freq_cache.get(key)
        if f is None:
            d = self.dims
            f = self._freq_cache[key] = column_frequencies(self.rope.inv_freq(seq), d.n_heads,
                                                           d.n_kv_heads).to(self.rope_freq.device)
        return f

    def get_extra_state(self) -> dict[str, Any]:
        """The settings a state_dict keeps besides the tensors: RoPE, softmax scale, sliding window,
        and a "tensorwise" FP8 block's amax histories (so a resumed run keeps its scales)."""
        backend, scale, window = self._attention_args
        state = {"rope": self.rope.to_dict(), "attention_scale": scale, "sliding_window": window,
                 "attention_softcap": self._softcap}
        scales = self._fp8_scales()
        if scales is not None:
            state["fp8_scales"] = scales.state()
        return state

    def set_extra_state(self, state: Any) -> None:
        if not isinstance(state, dict) or "rope" not in state:
            raise ValueError(f"LlamaBlock extra state must be a dict with the RoPE settings, got {type(state).__name__}")
        self._attention_args = (self._attention_args[0], state.get("attention_scale"), state.get("sliding_window"))
        self._softcap = state.get("attention_softcap")
        self._set_rope(Rope.from_dict(state["rope"]), self.qkv.device)   # (the buffers may still be on meta)
        scales = self._fp8_scales()
        if scales is not None:
            # a checkpoint of another recipe (bf16, blockwise) keeps no histories: this block forgets its
            # own, so what it did before the load does not matter (its next step calibrates)
            if state.get("fp8_scales") is None:
                scales.reset()
            else:
                scales.load_state(state["fp8_scales"])

    def _fp8_scales(self) -> Any:
        """The delayed scales of a "tensorwise" block, else None."""
        return None if self.fp8 is None else getattr(self.fp8_path(), "scales", None)

    def _apply(self, fn: Any, recurse: bool = True) -> "LlamaBlock":
        # module.to(dtype) would round the RoPE frequencies to bf16: keep them fp32, from their source
        super()._apply(fn, recurse)
        self._set_rope_buffers(self.qkv.device)
        return self

    def reset_parameters(self) -> None:
        """Every parameter back to its value at construction: the weights drawn anew, the gains one, the
        q/k/v bias zero (the optional ones too: they kept their trained values)."""
        for w in (self.qkv, self.o, self.gate_up, self.down):
            nn.init.normal_(w, std=1.0 / math.sqrt(w.shape[1]))
        for g in (self.attn_norm, self.mlp_norm, self.q_norm, self.k_norm, self.post_attn_norm, self.post_mlp_norm):
            if g is not None:
                nn.init.ones_(g)
        if self.qkv_bias is not None:
            nn.init.zeros_(self.qkv_bias)

    def extra_repr(self) -> str:
        d = self.dims
        extra = "" if self.rope.rope_type == "default" else f", rope={self.rope.rope_type}"
        if self.attention.window is not None:
            extra += f", sliding_window={self.attention.window}"
        if self.attention.softcap is not None:
            extra += f", attention_softcap={self.attention.softcap}"
        if self.mlp.name != "silu":
            extra += f", activation={self.mlp.name}"
        if self.qkv_bias is not None:
            extra += ", qkv_bias=True"
        if self.q_norm is not None:
            extra += ", qk_norm=True"
        if self.post_attn_norm is not None:
            extra += ", sandwich_norms=True"
        if self.norm_offset:
            extra += f", norm_offset={self.norm_offset}"
        return (f"dim={d.dim}, heads={d.n_heads}, kv_heads={d.n_kv_heads}, head_dim={d.head_dim}, "
                f"ffn={d.ffn_dim}, eps={d.eps}, attention={self.attention.backend}{extra}")

    # ------------------------------------------------------------------ running
    def call_dtype(self) -> torch.dtype:
        """The dtype this call computes in (nn.precision): compute_dtype, else autocast's for fp32
        parameters, else the parameters'."""
        return compute_dtype(self.qkv.dtype, self.qkv.device, self.compute_dtype)

    def __getstate__(self) -> dict[str, Any]:
        # The default runners are caches (compiled kernels hold ctypes handles): made again on first
        # use, so copies, pickles and torch.save work after GPU use. A runner set on the block is
        # kept (runners drop their own caches when pickled).
        # The FP8 path travels: its delayed scales (amax histories, scales, this step's amaxes) and the
        # blockwise statistics switch; its weight copies do not (nn/fp8/weights.py: made again).
        state = super().__getstate__()
        state["_runners"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "fp8" in state:          # pickled when the recipe was a plain attribute
            state = {**state, "_fp8": state["fp8"]}
            del state["fp8"]
        state = {"_fp8_tracking": False, **state}      # pickled before the switch was kept on the block
        super().__setstate__(state)

    def get_runner(self, dtype: torch.dtype | None = None) -> Runner:
        """The pinned ``runner``, else this block's runner for the device and compute dtype (kernels
        on a Hopper GPU in bf16 / fp16, the reference interpreter elsewhere: nn.precision.runner_for)."""
        if self.runner is not None:
            return self.runner
        key = (str(self.qkv.device), dtype or self.call_dtype())
        r = self._runners.get(key)
        if r is None:
            r = self._runners[key] = runner_for(self.qkv.device, key[1])
        return r

    def context(self) -> str:
        """The model widths that decide kernel shapes (the key of in-sequence tuning plans)."""
        d = self.dims
        extra = ("" if self.mlp.name == "silu" else f":{self.mlp.name}") + ("" if self.qkv_bias is None else ":bias") \
            + ("" if self.q_norm is None else ":qknorm") + ("" if self.post_attn_norm is None else ":sandwich") \
            + ("" if self.fp8 is None else f":fp8-{self.fp8.plan_name}")     # FP8 sites: their own plans
        return f"llama:d{d.dim}:h{d.n_heads}/{d.n_kv_heads}:hd{d.head_dim}:f{d.ffn_dim}{extra}"

    def step(self, batch: int, seq: int, runner: Runner | None = None, dtype: torch.dtype | None = None, *,
             position_ids: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> Step:
        """What one call needs besides tensors. ``position_ids`` (B, S): each token's RoPE position
        (default 0..S-1 per row); ``mask``: nn.masks.attention_mask (padding, packed documents)."""
        dtype = dtype or self.call_dtype()
        runner = runner or self.get_runner(dtype)
        if isinstance(runner, KernelRunner):
            check_kernel_runner(runner, self.qkv.device, dtype)
            runner.prepare(self.context(), batch * seq)
        if position_ids is None:
            pos, length = positions(batch, seq, self.qkv.device), seq
        else:
            if tuple(position_ids.shape[-1:]) != (seq,):
                raise ValueError(f"position_ids must be (batch, {seq}), got {tuple(position_ids.shape)}")
            pos = position_ids.to(self.qkv.device).expand(batch, seq).reshape(-1).to(torch.float32)
            length = int(position_ids.max().item()) + 1
        return Step(self.dims, runner, self.attention, batch, seq, pos, self.column_freq(length), self._dropout(),
                    dtype, self.mlp, mask, length, self.fp8)

    def _dropout(self) -> float:
        return self.attention_dropout if self.training else 0.0

    def local_step(self, step: Step) -> Step:
        """A stack's step with this block's own attention settings, RoPE frequencies, FP8 recipe and,
        on a GPU, its context's kernel plan (layers of one model may differ in all of them: a
        ``PlanView`` of the model's runner). The stash of gradients' FP8 copies stays the step's (one
        dict, shared)."""
        freq = self.column_freq(step.length or step.seq)
        runner = step.runner
        if isinstance(runner, KernelRunner):     # itself where this block's context is the runner's
            runner = runner.bound(self.context(), step.batch * step.seq)
        if step.attention is self.attention and step.freq is freq and step.dropout == self._dropout() \
                and step.mlp is self.mlp and step.fp8 is self.fp8 and runner is step.runner:
            return step
        return dataclasses.replace(step, attention=self.attention, freq=freq, dropout=self._dropout(), mlp=self.mlp,
                                   fp8=self.fp8, runner=runner)

    def gain(self, norm: torch.Tensor) -> torch.Tensor:
        """A norm's effective gain: its weight, plus norm_offset (Gemma's (1 + w))."""
        return norm if self.norm_offset == 0.0 else norm + self.norm_offset

    def attn_gain(self) -> torch.Tensor:
        """The attention norm's gain (the previous block's down-proj epilogue applies it, while this
        block's parameters may still be sharded under FSDP2: then the whole vector is gathered)."""
        return self.gain(full_value(self.attn_norm))

    def weights(self) -> tuple[torch.Tensor | None, ...]:
        return (self.qkv, self.o, self.gate_up, self.down, self.gain(self.attn_norm), self.gain(self.mlp_norm),
                self.qkv_bias, *(None if p is None else self.gain(p)
                                 for p in (self.q_norm, self.k_norm, self.post_attn_norm, self.post_mlp_norm)))

    def run(self, step: Step, x: torch.Tensor, h: Any, r: torch.Tensor,
            g_next: torch.Tensor | None, *, next_fp8: bool | Fp8Recipe = False) -> Any:
        """The block on an (M, D) stream with its normed copy h and rstd r (as a stack calls it).
        Without autograd (no_grad, or nothing requires a gradient) it runs the forward alone, which
        saves nothing and writes less (``block_forward(train=False)``). With
        ``activation_checkpointing`` the backward recomputes it (nn.checkpointing). ``next_fp8``
        (FP8 blocks): hand the next block its h in FP8 as that block reads it
        (nn.fp8.support.hands_fp8), else in bf16."""
        check_stack_call(self, step, r)
        if self.fp8 is not None:             # nn.fp8: h is the FP8 operand of the QKV GEMM
            def run_fp8(step: Step, x: torch.Tensor, h: Any, r: torch.Tensor, g_next: torch.Tensor | None,
                        train: bool = False) -> Any:
                return fp8_support.run(self, step, x, h, r, g_next, next_fp8)
            if self.activation_checkpointing and torch.is_grad_enabled():
                return recompute_in_backward(run_fp8, step, x, h, r, g_next)
            return run_fp8(step, x, h, r, g_next)
        if self.activation_checkpointing and torch.is_grad_enabled():
            return recompute_in_backward(self._run, step, x, h, r, g_next)
        return self._run(step, x, h, r, g_next)

    def _run(self, step: Step, x: torch.Tensor, h: torch.Tensor, r: torch.Tensor, g_next: torch.Tensor | None,
             train: bool = False) -> Any:
        """run's work; ``train``: the training kernels even without autograd (the first pass of a
        checkpointed block, so the recompute reproduces its outputs bit for bit)."""
        step = self.local_step(step)
        dtype = step.dtype or self.qkv.dtype
        weights = tuple(None if w is None else cast(w, dtype) for w in self.weights())  # once per call
        if g_next is not None:
            g_next = cast(g_next.detach(), dtype)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *weights)):
            return BlockFunction.apply(x, h, r, *weights, g_next, step)
        with no_autocast(x.device):
            x2, h2, r2, _ = block_forward(step, x, h, r, BlockWeights(*weights), g_next, train=train)
        return x2 if h2 is None else (x2, h2, r2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, S, D) -> (B, S, D)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.dims.dim:
            raise ValueError(f"LlamaBlock expects (batch, seq, {self.dims.dim}) input, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        check_stream(x, self.qkv)
        B, S, D = x.shape
        step = self.step(B, S)
        x2d = cast(x.reshape(B * S, D), step.dtype).contiguous()
        with torch.no_grad(), no_autocast(x.device):
            norm0 = first_norm if self.fp8 is None else fp8_support.first_norm_fp8
            h, r = norm0(step, x2d.detach(), cast(self.attn_gain().detach(), step.dtype))
        return self.run(step, x2d, h, r, None).view(B, S, D)

    def fp8_path(self) -> Any:
        """This block's FP8 state under its recipe (nn.fp8.paths): the weights' FP8 copies, made once
        per optimizer step, and for per-tensor scaling the amax histories."""
        if self._fp8_path is None:
            self._fp8_path = fp8_support.new_path(self.fp8)
        return self._fp8_path

    def fp8_weights(self) -> Any:
        """The FP8 copies of this block's weights (nn.fp8.weights)."""
        return self.fp8_path().weights

    def fp8_stats(self) -> dict[str, Any]:
        """Per quantised tensor of a "tensorwise" block: its amax history, scale and format; of a
        blockwise block that tracks them (``track_fp8_stats``): each operand's largest and smallest
        block scale in the step (its training calls since the last optimizer step: micro-batches),
        the bound on its amax they give, and its non-finite runs (nn/fp8/block_stats.py). Host
        values: this waits for the GPU; call it for logging. Empty for bf16 blocks or before the
        first step."""
        return {} if self.fp8 is None else self.fp8_path().stats()

    def track_fp8_stats(self, on: bool = True) -> None:
        """Blockwise recipes: keep per-step scale statistics of every quantised operand for
        ``fp8_stats`` (off by default: a few small reductions per operand and step). Per-tensor
        recipes keep their amax histories anyway."""
        check_switch(on)
        if self.fp8 is None:
            if not on:                  # off is kept for when a recipe comes back (the switch outlives bf16)
                self._fp8_tracking = False
                return
            raise ConfigError("track_fp8_stats: this block runs in 16 bits (fp8=None); there are no FP8 operands")
        self._fp8_tracking = on
        self.fp8_path().track_stats(on)

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
    def from_hf(cls, layer: Any, config: Any = None, *, attention: str = "sdpa",
                ignore_fields: Iterable[str] = ()) -> "LlamaBlock":
        """A block with the weights and settings of a transformers decoder layer (Llama, Mistral,
        Phi-3; q/k rows permuted to adjacent RoPE pairs, q/k/v fused, gate/up interleaved). The
        settings come from the layer's config (``self_attn.config``, or ``config``), in the style of
        transformers 5 (``rope_parameters``) or 4 (``rope_theta``, ``rope_scaling``); a field whose
        effect is not implemented is refused by name (``ignore_fields``: fields known to be inert)."""
        return block_from_hf(cls, layer, config, attention=attention, ignore_fields=ignore_fields)

    def to_hf(self, layer: Any, config: Any = None) -> Any:
        """Copy this block's weights into a transformers decoder layer (inverse of from_hf), after
        checking that the layer computes what the block computes (widths, RoPE, window) and has its
        shapes; on a mismatch nothing is written."""
        return block_to_hf(self, layer, config)
