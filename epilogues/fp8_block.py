"""The epilogue programs of an FP8 Llama block (``coda_cutlass.nn.fp8``, blockwise recipe): the
block's bf16 programs with one change each: the output that feeds the next GEMM is stored in FP8
with its 1 x 128 scales (``cc.quantize(..., block=128)``), and, where a weight-gradient GEMM reads
it with the tokens as K, also as the transposed copy with 128 x 1 scales. ``acc`` is the scaled
product of the FP8 mainloop, so the math is the bf16 block's.

Forward:  norm_stats_fp8 (map kernel after the embedding, with h's transposed copy),
          residual_norm_stats_fp8 (out-proj and down-proj: the next norm's operand h = x * g
          quantised), swiglu_fp8 (gate/up: the SwiGLU output's transposed copy quantised),
          quantize_rows_t (map kernel: the attention output, both copies), quantize_rows (map
          kernel: the SwiGLU output's row-major copy).
Backward: norm_backward_ax (gate/up and QKV dX: the residual gradient in bf16), quantize_rows_t (map
          kernel: dz, dx, dqkv and an incoming gradient, both copies); norm_backward_fp8 quantises dx
          in the epilogue itself (slower, see nn/fp8/functional.py); swiglu_backward_fp8 quantises dz
          in the down-proj dX epilogue (slower than swiglu_backward_scaled + quantize_rows_t, not used
          by the recipes: docs/RESULTS.md, twentieth and twenty-second sessions).
"""

import torch

import coda_cutlass as cc

from .block import swiglu_grads

F32 = torch.float32
E4M3 = torch.float8_e4m3fn


# The bodies shared with the grouped recipe's programs (fp8_block_grouped.py): ``group`` is how many
# neighbouring columns share a transposed copy's run scale (cc.quantize(..., group=)).
def norm_stats_outputs(acc, g, group: int = 1) -> dict:
    h = acc * g
    return {"h": cc.quantize(h, block=128), "ht": cc.quantize(h, block=128, transpose=True, group=group),
            "sumsq": cc.row_sum(acc * acc)}


def both_copies(acc, group: int = 1) -> dict:
    return {"q": cc.quantize(acc, block=128), "qt": cc.quantize(acc, block=128, transpose=True, group=group)}


def residual_norm_outputs(acc, resid, g, group: int = 1) -> dict:
    x = acc + resid
    h = x * g
    return {"D": x, "h": cc.quantize(h, block=128), "ht": cc.quantize(h, block=128, transpose=True, group=group),
            "sumsq": cc.row_sum(x * x)}


def swiglu_outputs(acc, r, group: int = 1) -> dict:
    z = acc * r
    g, u = cc.pairs(z)
    y = cc.half_width(cc.silu(g) * u)
    return {"z": z, "y": y, "yt": cc.quantize(y, block=128, transpose=True, group=group)}


@cc.epilogue
def norm_stats_fp8(acc, g: cc.PerCol):
    """Map kernel over the residual stream x after the embedding: h = x * g quantised per 1 x 128
    run, its transposed copy (the QKV weight gradient's operand), and the per-row sum of x^2."""
    return norm_stats_outputs(acc, g)


@cc.epilogue
def quantize_rows(acc):
    """Map kernel: the SwiGLU output y (its transposed copy comes from the gate/up epilogue) quantised
    per 1 x 128 run."""
    return {"q": cc.quantize(acc, block=128)}


@cc.epilogue
def quantize_rows_t(acc):
    """Map kernel: a tensor no GEMM epilogue quantised (attention output, dz, dx, dqkv, an incoming
    gradient) as both operands it feeds: 1 x 128 runs (a dX or forward GEMM's A) and the transposed
    copy with 128 x 1 runs (a weight gradient's operand), from one read of the tensor."""
    return both_copies(acc)


@cc.epilogue
def residual_norm_stats_fp8(acc, resid: cc.Tile, g: cc.PerCol):
    """Out-proj / down-proj: x = acc + resid (D, bf16: the residual stream), h = x * g quantised (the
    next GEMM's A) with its transposed copy (the next GEMM's weight gradient reads h^T), and the
    per-row partials of x^2 (the next norm's r)."""
    return residual_norm_outputs(acc, resid, g)


@cc.epilogue
def swiglu_fp8(acc, r: cc.PerRow(F32)):
    """Gate/up: z = r * acc (saved for the backward, bf16), y = silu(gate) * up (half width) with
    its transposed copy quantised per 128 x 1 run down each column (the down-proj weight gradient
    reads y^T; the run is the tile's 128 rows). y itself leaves in bf16 for the ``quantize_rows``
    map kernel: a 1 x 128 run of y is 256 tile columns, and CUTLASS 4.2's blockwise mainloop has no
    256-wide tile over 128 x 128 weight blocks (docs/FP8.md)."""
    return swiglu_outputs(acc, r)


@cc.epilogue
def swiglu_fp8_rows(acc, r: cc.PerRow(F32)):
    """swiglu_fp8 with y also quantised per 1 x 128 run in the epilogue: for GEMMs whose tile can be
    256 wide (16-bit or per-tensor FP8 operands); the blockwise FP8 block uses swiglu_fp8."""
    z = acc * r
    g, u = cc.pairs(z)
    y = cc.half_width(cc.silu(g) * u)
    return {"z": z, "y": cc.quantize(y, block=128), "yt": cc.quantize(y, block=128, transpose=True)}


@cc.epilogue
def norm_backward_fp8(acc, x: cc.Tile, r: cc.PerRow(F32), c: cc.PerRow(F32), g: cc.PerCol, dres: cc.Tile):
    """Norm-backward dX (as norm_backward): dx = dres + acc * g - r^2 c x in bf16 (the next
    accumulation's dres) and quantised with its transposed copy (the dX and weight-gradient GEMMs
    that read it), dgamma partials."""
    dx = dres + acc * g - (r * r * c) * x
    return {"dx": dx, "dx8": cc.quantize(dx, block=128), "dx8t": cc.quantize(dx, block=128, transpose=True),
            "dgamma": cc.col_sum(acc * x)}


@cc.epilogue
def norm_backward_ax(acc, x: cc.Tile, r: cc.PerRow(F32), c: cc.PerRow(F32), g: cc.PerCol, dres: cc.Tile):
    """Norm-backward dX (as norm_backward) with acc * x as a bf16 tile instead of dgamma's column
    partials: the caller sums its columns in fp32. CUTLASS's column reduction keeps a whole tile of
    per-thread partials in a stack frame (1072 bytes for norm_backward over FP8 operands; the same
    change took the tensorwise QKV dX site from 1220 to 375 us at 8B widths, docs/RESULTS.md)."""
    return {"dx": dres + acc * g - (r * r * c) * x, "ax": acc * x}


@cc.epilogue
def swiglu_backward_fp8(acc, z: cc.PairTile, r: cc.PerRow(F32)):
    """Down-proj dX (acc = dy, M x f): the SwiGLU backward of swiglu_backward_scaled, with dz' = r * dz
    written as its two halves, dg (gate) and du (up), each M x f quantised per 1 x 128 run with its
    transposed copy in 128 x 1 runs, and the per-row partials of z . dz. Not used by the recipes: on
    the H200 the site ran 2176 us against 1093 + 470 for swiglu_backward_scaled and the
    quantize_rows_t map kernel (8B widths, M = 8192; docs/RESULTS.md). It has no D output, four
    block-quantised stores and a row sum: tests/gpu/test_quant_gpu.py checks that such a kernel is
    deterministic, and bench/probes/epilogue_outputs.py times it."""
    g, u, dg, du = swiglu_grads(acc, z)
    dgr, dur = dg * r, du * r
    return {"dg": cc.quantize(dgr, block=128), "dgt": cc.quantize(dgr, block=128, transpose=True),
            "du": cc.quantize(dur, block=128), "dut": cc.quantize(dur, block=128, transpose=True),
            "zdz": cc.row_sum(g * dg + u * du)}
