"""An FP8 Llama block's forward and backward under per-tensor scaling (recipe "tensorwise"), written
once over a ``Runner`` as the blockwise block is (functional.py): every linear's forward, dX and dW
GEMM is a per-tensor FP8 GEMM, and every operand is quantised by the kernel that produces it with a
delayed scale (delayed.py), beside its amax:

- forward: h1 and the next block's h by the out-proj / down-proj epilogues (with their transposed
  copies), y by the gate/up epilogue (with its transposed copy), the attention output by a map kernel;
- backward: dz by the down-proj dX epilogue as its gate and up halves with their transposed copies,
  dx1 and dx by the norm-backward dX epilogues (in bf16 for the residual, in FP8, transposed), dqkv
  by the RoPE-backward map kernels (with its transposed copy).

A per-tensor scale survives a transpose, so a transposed copy is the same codes, written by the
kernel that quantises, map kernels too (the attention output, the first block's h, a gradient from
outside): no copy is made in torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ... import epilogues as E
from ...errors import ConfigError
from ..stats import row_mean, rstd
from .delayed import DelayedScales
from .functional import check_tokens, dgamma_of
from .kernels import programs
from .weights import Fp8Weight, Fp8Weights

# the tensors a block quantises, by name -> the recipe's format for them
ACTIVATIONS = ("h", "o", "h1", "y", "h2")
GRADIENTS = ("dx2", "dz", "dx1", "dqkv", "dx")


@dataclass
class TensorOperand:
    """An (M, N) activation or gradient in FP8 with one scale ``s`` (0-dim fp32): codes ``q`` (M, N)
    and the transposed copy ``qt`` (N, M), the same codes, written by the kernel that quantised it."""
    q: torch.Tensor | None
    s: torch.Tensor
    qt: torch.Tensor

    def for_wgrad(self) -> "TensorOperand":
        """What a weight gradient reads (qt, s): an activation saved for the backward without its
        row-major codes, which only the forward GEMM read."""
        return TensorOperand(None, self.s, self.qt)


def new_scales(recipe: Any) -> DelayedScales:
    return DelayedScales(recipe, {**{n: recipe.activation for n in ACTIVATIONS},
                                  **{n: recipe.gradient for n in GRADIENTS}})


def _gemm(step: Any, site: str, program: Any, a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor,
          sw: torch.Tensor, kinds: tuple[str, str], **operands: Any) -> dict:
    return step.runner.gemm(site, program, a, w, fp8=step.fp8.gemm(kinds, "tensor"), scale_a=sa, scale_b=sw,
                            **operands)


def _fwd(step: Any, site: str, program: Any, a: TensorOperand, w: Fp8Weight, **operands: Any) -> dict:
    return _gemm(step, site, program, a.q, a.s, w.w, w.scale, ("activation", "weight"), **operands)


def _dgrad(step: Any, site: str, program: Any, grad: TensorOperand, w: Fp8Weight, **operands: Any) -> dict:
    return _gemm(step, site, program, grad.q, grad.s, w.wt, w.scale_t, ("gradient", "weight"), **operands)


def _wgrad(step: Any, site: str, grad: TensorOperand, a: TensorOperand, **operands: Any) -> dict:
    """dW = grad^T a: K is the token dimension, both operands their transposed copies."""
    return _gemm(step, site, E.identity, grad.qt, grad.s, a.qt, a.s, ("gradient", "activation"), **operands)


def _with_amax(out: dict) -> tuple[dict, torch.Tensor]:
    """A launch's outputs and its amax as reported: 0-dim, or per-tile partials (a kernel run with
    ``partial``), which the delayed scales finish in their per-step fold (no launch here)."""
    return out, out["amax"]


def _on(sc: DelayedScales, device: torch.device) -> Any:
    return lambda name, launch: sc.quantize(name, launch, device)


def quantize_map(step: Any, sc: DelayedScales, name: str, site: str, x: torch.Tensor) -> TensorOperand:
    """A tensor no GEMM produced, by a map kernel, with its transposed copy (in its kind's format)."""
    P = programs(step.fp8)
    program = P.quantize_gradient if name in GRADIENTS else P.quantize_activation
    out, s = sc.quantize(name, lambda s: _with_amax(step.runner.map(site, program, x, partial=True, s=s)), x.device)
    return TensorOperand(out["q"], s, out["qt"])


# How the blocks remake their weight copies after an optimizer step: "compiled" (torch.compile'd
# torch, a block's four in one call) or "map" (the runner's quantize_tensor map kernel, a launch a
# weight, bit for bit the same codes). In the twenty-sixth session the map path was host-bound (8B
# block: 3.4 ms of wall time against 1.16; a 1B model stepped 38% slower); since its scale comes from
# one compiled call it took 1.34 ms against 1.70 (70B: 3.39 against 5.13) on the H200 in the
# thirtieth. In a whole 1B step (H100, thirty-first; a block's four scales in one compiled call) its
# kernels took 2.8 ms against 5.7 but its launches 30 ms of host time against 18, in a step that is
# host-bound already, so "compiled" stays the default.
WEIGHT_COPIES = ("compiled", "map")
weight_copies_by = "compiled"
# How many blocks' compiled copies one call makes: above 1, a model makes its blocks' stale copies
# before its first block, that many blocks' in a call (support.make_weight_copies), not a call a block. The
# 1B "tensorwise" step is host-bound (H100, thirty-first session: 104.5 ms of wall time for ~97 of
# kernels) and the copies' calls are ~18 ms of its host time, about 0.7 ms a call, half of it the call
# itself. 1 (each block its own, as measured) until a step is timed with more.
copies_blocks_per_call = 1


# Whether a model folds its blocks' delayed scales together before its first block (one multi-tensor
# max and one compiled fold for all, DelayedScales.begin_steps_together) rather than a fold a block in
# each block's forward: the fold is the other compiled call a block and step, ~0.7 ms of host time
# each in the host-bound 1B step. False (as measured) until a step is timed with it.
folds_together = False


def folding_together() -> bool:
    """``folds_together``, checked."""
    if not isinstance(folds_together, bool):
        raise ConfigError(f"nn.fp8.tensorwise.folds_together must be True or False, got {folds_together!r}")
    return folds_together


def copies_per_call() -> int:
    """How many blocks' compiled weight copies one call makes: ``copies_blocks_per_call``, checked, and 1
    where the copies are not the compiled ones (the map kernel's go a launch a weight)."""
    n = copies_blocks_per_call
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"nn.fp8.tensorwise.copies_blocks_per_call must be a whole number >= 1, got {n!r}")
    return n if weight_copies_by == "compiled" else 1


def weight_pairs(w: Any) -> list[tuple[torch.Tensor, bool]]:
    """A block's (or BlockWeights') weights as the copies take them: (W, halves) for qkv, o, down and
    the gate/up weight, whose W^T columns go gate rows first (``halves``)."""
    return [(w.qkv, False), (w.o, False), (w.down, False), (w.gate_up, True)]


def weight_copies(step: Any, w: Any, wq: Fp8Weights) -> tuple[Fp8Weight, ...]:
    """(qkv, o, down, gate/up) FP8 copies, remade as ``weight_copies_by`` says."""
    if weight_copies_by not in WEIGHT_COPIES:
        raise ConfigError(f"nn.fp8.tensorwise.weight_copies_by must be one of {WEIGHT_COPIES}, got {weight_copies_by!r}")
    pairs = weight_pairs(w)
    if weight_copies_by == "map":
        return tuple(wq.get_all(pairs, runner=step.runner))
    return tuple(wq.get_all(pairs))


def block_forward(step: Any, x: torch.Tensor, h: TensorOperand, r: torch.Tensor, w: Any, wq: Fp8Weights,
                  sc: DelayedScales, g_next: torch.Tensor | None, next_fp8: bool
                  ) -> tuple[torch.Tensor, Any, torch.Tensor | None, tuple]:
    """One block: (x2, h2, r2, saved); h2 a TensorOperand when the next consumer is an FP8 block."""
    d, P = step.dims, programs(step.fp8)
    check_tokens(x.shape[0])
    quant = _on(sc, x.device)
    wqkv, wo, wd, wgu = weight_copies(step, w, wq)
    qkv = _fwd(step, "qkv", E.rope, h, wqkv, r=r, pos=step.pos, freq=step.freq)["D"]
    o, attn_ctx = step.attention.forward(qkv, step.batch, step.seq, d, step.dropout, step.mask)
    oq = quantize_map(step, sc, "o", "o.quant", o)
    f1, s1 = quant("h1", lambda s: _with_amax(_fwd(step, "o", P.residual_norm_stats_t, oq, wo, partial=True,
                                                         resid=x, g=w.mlp_norm, s=s)))
    x1, h1, r1 = f1["D"], TensorOperand(f1["h"], s1, f1["ht"]), rstd(f1["sumsq"], d.dim, d.eps)
    f2, sy = quant("y", lambda s: _with_amax(_fwd(step, "gate_up", P.swiglu_t, h1, wgu, partial=True, r=r1, s=s)))
    z, y = f2["z"], TensorOperand(f2["y"], sy, f2["yt"])
    if g_next is None:
        x2 = _fwd(step, "down.last", E.residual_add, y, wd, resid=x1)["D"]
        h2 = r2 = None
    elif next_fp8:
        f3, s2 = quant("h2", lambda s: _with_amax(_fwd(step, "down", P.residual_norm_stats_t, y, wd,
                                                             partial=True, resid=x1, g=g_next, s=s)))
        x2, h2, r2 = f3["D"], TensorOperand(f3["h"], s2, f3["ht"]), rstd(f3["sumsq"], d.dim, d.eps)
    else:
        f3 = _fwd(step, "down.to_bf16", E.residual_norm_stats, y, wd, partial=True, resid=x1, g=g_next)
        x2, h2, r2 = f3["D"], f3["h"], rstd(f3["sumsq"], d.dim, d.eps)
    # the backward reads the activations' transposed copies only (their weight gradients' operands)
    return x2, h2, r2, (x, h.for_wgrad(), r, qkv, oq.for_wgrad(), x1, h1.for_wgrad(), r1, z, y.for_wgrad(), attn_ctx)


def block_backward(step: Any, saved: tuple, w: Any, wq: Fp8Weights, sc: DelayedScales, dx2: torch.Tensor,
                   dx2q: TensorOperand | None) -> tuple[torch.Tensor, TensorOperand, dict[str, torch.Tensor]]:
    """(dx, its FP8 copy for the previous block, the weight gradients by name)."""
    d, run, P = step.dims, step.runner, programs(step.fp8)
    quant = _on(sc, dx2.device)
    x, h, r, qkv, oq, x1, h1, r1, z, y, attn_ctx = saved
    wqkv, wo, wd, wgu = weight_copies(step, w, wq)
    if not isinstance(dx2q, TensorOperand):      # a gradient no coda epilogue quantised (the LM head's, a user's)
        dx2q = quantize_map(step, sc, "dx2", "dx2.quant", dx2)
    M, f = dx2.shape[0], d.ffn_dim
    # ---- MLP: dz as its gate and up halves (one M x 2f buffer; W_gu^T's columns in the same order);
    # its transposed copy with the gate and up rows interleaved, as W_gu's rows are, so that one
    # weight-gradient GEMM makes dW_gu in the parameter's order (two half GEMMs before)
    dz8 = torch.empty(M, 2 * f, dtype=step.fp8.gradient, device=dx2.device)
    dzt8 = torch.empty(2 * f, M, dtype=step.fp8.gradient, device=dx2.device)
    halves = {"dg": dz8[:, :f], "du": dz8[:, f:], "dgt": dzt8[0::2], "dut": dzt8[1::2]}

    def down_dgrad(s: torch.Tensor) -> tuple[dict, tuple[torch.Tensor, ...]]:
        out = _dgrad(step, "down.dgrad", P.swiglu_backward_t, dx2q, wd, partial=True, out=halves, z=z, r=r1, s=s)
        return out, (out["amax_g"], out["amax_u"])

    b4, sdz = quant("dz", down_dgrad)
    dzq = TensorOperand(dz8, sdz, dzt8)
    d_down = _wgrad(step, "down.wgrad", dx2q, y)["D"]
    c1 = row_mean(b4["zdz"], d.dim)
    b6, sdx1 = quant("dx1", lambda s: _with_amax(_dgrad(step, "gate_up.dgrad", P.norm_backward_t, dzq, wgu,
                                                              partial=True, x=x1, r=r1, c=c1, g=w.mlp_norm,
                                                              dres=dx2, s=s)))
    dx1, dx1q = b6["dx"], TensorOperand(b6["dx8"], sdx1, b6["dx8t"])
    d_gate_up = _wgrad(step, "gate_up.wgrad", dzq, h1)["D"]           # rows gate, up interleaved
    # ---- attention: out-proj dX and dW, attention backward in bf16, the RoPE backward map kernels
    d_attn = _dgrad(step, "o.dgrad", E.identity, dx1q, wo)["D"]
    d_o = _wgrad(step, "o.wgrad", dx1q, oq)["D"]
    grads = run.timed("attention.bwd", lambda: step.attention.backward(attn_ctx, d_attn))
    dqkv8 = torch.empty(qkv.shape, dtype=step.fp8.gradient, device=qkv.device)
    dqkvt8 = torch.empty(qkv.shape[1], qkv.shape[0], dtype=step.fp8.gradient, device=qkv.device)

    def rope_dgrad(s: torch.Tensor) -> tuple[dict, list[torch.Tensor]]:
        zdz, amax, start = [], [], 0
        for g4 in grads:
            width = g4.shape[2] * g4.shape[3]
            cols = slice(start, start + width)
            res = run.map("rope.dgrad", P.rope_backward_t, g4, partial=True,
                          out={"dz": dqkv8[:, cols], "dzt": dqkvt8[cols]}, y=qkv[:, cols], r=r, pos=step.pos,
                          freq=step.freq[cols], s=s)
            zdz.append(res["zdz"])
            amax.append(res["amax"])
            start += width
        return {"zdz": torch.cat(zdz)}, amax

    b1, sdq = quant("dqkv", rope_dgrad)
    dqkvq = TensorOperand(dqkv8, sdq, dqkvt8)
    c = row_mean(b1["zdz"], d.dim)
    b2, sdx = quant("dx", lambda s: _with_amax(_dgrad(step, "qkv.dgrad", P.norm_backward_t, dqkvq, wqkv,
                                                            partial=True, x=x, r=r, c=c, g=w.attn_norm, dres=dx1,
                                                            s=s)))
    d_qkv = _wgrad(step, "qkv.wgrad", dqkvq, h)["D"]
    grads_w = {"qkv": d_qkv, "o": d_o, "gate_up": d_gate_up, "down": d_down,
               "attn_norm": dgamma_of(step, "qkv.dgamma", b2["ax"]),
               "mlp_norm": dgamma_of(step, "gate_up.dgamma", b6["ax"])}
    return b2["dx"], TensorOperand(b2["dx8"], sdx, b2["dx8t"]), grads_w
