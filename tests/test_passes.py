"""IR passes: type binding, validation, CSE, DCE."""

from __future__ import annotations

import pytest
import torch

import coda_cutlass as cc
from coda_cutlass.dtypes import BF16, F16, F32
from coda_cutlass.passes import bind_types, eliminate_common_subexpressions, eliminate_dead_code, run_passes, validate


@cc.epilogue
def prog(acc, t: cc.Tile, r: cc.PerRow(torch.float32), s: cc.Scalar):
    a = acc * r + t
    b = acc * r + t          # duplicate of a
    unused = cc.exp(acc)     # dead
    return {"D": a + b, "h": cc.cast(a, torch.float16) * s, "m": cc.row_max(a)}


def test_bind_types():
    p = bind_types(prog.trace(), BF16, output_dtypes={"h": torch.float32})
    dt = {o.name: o.dtype for o in p.operands}
    assert dt == {"t": BF16, "r": F32, "s": F32}
    by_op = {}
    for n in p.nodes:
        by_op.setdefault(n.op, set()).add(n.dtype)
    assert by_op["acc"] == {F32} and by_op["add"] == {F32} and by_op["cast"] == {F16}
    assert p.sink("D").dtype == BF16 and p.sink("h").dtype == F32
    assert p.sink("m").attr("out_dtype") == "f32"


def test_bind_rejects_unknown_names():
    with pytest.raises(cc.EpilogueError, match="not an output"):
        bind_types(prog.trace(), BF16, output_dtypes={"nope": torch.float32})
    with pytest.raises(cc.EpilogueError, match="not an operand"):
        bind_types(prog.trace(), BF16, operand_dtypes={"nope": torch.float32})


def test_cse_and_dce():
    p = bind_types(prog.trace(), BF16)
    n0 = len(p.nodes)
    p2 = eliminate_common_subexpressions(p)
    assert len(p2.nodes) == n0 - 2          # the duplicate mul and add
    p3 = eliminate_dead_code(p2)
    assert "exp" not in [n.op for n in p3.nodes]
    validate(p3)
    assert [n.id for n in p3.nodes] == list(range(len(p3.nodes)))


def test_run_passes_keeps_outputs():
    p = run_passes(prog.trace(), BF16)
    assert p.outputs == ("D", "h", "m")
    assert {n.attr("name") for n in p.sinks()} == {"D", "h", "m"}


def test_validation_limits_tile_streams():
    @cc.epilogue
    def many(acc, a: cc.Tile, b: cc.Tile, c: cc.Tile, d: cc.Tile, e: cc.Tile):
        return acc + a + b + c + d + e
    with pytest.raises(cc.EpilogueError, match="tile inputs"):
        run_passes(many.trace(), BF16)


def test_scalar_dtype_must_be_fp32():
    @cc.epilogue
    def f(acc, s: cc.Scalar(torch.bfloat16)):
        return acc * s
    with pytest.raises(cc.EpilogueError, match="fp32"):
        run_passes(f.trace(), BF16)
