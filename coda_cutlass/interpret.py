"""The torch reference interpreter of the IR: the oracle every kernel is tested against.

Three precisions:

- ``"kernel"``: what the fused kernel computes, up to fp32 summation order: the accumulator and all
  math in fp32, operands read exactly, ``cast`` rounds, tile outputs rounded once to their dtype,
  and values flowing past an output store keep their fp32 value (as CUTLASS's stores pass through).
- ``"fp32"``: the same math with nothing rounded except explicit casts to a dtype (``cc.cast(x)``
  rounds as a store does: not here); give it fp32 copies of the inputs for the exact reference.
- ``"lowp"``: what eager torch does at the operand precision: the GEMM result and every op result
  rounded to the GEMM dtype. The error of this against ``"fp32"`` sets the test tolerance.

An FP8 program (``program.meta["fp8"]``) reads A and W in FP8 (or fp32 copies of the FP8 values)
and ``operands["scale_a"]`` / ``["scale_b"]``: ``acc`` is the fp32 product of A and W dequantised
with the scale of each element's block (``fp8/quantize.py``); at ``"lowp"`` it is rounded to bf16
(the epilogue dtype), as ``torch._scaled_mm(..., out_dtype=torch.bfloat16)`` returns it.

As the kernel does, an accumulated output (``cc.accumulate``) is written into the tensor passed for
it (rounded to that tensor's dtype) and returned as that tensor, and a reduction over an empty M or
N gives its identity (0 for sums, -inf for max, +inf for min). The interpreter checks nothing about
its arguments: ``cc.reference`` and ``k.reference`` check them first as the kernel call does
(``runtime/arguments.py``). Runs wherever the tensors are (CPU or GPU).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .config import WEIGHT_LAYOUTS
from .dtypes import F32, DType, as_dtype, round_to
from .errors import CallError
from .fp8.gemm import Fp8Gemm
from .fp8.quantize import dequantize
from .ir.nodes import HALF_LAYOUTS, OPERAND_OPS, TRANSPOSED_LAYOUTS, Kind, Node, Program
from .ir.ops import OPS, PAIR_OPS
from .partials import PartialLayout
from .quantization import block_amax, quantize_blocks, run_major, scales_from_amax

PRECISIONS = ("kernel", "fp32", "lowp")


def gemm_fp32(A: torch.Tensor, W: torch.Tensor, weight_layout: str) -> torch.Tensor:
    Wt = W.float().t() if weight_layout == "nk" else W.float()
    return A.float() @ Wt


def gemm_lowp(A: torch.Tensor, W: torch.Tensor, weight_layout: str, dtype: DType) -> torch.Tensor:
    a = A.to(dtype.torch)
    w = W.to(dtype.torch)
    wt = w.t() if weight_layout == "nk" else w
    if a.device.type == "cpu":   # CPU matmul in bf16 is slow and not what a GPU does; round fp32 instead
        return (a.float() @ wt.float()).to(dtype.torch).float()
    return (a @ wt).float()


def gemm_fp8(A: torch.Tensor, W: torch.Tensor, operands: Mapping[str, Any], fp8: Fp8Gemm, precision: str,
             lowp_dtype: DType) -> torch.Tensor:
    """The scaled product of FP8 operands: dequantise A and W per block, then one fp32 GEMM."""
    for name in ("scale_a", "scale_b"):
        if name not in operands:
            raise CallError(f"reference: missing {name} (the program has FP8 operands, {fp8.describe()})")
    a = dequantize(A, operands["scale_a"], fp8.scaling, "A")
    w = dequantize(W, operands["scale_b"], fp8.scaling, "W")
    acc = a @ w.t()
    return acc.to(lowp_dtype.torch).float() if precision == "lowp" else acc


def _reduce(x: torch.Tensor, fn: str, dim: int | None) -> torch.Tensor:
    if fn == "lse":
        return torch.logsumexp(x, dim)
    if dim is None:
        return x.sum() if fn == "sum" else (x.amax() if fn == "max" else x.amin())
    if fn == "sum":
        return x.sum(dim)
    return x.amax(dim) if fn == "max" else x.amin(dim)


def check_mode(precision: str, weight_layout: str = "nk") -> None:
    """Refuse an unknown ``precision`` or ``weight_layout`` (before any other argument check), as a
    CallError: a CodaError (what users catch) that is still the ValueError it used to be."""
    if precision not in PRECISIONS:
        raise CallError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if weight_layout not in WEIGHT_LAYOUTS:
        raise CallError(f"weight_layout must be 'nk' or 'kn', got {weight_layout!r}")


def interpret(program: Program, A: torch.Tensor, W: torch.Tensor, operands: Mapping[str, Any], *,
              weight_layout: str = "nk", precision: str = "kernel",
              partial_tile: tuple[int, int] | None = None, acc: torch.Tensor | None = None
              ) -> dict[str, torch.Tensor]:
    """Evaluate a typed program. Returns a dict output name -> tensor, like the compiled kernel.

    With ``acc`` (an (M, N) tensor), the program runs on it instead of on ``A @ W.T`` (a map
    kernel's reference; A and W are then ignored and may be None).

    With ``partial_tile=(tm, tn)``, reductions are returned as the per-tile partials the kernel
    writes (``partials.PartialLayout``) instead of finished values.
    """
    check_mode(precision, weight_layout)
    gemm_dtype = as_dtype(program.meta.get("gemm_dtype", "bf16"))
    fp8 = Fp8Gemm.from_meta(program.meta.get("fp8"))
    if acc is not None:
        M, N = acc.shape
        dev = acc.device
    else:
        M = A.shape[0]
        N = W.shape[0] if weight_layout == "nk" else W.shape[1]
        dev = A.device

    def lowp(x: torch.Tensor) -> torch.Tensor:
        return x.to(gemm_dtype.torch).float() if precision == "lowp" else x

    def operand(name: str, kind: Kind) -> torch.Tensor:
        if name not in operands:
            raise CallError(f"reference: missing operand '{name}'")
        v = operands[name]
        if kind == Kind.SCALAR and not isinstance(v, torch.Tensor):
            return torch.tensor(float(v), dtype=torch.float32, device=dev)
        t = torch.as_tensor(v).to(device=dev, dtype=torch.float32)
        if kind == Kind.SCALAR:         # a cc.DeviceScalar (or a one-element tensor for a cc.Scalar)
            return t.reshape(())
        if kind == Kind.ROW:
            return t.reshape(M, 1)
        if kind == Kind.COL:
            return t.reshape(1, N)
        return t

    vals: dict[int, torch.Tensor] = {}
    outs: dict[str, torch.Tensor] = {}
    updated: dict[str, torch.Tensor] = {}     # accumulated outputs, written back once all is read
    for n in program.nodes:
        if n.op == "acc" and acc is not None:
            vals[n.id] = acc.float()
        elif n.op == "acc" and fp8 is not None:
            vals[n.id] = gemm_fp8(A, W, operands, fp8, precision, gemm_dtype)
        elif n.op == "acc":
            vals[n.id] = gemm_lowp(A, W, weight_layout, gemm_dtype) if precision == "lowp" \
                else gemm_fp32(A, W, weight_layout)
        elif n.op in OPERAND_OPS:
            vals[n.id] = operand(n.attr("operand"), n.kind)
        elif n.op == "index":
            if n.attr("axis") == "row":
                vals[n.id] = torch.arange(M, dtype=torch.float32, device=dev).reshape(M, 1)
            else:
                vals[n.id] = torch.arange(N, dtype=torch.float32, device=dev).reshape(1, N)
        elif n.op == "pack":
            pd = as_dtype(n.attr("dtype"))
            a, b = (vals[i].expand(M, N) for i in n.inputs)
            if precision != "fp32":
                a, b = a.to(pd.torch).float(), b.to(pd.torch).float()
            vals[n.id] = OPS["pack"].ref(a, b)
        elif n.op in PAIR_OPS:
            shape = (M, N) if n.kind == Kind.TILE else (1, N)
            vals[n.id] = lowp(OPS[n.op].ref(*(vals[i].expand(shape) for i in n.inputs)))
        elif n.op == "const":
            vals[n.id] = torch.tensor(n.attr("value"), dtype=torch.float32, device=dev)
        elif n.op == "cast":
            v = vals[n.inputs[0]]
            if precision != "fp32" or not n.attr("as_stored"):     # cc.cast(x) rounds where a store does
                v = v.to(as_dtype(n.attr("dtype")).torch).float()
            vals[n.id] = v
        elif n.op in OPS:
            vals[n.id] = lowp(OPS[n.op].ref(*(vals[i] for i in n.inputs)))
        elif n.op == "store":
            layout = n.attr("layout", "tile")
            v = vals[n.inputs[0]]
            v = v.expand(M, 2 * N) if layout == "packed" else _stored(v.expand(M, N), layout)
            if n.attr("quant") == "block":
                codes, _ = quantize_blocks(v, _dtype(n), n.attr("block"), n.attr("pow2"),
                                           round_codes=precision != "fp32", rows=n.attr("group", 1))
                outs[n.attr("name")] = codes
            else:
                outs[n.attr("name")] = v.clone() if precision == "fp32" else round_to(v, _dtype(n))
            if n.attr("accumulate"):
                updated[n.attr("name")] = outs[n.attr("name")]
        elif n.op == "block_scale":
            v = _stored(vals[n.inputs[0]].expand(M, N), n.attr("layout"))
            fp8 = as_dtype(n.attr("qdtype"))
            scale = scales_from_amax(block_amax(v, n.attr("block"), n.attr("group", 1)), fp8, n.attr("pow2"))[0]
            outs[n.attr("name")] = run_major(scale)        # the kernel's layout (the next GEMM's scale_a)
        elif n.op == "reduce":
            outs[n.attr("name")] = _reduction(n, vals[n.inputs[0]].expand(M, N), precision, partial_tile,
                                              gemm_dtype)
        else:
            raise ValueError(f"interpreter: unknown op {n.op}")
    for name, v in updated.items():       # as the kernel: the tensor passed is updated in place
        target = operands[name]
        if isinstance(target, torch.Tensor):
            if any(st == 0 and sz > 1 for sz, st in zip(target.shape, target.stride())):
                raise CallError(f"'{name}' is accumulated in place (cc.accumulate) but the tensor passed is a "
                                "broadcast view (a stride of 0): pass one that owns its elements (.contiguous())")
            outs[name] = target.copy_(v)
    return {name: outs[name] for name in program.outputs}


def _stored(v: torch.Tensor, layout: str) -> torch.Tensor:
    """An (M, N) value as the output of ``layout`` stores it (half width, transposed)."""
    if layout in HALF_LAYOUTS:
        v = v[:, 0::2]
    return v.t().contiguous() if layout in TRANSPOSED_LAYOUTS else v


def _dtype(n: Node) -> DType:
    return n.dtype if n.dtype is not None else F32


def _reduction(n: Node, x: torch.Tensor, precision: str, partial_tile: tuple[int, int] | None,
               gemm_dtype: DType) -> torch.Tensor:
    fn, axis = n.attr("fn"), n.attr("axis")
    out_dtype = as_dtype(n.attr("out_dtype", "f32"))
    x = x.float()
    layout = PartialLayout.of(n)
    M, N = x.shape
    if M == 0 or N == 0:      # as the kernel: the identity of the reduction, nothing is launched
        shape = layout.partial_shape(M, N, partial_tile) if partial_tile else layout.result_shape(M, N)
        r = torch.full(shape, layout.identity, dtype=torch.float32, device=x.device)
        return r if partial_tile or precision == "fp32" else r.to(out_dtype.torch)
    if partial_tile is not None:
        return layout.reference(x, partial_tile)
    if axis == "segment":
        r = x.reshape(M, N // n.attr("width"), n.attr("width")).sum(2)
    else:
        dim = {"row": 1, "col": 0, "all": None}[axis]
        r = _reduce(x, fn, dim)
    if precision == "fp32":
        return r
    if precision == "lowp":   # eager torch at the operand precision returns the reduction rounded
        r = r.to(gemm_dtype.torch).float()
    return r.to(out_dtype.torch)
