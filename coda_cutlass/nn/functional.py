"""The Llama block's forward and backward as GEMM + epilogue programs (docs/TRANSFORMER_MATH.md, kernels
F1-F4 and B1-B9), written once over a ``Runner``: compiled kernels on a GPU, the reference
interpreter elsewhere.

Every non-attention op rides a GEMM epilogue or a map kernel; what is left between the GEMMs are
one-launch finishing steps of cross-tile reductions (an addmv over per-tile partials for each row
statistic, a column sum for each dgamma). The residual stream enters a block as (x, h, r): the
stream, h = x * g_attn (the QKV GEMM's A operand) and r = rstd(x), all produced by the previous
block's down-proj epilogue (or, for the first block, by one map kernel over the embedding output).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import epilogues as E
from .activations import ACTIVATIONS, Activation
from . import qk_norm, sandwich
from .stats import row_mean, rstd
from .attention import Attention
from .kernels import FORWARD_ONLY
from .runner import Runner

@dataclass(frozen=True)
class BlockDims:
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    eps: float

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def qkv_width(self) -> int:
        return self.q_width + 2 * self.kv_width


@dataclass
class BlockWeights:
    """Weights in the kernels' layout: W_qkv with RoPE pairs adjacent (coda_cutlass.layouts), W_gu
    with gate/up rows interleaved, all as nn.Linear (out, in)."""
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv_bias: torch.Tensor | None = None     # per QKV column, kernel layout (Qwen 2)
    q_norm: torch.Tensor | None = None       # per-head RMSNorm gains of q and k (Qwen 3), pair order
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None   # sandwich norms on the out-proj / down-proj outputs (Gemma 2/3)
    post_mlp_norm: torch.Tensor | None = None


@dataclass
class Step:
    """What one call needs besides tensors: shapes, the runner, attention, RoPE inputs."""
    dims: BlockDims
    runner: Runner
    attention: Attention
    batch: int
    seq: int
    pos: torch.Tensor        # (M,) fp32 position of each token
    freq: torch.Tensor       # (qkv_width,) fp32 RoPE frequency of each column (0 on V)
    dropout: float = 0.0     # attention dropout probability (training only)
    dtype: torch.dtype | None = None   # the compute dtype (weights are cast to it: nn.precision)
    mlp: Activation = ACTIVATIONS["silu"]   # the gated MLP's programs (nn.activations)
    mask: torch.Tensor | None = None         # (B, 1, S, S) bool beyond causal: padding, documents (nn.masks)
    length: int | None = None                # largest position + 1 (RoPE types that follow it); None: seq
    fp8: Any = None                          # the FP8 recipe of the step's blocks (nn.fp8); None: bf16
    stash: dict = field(default_factory=dict)   # FP8 copies of gradients between blocks (nn.fp8.autograd)


def first_norm(step: Step, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, r) of the residual stream entering the first block: one map kernel (no GEMM)."""
    out = step.runner.map("norm0", E.norm_stats, x, partial=True, g=g)
    return out["h"], rstd(out["sumsq"], step.dims.dim, step.dims.eps)


def block_forward(step: Step, x: torch.Tensor, h: torch.Tensor, r: torch.Tensor, w: BlockWeights,
                  g_next: torch.Tensor | None, *, train: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, tuple | None]:
    """One block: returns (x2, h2, r2, saved). h2 = x2 * g_next and r2 = rstd(x2) when g_next is
    given (the next block's or the final norm's weight), else None. With ``train=False`` (no backward
    will follow) nothing is saved and the gate/up GEMM does not write its M x 2F pre-activation; the
    GEMMs then launch at their own sites ("qkv.infer", ...), tuned apart from the training step's
    (a forward-only sequence is all GEMMs at the power limit: other tiles can win there)."""
    d, run = step.dims, step.runner
    sfx = "" if train else FORWARD_ONLY
    qk_ctx = None
    if w.q_norm is not None:                                                                   # F4
        qkv, qk_ctx = qk_norm.forward(step, h, r, w, "qkv" + sfx)
    elif w.qkv_bias is None:
        qkv = run.gemm("qkv" + sfx, E.rope, h, w.qkv, r=r, pos=step.pos, freq=step.freq)["D"]
    else:
        qkv = run.gemm("qkv" + sfx, E.rope_bias, h, w.qkv, r=r, bias=w.qkv_bias, pos=step.pos, freq=step.freq)["D"]
    o, attn_ctx = step.attention.forward(qkv, step.batch, step.seq, d, step.dropout, step.mask)
    post1 = post2 = None
    if w.post_attn_norm is None:                                                               # F1
        f1 = run.gemm("o" + sfx, E.residual_norm_stats, o, w.o, partial=True, resid=x, g=w.mlp_norm)
        x1, h1 = f1["D"], f1["h"]
        r1 = rstd(f1["sumsq"], d.dim, d.eps)                                                   # R1
    else:
        x1, h1, r1, post1 = sandwich.forward(step, "o" + sfx, o, w.o, x, w.post_attn_norm, w.mlp_norm)
    if not train:                                                                              # F2
        z, y = None, run.gemm("gate_up.infer", step.mlp.infer, h1, w.gate_up, r=r1)["y"]
    else:
        f2 = run.gemm("gate_up", step.mlp.train, h1, w.gate_up, r=r1)
        z, y = f2["z"], f2["y"]
    if w.post_mlp_norm is not None:                                                            # F3
        x2, h2, r2, post2 = sandwich.forward(step, ("down" if g_next is not None else "down.last") + sfx, y,
                                             w.down, x1, w.post_mlp_norm, g_next)
    elif g_next is not None:
        f3 = run.gemm("down" + sfx, E.residual_norm_stats, y, w.down, partial=True, resid=x1, g=g_next)
        x2, h2, r2 = f3["D"], f3["h"], rstd(f3["sumsq"], d.dim, d.eps)                         # R2
    else:
        x2, h2, r2 = run.gemm("down.last" + sfx, E.residual_add, y, w.down, resid=x1)["D"], None, None
    # y, h and h1 are not kept: the dX epilogues write them again (y from z, h = x * g, h1 = x1 * g)
    return x2, h2, r2, (x, None, r, qkv, o, x1, None, r1, z, None, attn_ctx, qk_ctx, post1, post2) if train else None


def block_backward(step: Step, saved: tuple, w: BlockWeights, dx2: torch.Tensor) -> tuple[torch.Tensor, BlockWeights]:
    """dL/dx of the block's input stream and the weight gradients (as a BlockWeights)."""
    d, run = step.dims, step.runner
    x, _, r, qkv, o, x1, _, r1, z, _, attn_ctx, qk_ctx, post1, post2 = saved
    # ---- MLP: SwiGLU backward in the down-proj dX GEMM, MLP norm backward in the gate/up dX GEMM
    dm, d_pm = dx2, None
    if post2 is not None:       # the down-proj output's own norm first (two map kernels)
        dm, d_pm = sandwich.backward(step, "down", post2, w.post_mlp_norm, dx2)
    b4 = run.gemm("down.dgrad", step.mlp.backward, dm, w.down, layout="kn", partial=True, z=z, r=r1)  # B4
    dz, y = b4["dz"], b4.pop("y")            # y = act(gate) * up again, from z
    d_down = run.timed("down.wgrad", lambda: dm.t() @ y)                                       # B5
    del y
    c1 = row_mean(b4["zdz"], d.dim)
    b6 = run.gemm("gate_up.dgrad", E.norm_backward_h, dz, w.gate_up, layout="kn", partial=True,  # B6
                  x=x1, r=r1, c=c1, g=w.mlp_norm, dres=dx2)
    dx1, h1 = b6["dx"], b6.pop("h")          # h1 = x1 * g again, from x1
    d_gate_up = run.timed("gate_up.wgrad", lambda: dz.t() @ h1)                                # B7
    del h1
    # ---- attention: out-proj dX and dW are plain GEMMs; the RoPE backward is a map kernel
    do, d_pa = dx1, None
    if post1 is not None:
        do, d_pa = sandwich.backward(step, "o", post1, w.post_attn_norm, dx1)
    d_attn = run.timed("o.dgrad", lambda: do @ w.o)                                            # B8
    d_o = run.timed("o.wgrad", lambda: do.t() @ o)                                             # B9
    grads = run.timed("attention.bwd", lambda: step.attention.backward(attn_ctx, d_attn))
    dqkv = torch.empty_like(qkv)
    zdz = []
    start = 0
    d_qn = d_kn = None
    if qk_ctx is not None:      # q and k through their per-head norms, v as below
        zdz, d_qn, d_kn = qk_norm.backward(step, qk_ctx, w, r, grads[:2], dqkv)
        start, grads = d.q_width + d.kv_width, grads[2:]
    for g4 in grads:            # (B, S, heads, head_dim) views                                # B1
        width = g4.shape[2] * g4.shape[3]
        cols = slice(start, start + width)
        if w.qkv_bias is None:
            res = run.map("rope.dgrad", E.rope_backward, g4, partial=True, out={"dz": dqkv[:, cols]},
                          y=qkv[:, cols], r=r, pos=step.pos, freq=step.freq[cols])
        else:
            res = run.map("rope.dgrad", E.rope_backward_bias, g4, partial=True, out={"dz": dqkv[:, cols]},
                          y=qkv[:, cols], r=r, bias=w.qkv_bias[cols], pos=step.pos, freq=step.freq[cols])
        zdz.append(res["zdz"])
        start += width
    c = row_mean(torch.cat(zdz), d.dim)
    b2 = run.gemm("qkv.dgrad", E.norm_backward_h, dqkv, w.qkv, layout="kn", partial=True,     # B2
                  x=x, r=r, c=c, g=w.attn_norm, dres=dx1)
    h = b2.pop("h")                          # h = x * g again, from x
    d_qkv = run.timed("qkv.wgrad", lambda: dqkv.t() @ h)                                      # B3
    del h
    d_bias = None
    if w.qkv_bias is not None:      # dbias = column sums of dz = dz'^T (1 / r)
        d_bias = run.timed("qkv.bgrad", lambda: torch.mv(dqkv.t(), r.reciprocal().to(dqkv.dtype)))
    grads_w = BlockWeights(qkv=d_qkv, o=d_o, gate_up=d_gate_up, down=d_down,
                           attn_norm=b2["dgamma"].sum(0).to(w.attn_norm.dtype),
                           mlp_norm=b6["dgamma"].sum(0).to(w.mlp_norm.dtype), qkv_bias=d_bias,
                           q_norm=d_qn, k_norm=d_kn, post_attn_norm=d_pa, post_mlp_norm=d_pm)
    return b2["dx"], grads_w


@dataclass(frozen=True)
class LMHeadPrograms:
    """The LM head's programs, plain or with soft-capped logits (operands: ``extra``)."""
    logits: Any
    lse: Any
    lse_logits: Any
    recompute: Any
    grad: Any
    extra: dict


def lm_head_programs(softcap: float | None) -> LMHeadPrograms:
    if softcap is None:
        return LMHeadPrograms(E.rowscale, E.lm_head_lse, E.lm_head_lse_logits, E.cross_entropy_backward,
                              E.cross_entropy_grad, {})
    return LMHeadPrograms(E.rowscale_softcap, E.lm_head_lse_softcap, E.lm_head_lse_logits_softcap,
                          E.cross_entropy_backward_softcap, E.cross_entropy_grad_softcap, {"cap": float(softcap)})


def lm_head_forward(step: Step, h: torch.Tensor, r: torch.Tensor, w_lm: torch.Tensor,
                    target: torch.Tensor, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row log-sum-exp and target logit of logits = r * (h @ W_lm^T); logits are not written."""
    P = lm_head_programs(softcap)
    out = step.runner.gemm("lm_head", P.lse, h, w_lm, r=r, target=target, **P.extra)
    return out["lse"], out["target_logit"]


def lm_head_backward(step: Step, x: torch.Tensor, h: torch.Tensor, r: torch.Tensor, w_lm: torch.Tensor,
                     g: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, scale: torch.Tensor,
                     chunk_rows: int, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropy + final-norm backward, in row chunks (dlogits exist for one chunk at a time):
    the LM head is recomputed with the softmax gradient in its epilogue, then the final norm's
    backward rides the dX GEMM. Returns (dx, dW_lm, dgamma)."""
    d, run = step.dims, step.runner
    P = lm_head_programs(softcap)
    M = x.shape[0]
    dx = torch.empty_like(x)
    dw = None
    dgamma = torch.zeros(g.shape[0], dtype=torch.float32, device=g.device)
    for a in range(0, M, chunk_rows):
        b = min(M, a + chunk_rows)
        ce = run.gemm("lm_head.recompute", P.recompute, h[a:b], w_lm, partial=True,
                      r=r[a:b], lse=lse[a:b], target=target[a:b], scale=scale[a:b], **P.extra)
        dl = ce["D"]
        nb = run.gemm("lm_head.dgrad", E.norm_backward_first, dl, w_lm, layout="kn", partial=True,
                      out={"dx": dx[a:b]}, x=x[a:b], r=r[a:b], c=row_mean(ce["zdz"], d.dim), g=g)
        dgamma += nb["dgamma"].sum(0)
        dw = _wgrad_chunk(run, dw, dl, h[a:b])
    return dx, dw if dw is not None else torch.zeros_like(w_lm), dgamma.to(g.dtype)


def _wgrad_chunk(run: Any, dw: torch.Tensor | None, dl: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """dw + dl^T h, the LM head's weight gradient over row chunks: the first chunk's product is dw (a
    zero-filled vocab x dim buffer would be written, then read back by the first addmm: ~1 GB at a
    128k x 2048 head)."""
    if dw is None:
        return run.timed("lm_head.wgrad", lambda: torch.mm(dl.t(), h))
    return run.timed("lm_head.wgrad", lambda: dw.addmm_(dl.t(), h))


def lm_head_fused(step: Step, x: torch.Tensor, h: torch.Tensor, r: torch.Tensor, w_lm: torch.Tensor,
                  g: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, chunk_rows: int,
                  softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The LM head, cross-entropy and final norm, forward and backward in one pass over row chunks
    (for dloss = 1: the caller scales the gradients by dloss), without recomputing the logits: per
    chunk the logits GEMM writes them with the log-sum-exp and target logit (``lm_head_lse_logits``),
    a map kernel turns them into dz' = r * dlogits in place (``cross_entropy_grad``), then the norm-backward
    dX GEMM and the weight-gradient GEMM consume the chunk: three vocab-sized GEMMs, not four.
    Returns (lse, target_logit, dx, dW_lm, dgamma)."""
    d, run = step.dims, step.runner
    P = lm_head_programs(softcap)
    M = x.shape[0]
    lse = torch.empty(M, dtype=torch.float32, device=x.device)
    tlogit = torch.empty(M, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(x)
    dw = None
    dgamma = torch.zeros(g.shape[0], dtype=torch.float32, device=g.device)
    for a in range(0, M, chunk_rows):
        b = min(M, a + chunk_rows)
        f = run.gemm("lm_head.fused", P.lse_logits, h[a:b], w_lm, r=r[a:b], target=target[a:b], **P.extra)
        lse[a:b], tlogit[a:b] = f["lse"], f["target_logit"]
        logits = f.pop("D")
        # dlogits over the logits (the map kernel reads each element before it writes it): one chunk in memory
        ce = run.map("lm_head.ce_grad", P.grad, logits, partial=True, out={"D": logits}, r=r[a:b], lse=f["lse"],
                     target=target[a:b], scale=scale[a:b], **P.extra)
        dl = ce["D"]
        del logits, f
        nb = run.gemm("lm_head.dgrad", E.norm_backward_first, dl, w_lm, layout="kn", partial=True,
                      out={"dx": dx[a:b]}, x=x[a:b], r=r[a:b], c=row_mean(ce["zdz"], d.dim), g=g)
        dgamma += nb["dgamma"].sum(0)
        dw = _wgrad_chunk(run, dw, dl, h[a:b])
    return lse, tlogit, dx, dw if dw is not None else torch.zeros_like(w_lm), dgamma.to(g.dtype)
