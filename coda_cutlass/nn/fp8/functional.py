"""An FP8 Llama block's forward and backward (recipes "blockwise" and "blockwise_g16"), written once
over a ``Runner`` as the bf16 block is (nn/functional.py): every linear's forward, dX and dW GEMM
reads FP8 operands, and every operand is quantised by the kernel that produces it
(epilogues/fp8_block.py, fp8_block_grouped.py) where that kernel is a GEMM or a map kernel;
attention stays bf16 (SDPA). Which program and scaling each site runs is the recipe's site list
(kernels.py).

Each activation or gradient travels as an ``Fp8Operand``: its 1 x 128 codes and scales (the A of the
GEMM that consumes it) and its transposed copy with 128 x 1 scales (the A or W of the weight-gradient
GEMM, whose K is the token dimension: FP8 tensor cores read K-major operands only). The weights'
FP8 copies (both layouts) come from ``weights.Fp8Weights``, once per optimizer step.

Operands that no GEMM epilogue quantises (attention output, dz, dx, dqkv, an incoming gradient, and
the first block's h) are quantised by one map kernel each, both copies from one read of the tensor
(``quantize_rows_t``, ``norm_stats_fp8``: the transposed copy's 128 x 1 scales come from a first pass
over each block's 128 rows, docs/FP8.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CallError
from ..stats import row_mean, rstd
from .kernels import gemm_sites, map_sites
from .recipe import Fp8Recipe
from .weights import Fp8Weights


@dataclass
class Fp8Operand:
    """An (M, N) activation or gradient in FP8: ``q`` (M, N) with ``s`` (M, N/128) 1 x 128 scales,
    and ``qt`` (N, M) with ``st`` (N / group, M/128): the transposed copy, 128 x 1 runs of the
    original (``group`` > 1: one scale per run of ``group`` neighbouring columns, recipe
    ``"blockwise_g16"``'s activations)."""
    q: torch.Tensor | None
    s: torch.Tensor | None
    qt: torch.Tensor
    st: torch.Tensor
    group: int = 1

    def for_wgrad(self) -> "Fp8Operand":
        """What a weight gradient reads (qt, st): an activation saved for the backward without its
        1 x 128 codes and scales, which only the forward GEMM read."""
        return Fp8Operand(None, None, self.qt, self.st, self.group)

    @classmethod
    def of(cls, out: dict[str, torch.Tensor], name: str, tname: str, group: int = 1) -> "Fp8Operand":
        return cls(out[name], out[f"{name}_scale"], out[tname], out[f"{tname}_scale"], group)


def _map(step: Any, site: str, x: torch.Tensor, **operands: Any) -> dict:
    program, partial = map_sites(step.fp8)[site]
    return step.runner.map(site, program, x, partial=partial, **operands)


def quantize_operand(step: Any, site: str, x: torch.Tensor, activation: bool = False) -> Fp8Operand:
    """An operand no GEMM epilogue quantised: both copies by one map kernel (e4m3, power-of-two
    scales: the blockwise recipe's only formats, Fp8Recipe checks). ``activation``: the operand is
    a weight gradient's W (its transposed copy in the recipe's wgrad groups)."""
    return Fp8Operand.of(_map(step, site, x), "q", "qt", step.fp8.wgrad_group if activation else 1)


def first_norm_fp8(step: Any, x: torch.Tensor, g: torch.Tensor) -> tuple[Fp8Operand, torch.Tensor]:
    """(h, r) of the stream entering the first block: h = x * g quantised by one map kernel."""
    check_tokens(x.shape[0])
    out = _map(step, "norm0", x, g=g)
    return Fp8Operand.of(out, "h", "ht", step.fp8.wgrad_group), rstd(out["sumsq"], step.dims.dim, step.dims.eps)


# The norm-backward dX GEMMs write dx in bf16 and a map kernel (+ the transposed copy) quantises it:
# measured on the H200 (8B widths, M = 8192, in the block's sequence) the fused norm_backward_fp8
# epilogue took 2000 us at the QKV dX site (the FP8 GEMM alone: ~300 us; its kernel keeps a 1.8 KB
# stack frame, from the dgamma column sum), against ~350 + 245 us for this pair. docs/FP8.md.
# dgamma: the column sums of acc * x, in fp32 outside the epilogue (norm_backward_ax, listed at both
# sites in kernels.py).


def dgamma_of(step: Any, site: str, ax: torch.Tensor) -> torch.Tensor:
    """dgamma: the column sums of a norm-backward epilogue's acc * x, accumulated in fp32."""
    return step.runner.timed(site, lambda: ax.sum(0, dtype=torch.float32))


def check_tokens(M: int) -> None:
    """FP8 blocks take 128-token multiples only, in training and without gradients alike."""
    if M % 128:
        raise CallError(f"FP8 blocks need the token count B * S to be a multiple of 128, got {M}: every FP8 operand "
                        "is quantised with its transposed copy in blocks of 128 tokens (the weight gradients' "
                        "operands, whose K is the token dimension; the forward makes them too, with or without "
                        "gradients). Pad the batch to a multiple of 128 tokens (targets of padding "
                        "ignore_index, or an attention_mask), or run inference and evaluation at other lengths "
                        "in 16 bits: a model made with fp8=None loads this model's state_dict (docs/FP8.md)")


def _gemm(step: Any, site: str, a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
          **operands: Any) -> dict:
    """The GEMM of ``site`` with its program, operand formats, scaling and partial reductions from
    the recipe's site list (nn/fp8/kernels.py: what prebuilds and tuning see is what runs)."""
    rec: Fp8Recipe = step.fp8
    program, kinds, scaling, partial = gemm_sites(rec)[site]
    if partial:
        operands["partial"] = True
    return step.runner.gemm(site, program, a, w, fp8=rec.gemm(kinds, scaling), scale_a=sa, scale_b=sw,
                            **operands)


def _note(stats: Any, operands: dict[str, Any], forward: bool = False) -> None:
    """Operands' 1 x 128 scales into the block's statistics, when it keeps them (block_stats.py)."""
    if stats is not None:
        for name, op in operands.items():
            if isinstance(op, Fp8Operand):
                stats.record(name, op.s, op.q, forward=forward)


def block_forward_fp8(step: Any, x: torch.Tensor, h: Fp8Operand, r: torch.Tensor, w: Any, wq: Fp8Weights,
                      g_next: torch.Tensor | None, next_fp8: bool | Fp8Recipe, stats: Any = None
                      ) -> tuple[torch.Tensor, Any, torch.Tensor | None, tuple]:
    """One FP8 block: (x2, h2, r2, saved). h2 is an Fp8Operand when the next consumer is an FP8
    block (``next_fp8``: True, or that block's blockwise recipe, whose weight-gradient groups h2's
    transposed copy then has), the bf16 h of the bf16 programs otherwise (the LM head), None at
    the end. ``stats``: a BlockScaleStats that records each quantised operand's scales."""
    d = step.dims
    check_tokens(x.shape[0])
    wqkv, wo, wgu, wd = wq.get_all([(t, False) for t in (w.qkv, w.o, w.gate_up, w.down)])
    group = step.fp8.wgrad_group            # activations' transposed copies: the weight gradients' W
    qkv = _gemm(step, "qkv", h.q, h.s, wqkv.w, wqkv.scale, r=r, pos=step.pos, freq=step.freq)["D"]    # F4
    o, attn_ctx = step.attention.forward(qkv, step.batch, step.seq, d, step.dropout, step.mask)
    oq = quantize_operand(step, "o.quant", o, activation=True)
    f1 = _gemm(step, "o", oq.q, oq.s, wo.w, wo.scale, resid=x, g=w.mlp_norm)                        # F1
    x1, h1 = f1["D"], Fp8Operand.of(f1, "h", "ht", group)
    r1 = rstd(f1["sumsq"], d.dim, d.eps)                                                       # R1
    f2 = _gemm(step, "gate_up", h1.q, h1.s, wgu.w, wgu.scale, r=r1)                                  # F2
    yq = _map(step, "y.quant", f2["y"])                         # 1 x 128 runs of y: 256 tile columns
    z, y = f2["z"], Fp8Operand(yq["q"], yq["q_scale"], f2["yt"], f2["yt_scale"], group)
    if g_next is None:                                                                         # F3
        x2 = _gemm(step, "down.last", y.q, y.s, wd.w, wd.scale, resid=x1)["D"]
        h2 = r2 = None
    elif next_fp8:
        # written as the next block reads it: a "blockwise_g16" block after a "blockwise" one (or the
        # reverse) gets its own groups from this epilogue (that recipe's down program), not a requantisation
        nxt = next_fp8 if isinstance(next_fp8, Fp8Recipe) else step.fp8
        at = step if nxt == step.fp8 else dataclasses.replace(step, fp8=nxt)
        f3 = _gemm(at, "down", y.q, y.s, wd.w, wd.scale, resid=x1, g=g_next)
        x2, h2, r2 = f3["D"], Fp8Operand.of(f3, "h", "ht", nxt.wgrad_group), rstd(f3["sumsq"], d.dim, d.eps)   # R2
    else:
        f3 = _gemm(step, "down.to_bf16", y.q, y.s, wd.w, wd.scale, resid=x1, g=g_next)
        x2, h2, r2 = f3["D"], f3["h"], rstd(f3["sumsq"], d.dim, d.eps)
    _note(stats, {"h": h, "o": oq, "h1": h1, "y": y, "h2": h2}, forward=True)
    # the backward reads the activations' transposed copies only (their weight gradients' operands)
    return x2, h2, r2, (x, h.for_wgrad(), r, qkv, oq.for_wgrad(), x1, h1.for_wgrad(), r1, z, y.for_wgrad(), attn_ctx)


def block_backward_fp8(step: Any, saved: tuple, w: Any, wq: Fp8Weights, dx2: torch.Tensor,
                       dx2q: Fp8Operand | None, stats: Any = None
                       ) -> tuple[torch.Tensor, Fp8Operand, dict[str, torch.Tensor]]:
    """(dx, its FP8 copies for the previous block, the weight gradients by name)."""
    d, run = step.dims, step.runner
    x, h, r, qkv, oq, x1, h1, r1, z, y, attn_ctx = saved
    wqkv, wo, wgu, wd = wq.get_all([(t, False) for t in (w.qkv, w.o, w.gate_up, w.down)])
    if dx2q is None:                  # a gradient no coda epilogue quantised (the LM head's, a user's)
        dx2q = quantize_operand(step, "dx2.quant", dx2)
    # ---- MLP: SwiGLU backward in the down-proj dX GEMM, MLP norm backward in the gate/up dX GEMM
    b4 = _gemm(step, "down.dgrad", dx2q.q, dx2q.s, wd.wt, wd.scale_t, z=z, r=r1)                     # B4
    d_down = _gemm(step, "down.wgrad", dx2q.qt, dx2q.st, y.qt, y.st)["D"]                            # B5
    c1 = row_mean(b4["zdz"], d.dim)
    dzq = quantize_operand(step, "dz.quant", b4["dz"])
    b6 = _gemm(step, "gate_up.dgrad", dzq.q, dzq.s, wgu.wt, wgu.scale_t, x=x1, r=r1, c=c1, g=w.mlp_norm,  # B6
               dres=dx2)
    dx1 = b6["dx"]
    dx1q = quantize_operand(step, "dx1.quant", dx1)
    d_gate_up = _gemm(step, "gate_up.wgrad", dzq.qt, dzq.st, h1.qt, h1.st)["D"]                     # B7
    # ---- attention: out-proj dX and dW, attention backward in bf16, the RoPE backward map kernels
    d_attn = _gemm(step, "o.dgrad", dx1q.q, dx1q.s, wo.wt, wo.scale_t)["D"]                          # B8
    d_o = _gemm(step, "o.wgrad", dx1q.qt, dx1q.st, oq.qt, oq.st)["D"]                                # B9
    grads = run.timed("attention.bwd", lambda: step.attention.backward(attn_ctx, d_attn))
    dqkv = torch.empty_like(qkv)
    zdz, start = [], 0
    for g4 in grads:                                                                           # B1
        width = g4.shape[2] * g4.shape[3]
        cols = slice(start, start + width)
        res = _map(step, "rope.dgrad", g4, out={"dz": dqkv[:, cols]}, y=qkv[:, cols], r=r, pos=step.pos,
                   freq=step.freq[cols])
        zdz.append(res["zdz"])
        start += width
    c = row_mean(torch.cat(zdz), d.dim)
    dqkvq = quantize_operand(step, "dqkv.quant", dqkv)
    b2 = _gemm(step, "qkv.dgrad", dqkvq.q, dqkvq.s, wqkv.wt, wqkv.scale_t, x=x, r=r, c=c, g=w.attn_norm,  # B2
               dres=dx1)
    d_qkv = _gemm(step, "qkv.wgrad", dqkvq.qt, dqkvq.st, h.qt, h.st)["D"]                            # B3
    grads_w = {"qkv": d_qkv, "o": d_o, "gate_up": d_gate_up, "down": d_down,
               "attn_norm": dgamma_of(step, "qkv.dgamma", b2["ax"]),
               "mlp_norm": dgamma_of(step, "gate_up.dgamma", b6["ax"])}
    dxq = quantize_operand(step, "dx.quant", b2["dx"])
    _note(stats, {"dx2": dx2q, "dz": dzq, "dx1": dx1q, "dqkv": dqkvq, "dx": dxq})
    return b2["dx"], dxq, grads_w
