"""A call's arguments as the kernel and ``cc.reference`` both take them (``CallSpec``, one per
program): the operand names (a missing one, an unknown one and what it was probably meant to be),
leading batch dimensions flattened like ``nn.Linear`` (``flatten_batch``), and the reference's
checks of each operand, which are the kernel's (``checks.py``, same messages) without those of
memory layout (strides, alignment, a CUDA device).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from ..dtypes import F32, DType
from ..errors import CallError
from ..ir.nodes import OPERAND_OPS, TRANSPOSED_LAYOUTS, Kind, Program, layout_columns, layout_shape

# outputs whose rows are not the GEMM's rows m (transposed outputs and their scales): returned as
# they are when A has leading batch dimensions
COLUMN_MAJOR_OUTPUTS = TRANSPOSED_LAYOUTS | {"scale_t"}
from . import checks


@dataclass(frozen=True)
class OperandSpec:
    """One keyword argument of the call: an input operand or an accumulated output."""
    name: str
    kind: Kind
    dtype: DType
    packed: bool = False      # an M x 2N tile of 16-bit pairs (cc.PairTile)
    inout: bool = False       # an accumulated output: read, then updated in place
    used: bool = True         # read by the program (an unused operand is still checked)
    device: bool = False      # a cc.DeviceScalar: a one-element fp32 tensor, passed by pointer

    @property
    def host_scalar(self) -> bool:
        """A runtime number passed by value (cc.Scalar)."""
        return self.kind == Kind.SCALAR and not self.device

    def columns(self, N: int) -> int:
        return 2 * N if self.packed else N


@dataclass(frozen=True)
class CallSpec:
    """What a call of one typed program takes and returns, beyond A and W (a map kernel's: X)."""
    program: str
    operands: tuple[OperandSpec, ...]            # call order: inputs, then accumulated outputs
    tile_outputs: tuple[tuple[str, str], ...]    # (name, layout) of tile outputs
    row_reductions: tuple[str, ...]              # finished with one value (or row) per row m
    segment_widths: tuple[tuple[str, int], ...]
    uses_index: bool                             # element indices must stay exact in fp32
    positional: tuple[str, ...] = ("A", "W")     # the call's positional tensors (a map kernel: X)
    output_dtypes: tuple[tuple[str, DType], ...] = ()   # of tile outputs (what out= tensors hold)
    constants: tuple[tuple[str, float | int], ...] = ()  # compile-time constants (not call arguments)

    @classmethod
    def of(cls, ir: Program, positional: tuple[str, ...] = ("A", "W")) -> "CallSpec":
        inout = [n.attr("name") for n in ir.nodes if n.op == "store" and n.attr("accumulate")]
        read = {n.attr("operand") for n in ir.nodes if n.op in OPERAND_OPS}
        ops = [OperandSpec(o.name, o.kind, o.dtype, o.packed, used=o.name in read, device=o.device)
               for o in ir.operands if o.name not in inout]
        ops += [OperandSpec(o.name, o.kind, o.dtype, inout=True) for name in inout
                for o in ir.operands if o.name == name]
        reductions = [n for n in ir.nodes if n.op == "reduce"]
        segments = tuple((n.attr("name"), n.attr("width")) for n in reductions if n.attr("axis") == "segment")
        return cls(
            program=ir.name,
            operands=tuple(ops),
            tile_outputs=tuple((n.attr("name"), n.attr("layout", "tile")) for n in ir.nodes
                               if n.op == "store" and not n.attr("accumulate"))
            + tuple((n.attr("name"), "scale_t" if n.attr("layout") in TRANSPOSED_LAYOUTS else "scale")
                    for n in ir.nodes if n.op == "block_scale"),
            row_reductions=tuple(n.attr("name") for n in reductions if n.attr("axis") in ("row", "segment")),
            segment_widths=segments,
            uses_index=any(n.op == "index" for n in ir.nodes) or bool(segments),
            positional=positional,
            output_dtypes=tuple((n.attr("name"), n.dtype or F32) for n in ir.nodes     # (as the interpreter)
                                if n.op == "store" and not n.attr("accumulate")),
            constants=tuple(ir.meta.get("constants", {}).items()),
        )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.operands)

    def signature(self) -> str:
        return f"k({', '.join(self.positional + tuple(f'{n}=...' for n in self.names))})"

    # ------------------------------------------------------------------ names
    def check_names(self, given: Iterable[str], keywords: Iterable[str] = ()) -> None:
        """Every operand given once, nothing else. ``keywords`` are the call's own options (a
        misspelt one lands among the operands and is suggested too)."""
        given = list(given)
        missing = [n for n in self.names if n not in given]
        unknown = [n for n in given if n not in self.names]
        if not missing and not unknown:
            return
        parts = []
        constants = dict(self.constants)
        for name in unknown:
            if name in constants:
                # a constant parameter (eps: float = 1e-6) looks like an argument in the program's
                # signature, but its value is baked into the kernel: say so, and how to change it
                parts.append(f"'{name}' is a compile-time constant of {self.program} (here {constants[name]!r}), "
                             f"not an operand: set it with constants={{'{name}': ...}} (one kernel per value), or "
                             "annotate it cc.Scalar to pass it at each call")
                continue
            close = difflib.get_close_matches(name, missing + list(keywords), n=1, cutoff=0.6)
            if close:
                if close[0] in missing:
                    missing.remove(close[0])
                parts.append(f"unknown operand '{name}'; did you mean '{close[0]}'?")
            else:
                parts.append(f"unknown operand '{name}'")
        if missing:
            parts.insert(0, f"missing operand{'s' if len(missing) > 1 else ''} "
                            + ", ".join(f"'{n}'" for n in missing))
        raise CallError(f"{self.program}: {'; '.join(parts)}. The call is {self.signature()}")

    # ------------------------------------------------------------------ shapes
    def check_extent(self, M: int, N: int) -> None:
        """What programs with element indices or segment sums need of M and N."""
        if not self.uses_index:
            return
        if max(M, N) >= 1 << 24:
            raise CallError(f"{self.program}: M={M}, N={N}: programs that use element indices (gather, "
                            "row_index/col_index, segment sums) need M and N below 2^24 (exact in fp32)")
        for name, width in self.segment_widths:
            if N % width:
                raise CallError(f"{self.program}: output '{name}' sums {width}-wide segments, but N={N} is not "
                                f"a multiple of {width}")

    def check_operand(self, o: OperandSpec, t: Any, M: int, N: int, device: torch.device, *, tma: bool = True,
                      fp32_ok: bool = False) -> int:
        """Checks one tensor operand; returns a tile's row stride (0 for a vector)."""
        if o.kind == Kind.TILE:
            return checks.check_tile(o.name, t, M, o.columns(N), o.dtype, device, tma=tma, fp32_ok=fp32_ok)
        if o.device:
            checks.check_device_scalar(o.name, t, device)
        elif o.kind == Kind.ROW:
            checks.check_vector(o.name, t, M, "row (length M)", o.dtype, device, tma=tma, fp32_ok=fp32_ok)
        else:
            checks.check_vector(o.name, t, N, "column (length N)", o.dtype, device, tma=tma, fp32_ok=fp32_ok)
        return 0

    def check_out(self, out: Mapping[str, Any] | None) -> None:
        """``out=`` is a dict that names tile outputs (checked before the operands, as the kernel does)."""
        if out is None:
            return
        if not isinstance(out, Mapping):
            raise CallError(f"out: expected a dict of tile output name -> tensor, got {type(out).__name__}")
        checks.check_out_names(self.program, out, [n for n, _ in self.tile_outputs])

    def check_reference(self, A: Any, W: Any, operands: Mapping[str, Any], dtype: DType, weight_layout: str, *,
                        fp32_ok: bool = False, keywords: Iterable[str] = (), w_dtype: DType | None = None,
                        out: Mapping[str, Any] | None = None) -> tuple[int, int, int]:
        """The kernel call's checks, without those of memory layout; returns (M, N, K). ``w_dtype``:
        W's dtype when it is not ``dtype`` (FP8). ``out``: tensors given for tile outputs."""
        self.check_names(operands, keywords)
        self.check_out(out)
        M, N, K = checks.check_gemm_shapes(A, W, dtype, weight_layout, fp32_ok, w_dtype)
        self.check_extent(M, N)
        for o in self.operands:
            if o.host_scalar:
                checks.check_scalar(o.name, operands[o.name])
            else:
                self.check_operand(o, operands[o.name], M, N, A.device, tma=False, fp32_ok=fp32_ok)
        written = {o.name: operands[o.name] for o in self.operands if o.inout}
        layouts, dtypes = dict(self.tile_outputs), dict(self.output_dtypes)
        for name, t in (out or {}).items():
            if layouts[name] in ("scale", "scale_t"):
                raise CallError(f"{self.program}: out['{name}']: block scales are allocated by the kernel call")
            rows, cols = layout_shape(layouts[name], M, N)
            checks.check_tile(f"out['{name}']", t, rows, cols, dtypes[name], A.device, tma=False, fp32_ok=fp32_ok)
            written[name] = t
        if written:
            read = {"A": A, "W": W}
            read.update((o.name, operands[o.name]) for o in self.operands
                        if o.used and not o.inout and not o.host_scalar)
            checks.check_no_overlap(written, read)
        return M, N, K


# ---------------------------------------------------------------------------------------------- batch
@dataclass(frozen=True)
class Batch:
    """The leading dimensions of a call's A (e.g. (B, S) of a (B, S, K) activation)."""
    shape: tuple[int, ...]

    def restore(self, spec: CallSpec, result: dict[str, torch.Tensor], given: Mapping[str, torch.Tensor],
                partial: bool = False) -> dict[str, torch.Tensor]:
        """Outputs with one row per flattened row m get the leading dimensions back; a tensor the
        caller passed for an output (accumulated, ``out=``) is returned as passed. Column and total
        reductions, and partials (``partial=True``), are returned as they are."""
        per_row = {n for n, layout in spec.tile_outputs if layout not in COLUMN_MAJOR_OUTPUTS} \
            | (set() if partial else set(spec.row_reductions))
        out = {}
        for name, v in result.items():
            if name in given:
                out[name] = given[name]
            elif name in per_row:
                out[name] = v.view(self.shape + tuple(v.shape[1:]))
            else:
                out[name] = v
        return out


def _flat(name: str, t: torch.Tensor, batch: tuple[int, ...], tail: tuple[int, ...], what: str = ""
          ) -> torch.Tensor:
    expected = batch + tail
    if tuple(t.shape) != expected:
        raise CallError(f"{name}: shape is {tuple(t.shape)}, expected {expected}{what} (A has the leading "
                        f"dimensions {batch})")
    rows = math.prod(batch)
    try:
        return t.view((rows,) + tail)
    except RuntimeError:
        raise CallError(f"{name}: its leading dimensions {batch} cannot be flattened to {rows} rows without a "
                        f"copy (strides {t.stride()}); call .contiguous()") from None


def flatten_batch(spec: CallSpec, A: torch.Tensor, W: Any, operands: Mapping[str, Any], weight_layout: str,
                  out: Mapping[str, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, dict[str, Any], dict[str, torch.Tensor] | None, Batch]:
    """A (..., K) as (M, K) with M the product of the leading dimensions, like ``nn.Linear``; tile
    operands and ``out`` tensors (..., N) as (M, N) and per-row vectors (...) as (M,), all as views
    (accumulated outputs are updated through them). Per-column vectors and scalars are unchanged."""
    batch = tuple(A.shape[:-1])
    flat_A = _flat("A", A, batch, (A.shape[-1],))
    ops = dict(operands)
    if not (isinstance(W, torch.Tensor) and W.dim() == 2):
        return flat_A, ops, dict(out) if out else out, Batch(batch)   # the GEMM checks report W
    N = W.shape[0] if weight_layout == "nk" else W.shape[1]
    for o in spec.operands:
        t = operands.get(o.name)
        if not isinstance(t, torch.Tensor) or o.kind in (Kind.SCALAR, Kind.COL):
            continue
        if o.kind == Kind.ROW:
            ops[o.name] = _flat(o.name, t, batch, (), ": one value per row")
        else:
            ops[o.name] = _flat(o.name, t, batch, (o.columns(N),))
    flat_out = None
    if out:
        columns = dict(spec.tile_outputs)
        flat_out = {name: (_flat(f"out['{name}']", t, batch, (layout_columns(columns[name], N),))
                           if name in columns and columns[name] not in COLUMN_MAJOR_OUTPUTS
                           and isinstance(t, torch.Tensor) else t)
                    for name, t in out.items()}
    return flat_A, ops, flat_out, Batch(batch)
