"""Type binding: give every operand, node and output its element type.

Rules (they mirror what the kernel does):
- tensor operands default to the GEMM operand dtype, runtime scalars are fp32;
- the accumulator and all compute nodes are fp32; ``cast`` rounds to its dtype (its value is then
  used as fp32 again); ``cc.cast(x)`` without one rounds as a tile output does, to the GEMM dtype;
- tile outputs default to the GEMM operand dtype; reductions are fp32 partials, finished to fp32
  unless another dtype is asked for; an accumulated output has the dtype of the tensor it updates.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from ..dtypes import F32, FLOAT_DTYPES, FP8_DTYPES, INDEX_DTYPES, DType, as_dtype
from ..errors import EpilogueError
from ..ir.nodes import OPERAND_OPS, Kind, Node, Operand, Program, make_attrs
from ..ir.ops import PACK_OPS, UNPACK_OPS


def bind_types(program: Program, dtype: DType, operand_dtypes: Mapping[str, Any] | None = None,
               output_dtypes: Mapping[str, Any] | None = None) -> Program:
    operand_dtypes = dict(operand_dtypes or {})
    output_dtypes = dict(output_dtypes or {})
    op_names = {o.name for o in program.operands}
    inout = {n.attr("name") for n in program.nodes if n.op == "store" and n.attr("accumulate")}
    for k in operand_dtypes:
        if k not in op_names or k in inout:
            raise EpilogueError(f"input_dtypes names '{k}', which is not an operand", program=program.name)
    for k in output_dtypes:
        if k not in program.outputs:
            raise EpilogueError(f"output_dtypes names '{k}', which is not an output (outputs: "
                                f"{', '.join(program.outputs)})", program=program.name)

    def out_dtype(name: str, default: DType, allowed: tuple[DType, ...] = FLOAT_DTYPES + FP8_DTYPES) -> DType:
        if name in output_dtypes:
            return as_dtype(output_dtypes[name], what=f"dtype of output '{name}'", allowed=allowed)
        return default

    operands: list[Operand] = []
    for o in program.operands:
        if o.name in inout:
            d = out_dtype(o.name, dtype)
        elif o.name in operand_dtypes:
            d = as_dtype(operand_dtypes[o.name], what=f"dtype of operand '{o.name}'")
        elif o.dtype is not None:
            d = o.dtype
        else:
            d = F32 if o.kind == Kind.SCALAR else dtype
        if o.kind == Kind.SCALAR and d != F32:
            raise EpilogueError(f"scalar operand '{o.name}' is fp32; other dtypes are not supported",
                                program=program.name)
        if d in INDEX_DTYPES and o.kind not in (Kind.ROW, Kind.COL):
            raise EpilogueError(f"operand '{o.name}': integer dtypes ({d.torch}) are only supported for "
                                "cc.PerRow / cc.PerCol index vectors", program=program.name)
        if o.packed and d.bits != 16:
            raise EpilogueError(f"cc.PairTile operand '{o.name}' holds 16-bit pairs (bf16 or f16), not "
                                f"{d.torch}", program=program.name)
        operands.append(replace(o, dtype=d))
    by_name = {o.name: o for o in operands}

    # a pack(a, b) rounds to the dtype of the output that stores it
    pack_dtype: dict[int, DType] = {}
    for n in program.nodes:
        if n.op == "store" and program.nodes[n.inputs[0]].op == "pack":
            pack_dtype[n.inputs[0]] = out_dtype(n.attr("name"), dtype)

    nodes: list[Node] = []
    for n in program.nodes:
        if n.op in OPERAND_OPS:
            d = by_name[n.attr("operand")].dtype
        elif n.op == "cast":
            d = as_dtype(n.attr("dtype")) if n.attr("dtype") is not None else dtype
            n = replace(n, attrs=make_attrs(**{**dict(n.attrs), "dtype": d.name}))
        elif n.op in PACK_OPS:
            if n.op in UNPACK_OPS:
                pd = by_name[program.nodes[n.inputs[0]].attr("operand")].dtype
            else:
                pd = pack_dtype.get(n.id, dtype)
            attrs = dict(n.attrs)
            attrs["dtype"] = pd.name
            n = replace(n, attrs=make_attrs(**attrs))
            d = F32
        elif n.op == "store":
            qdtype = n.attr("qdtype")
            d = out_dtype(n.attr("name"), as_dtype(qdtype) if qdtype else dtype)
            if d not in FLOAT_DTYPES + FP8_DTYPES:
                raise EpilogueError(f"output '{n.attr('name')}': tile outputs are floating point, not {d.torch}",
                                    program=program.name)
            if qdtype and d.name != qdtype:
                raise EpilogueError(f"output '{n.attr('name')}' is cc.quantize(..., {as_dtype(qdtype).torch}); "
                                    f"output_dtypes cannot make it {d.torch}", program=program.name)
            if n.attr("layout") == "packed" and d.bits != 16:
                raise EpilogueError(f"output '{n.attr('name')}' stores cc.pack(...) pairs: its dtype must be "
                                    f"16-bit (bf16 or f16), not {d.torch}", program=program.name)
        elif n.op == "block_scale":
            if n.attr("name") in output_dtypes and as_dtype(output_dtypes[n.attr("name")]) != F32:
                raise EpilogueError(f"output '{n.attr('name')}': block scales are fp32", program=program.name)
            d = F32
        elif n.op == "reduce":
            attrs = dict(n.attrs)
            rd = out_dtype(n.attr("name"), F32, FLOAT_DTYPES)
            if rd not in FLOAT_DTYPES:
                raise EpilogueError(f"output '{n.attr('name')}': reductions are finished in floating point "
                                    f"(fp32, bf16 or fp16), not {rd.torch}", program=program.name)
            attrs["out_dtype"] = rd.name
            n = replace(n, attrs=make_attrs(**attrs))
            d = F32
        else:
            d = F32
        nodes.append(replace(n, dtype=d))
    _check_index_operands(program, by_name)
    meta = dict(program.meta)
    meta["gemm_dtype"] = dtype.name
    return replace(program, operands=tuple(operands), nodes=tuple(nodes), meta=meta)


def _check_index_operands(program: Program, by_name: Mapping[str, Operand]) -> None:
    """An operand compared with element positions (cc.gather, ``cc.col_index() == idx``) must hold
    integers exactly: int32, int64 or fp32 (exact below 2^24); a 16-bit float rounds indices above
    256 (bf16) or 2048 (fp16), which would silently select another column."""
    for n in program.nodes:
        if n.op != "eq":
            continue
        ins = [program.nodes[i] for i in n.inputs]
        if not any(i.op == "index" for i in ins):
            continue
        for i in ins:
            if i.op in OPERAND_OPS:
                o = by_name[i.attr("operand")]
                if o.dtype is not None and o.dtype.bits == 16:
                    raise EpilogueError(
                        f"operand '{o.name}' is compared with element positions (cc.gather or cc.row_index() / "
                        f"cc.col_index()) but its dtype is {o.dtype.torch}, which cannot hold indices above "
                        f"{256 if o.dtype.name == 'bf16' else 2048} exactly: declare it with an integer dtype, e.g. "
                        f"cc.PerRow(torch.int64), or pass input_dtypes={{'{o.name}': torch.int64}}",
                        program=program.name)
