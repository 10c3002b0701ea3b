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

from dataclasses import dataclass

import torch

from .. import epilogues as E
from ..partials import const_vector
from .attention import Attention
from .kernels import FORWARD_ONLY
from .runner import Runner

def row_mean(partials: torch.Tensor, d: int, add: float = 0.0) -> torch.Tensor:
    """Per-tile row partials [tiles, M] -> (sum over tiles) / d + add, in one addmv."""
    tiles, M = partials.shape
    ones = const_vector(tiles, 1.0 / d, partials.device)
    if add == 0.0:
        return torch.mv(partials.t(), ones)
    return torch.addmv(const_vector(M, add, partials.device), partials.t(), ones)


def rstd(partials: torch.Tensor, d: int, eps: float) -> torch.Tensor:
    """RMSNorm's r = rsqrt(mean x^2 + eps) from per-tile partial sums of x^2 (two launches). Not in
    place: r is saved for the backward, and Dynamo cannot save an in-place result from a traced
    autograd.Function (the block's forward under torch.compile)."""
    return row_mean(partials, d, eps).rsqrt()


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
    qkv = run.gemm("qkv" + sfx, E.rope, h, w.qkv, r=r, pos=step.pos, freq=step.freq)["D"]     # F4
    o, attn_ctx = step.attention.forward(qkv, step.batch, step.seq, d)
    f1 = run.gemm("o" + sfx, E.residual_norm_stats, o, w.o, partial=True, resid=x, g=w.mlp_norm)  # F1
    x1, h1 = f1["D"], f1["h"]
    r1 = rstd(f1["sumsq"], d.dim, d.eps)                                                       # R1
    if not train:                                                                              # F2
        z, y = None, run.gemm("gate_up.infer", E.swiglu_only, h1, w.gate_up, r=r1)["y"]
    else:
        f2 = run.gemm("gate_up", E.swiglu, h1, w.gate_up, r=r1)
        z, y = f2["z"], f2["y"]
    if g_next is not None:                                                                     # F3
        f3 = run.gemm("down" + sfx, E.residual_norm_stats, y, w.down, partial=True, resid=x1, g=g_next)
        x2, h2, r2 = f3["D"], f3["h"], rstd(f3["sumsq"], d.dim, d.eps)                         # R2
    else:
        x2, h2, r2 = run.gemm("down.last" + sfx, E.residual_add, y, w.down, resid=x1)["D"], None, None
    return x2, h2, r2, (x, h, r, qkv, o, x1, h1, r1, z, y, attn_ctx) if train else None


def block_backward(step: Step, saved: tuple, w: BlockWeights, dx2: torch.Tensor) -> tuple[torch.Tensor, BlockWeights]:
    """dL/dx of the block's input stream and the weight gradients (as a BlockWeights)."""
    d, run = step.dims, step.runner
    x, h, r, qkv, o, x1, h1, r1, z, y, attn_ctx = saved
    # ---- MLP: SwiGLU backward in the down-proj dX GEMM, MLP norm backward in the gate/up dX GEMM
    b4 = run.gemm("down.dgrad", E.swiglu_backward_scaled, dx2, w.down, layout="kn", partial=True, z=z, r=r1)  # B4
    dz = b4["dz"]
    d_down = run.timed("down.wgrad", lambda: dx2.t() @ y)                                      # B5
    c1 = row_mean(b4["zdz"], d.dim)
    b6 = run.gemm("gate_up.dgrad", E.norm_backward, dz, w.gate_up, layout="kn", partial=True,  # B6
                  x=x1, r=r1, c=c1, g=w.mlp_norm, dres=dx2)
    dx1 = b6["dx"]
    d_gate_up = run.timed("gate_up.wgrad", lambda: dz.t() @ h1)                                # B7
    # ---- attention: out-proj dX and dW are plain GEMMs; the RoPE backward is a map kernel
    d_attn = run.timed("o.dgrad", lambda: dx1 @ w.o)                                           # B8
    d_o = run.timed("o.wgrad", lambda: dx1.t() @ o)                                            # B9
    grads = run.timed("attention.bwd", lambda: step.attention.backward(attn_ctx, d_attn))
    dqkv = torch.empty_like(qkv)
    zdz = []
    start = 0
    for g4 in grads:            # (B, S, heads, head_dim) views                                # B1
        width = g4.shape[2] * g4.shape[3]
        cols = slice(start, start + width)
        res = run.map("rope.dgrad", E.rope_backward, g4, partial=True, out={"dz": dqkv[:, cols]},
                      y=qkv[:, cols], r=r, pos=step.pos, freq=step.freq[cols])
        zdz.append(res["zdz"])
        start += width
    c = row_mean(torch.cat(zdz), d.dim)
    b2 = run.gemm("qkv.dgrad", E.norm_backward, dqkv, w.qkv, layout="kn", partial=True,       # B2
                  x=x, r=r, c=c, g=w.attn_norm, dres=dx1)
    d_qkv = run.timed("qkv.wgrad", lambda: dqkv.t() @ h)                                      # B3
    grads_w = BlockWeights(qkv=d_qkv, o=d_o, gate_up=d_gate_up, down=d_down,
                           attn_norm=b2["dgamma"].sum(0).to(w.attn_norm.dtype),
                           mlp_norm=b6["dgamma"].sum(0).to(w.mlp_norm.dtype))
    return b2["dx"], grads_w


def lm_head_forward(step: Step, h: torch.Tensor, r: torch.Tensor, w_lm: torch.Tensor,
                    target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row log-sum-exp and target logit of logits = r * (h @ W_lm^T); logits are not written."""
    out = step.runner.gemm("lm_head", E.lm_head_lse, h, w_lm, r=r, target=target)
    return out["lse"], out["target_logit"]


def lm_head_backward(step: Step, x: torch.Tensor, h: torch.Tensor, r: torch.Tensor, w_lm: torch.Tensor,
                     g: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, scale: torch.Tensor,
                     chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropy + final-norm backward, in row chunks (dlogits exist for one chunk at a time):
    the LM head is recomputed with the softmax gradient in its epilogue, then the final norm's
    backward rides the dX GEMM. Returns (dx, dW_lm, dgamma)."""
    d, run = step.dims, step.runner
    M = x.shape[0]
    dx = torch.empty_like(x)
    dw = torch.zeros_like(w_lm)
    dgamma = torch.zeros(g.shape[0], dtype=torch.float32, device=g.device)
    for a in range(0, M, chunk_rows):
        b = min(M, a + chunk_rows)
        ce = run.gemm("lm_head.recompute", E.cross_entropy_backward, h[a:b], w_lm, partial=True,
                      r=r[a:b], lse=lse[a:b], target=target[a:b], scale=scale[a:b])
        dl = ce["D"]
        nb = run.gemm("lm_head.dgrad", E.norm_backward_first, dl, w_lm, layout="kn", partial=True,
                      out={"dx": dx[a:b]}, x=x[a:b], r=r[a:b], c=row_mean(ce["zdz"], d.dim), g=g)
        dgamma += nb["dgamma"].sum(0)
        run.timed("lm_head.wgrad", lambda: dw.addmm_(dl.t(), h[a:b]))
    return dx, dw, dgamma.to(g.dtype)
