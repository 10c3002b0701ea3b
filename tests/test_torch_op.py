"""The torch.library custom op behind every kernel: schema, fake (meta) implementation, mutation
of accumulated outputs. Runs on the CPU with fake tensors; tests/gpu covers real calls."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import coda_cutlass as cc
from coda_cutlass.runtime.torch_op import schema


@cc.epilogue
def stats(acc, resid: cc.Tile, g: cc.PerCol, s: cc.Scalar):
    x = acc + resid
    return {"D": x, "h": x * g * s, "ss": cc.row_sum(x * x), "cm": cc.col_max(x), "tot": cc.total_sum(x)}


@cc.epilogue
def accum(acc, y: cc.Tile):
    return {"o": acc * y, "dx": cc.accumulate(acc)}


def test_schema_and_fake_shapes(fake_nvcc):
    k = cc.compile_epilogue(stats, torch.bfloat16, output_dtypes={"ss": torch.bfloat16})
    assert schema(k) == ("(Tensor A, Tensor W, Tensor resid, Tensor g, float s, *, str? raster=None, "
                         "int? swizzle=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
    op = k.op
    assert k.op is op                       # registered once
    with FakeTensorMode():
        A = torch.empty(100, 64, device="cuda", dtype=torch.bfloat16)
        W = torch.empty(48, 64, device="cuda", dtype=torch.bfloat16)
        R = torch.empty(100, 48, device="cuda", dtype=torch.bfloat16)
        g = torch.empty(48, device="cuda", dtype=torch.bfloat16)
        D, h, ss, cm, tot = op(A, W, R, g, 2.0)
    assert (D.shape, h.shape, ss.shape, cm.shape, tot.shape) == ((100, 48), (100, 48), (100,), (48,), ())
    assert (D.dtype, ss.dtype, cm.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)


def test_partials_fake_shapes(fake_nvcc):
    k = cc.compile_epilogue(stats, torch.bfloat16, partial_reductions=True)
    with FakeTensorMode():
        A = torch.empty(300, 64, device="cuda", dtype=torch.bfloat16)
        W = torch.empty(520, 64, device="cuda", dtype=torch.bfloat16)
        R = torch.empty(300, 520, device="cuda", dtype=torch.bfloat16)
        g = torch.empty(520, device="cuda", dtype=torch.bfloat16)
        _, _, ss, cm, tot = k.op(A, W, R, g, 1.0)
    tm, tn = k.config.tile
    assert ss.shape == (-(-520 // tn), 300) and cm.shape == (-(-300 // tm), 520) and tot.shape == (-(-520 // tn), 300)


def test_accumulated_output_is_a_mutated_argument(fake_nvcc):
    k = cc.compile_epilogue(accum, torch.bfloat16)
    assert schema(k) == ("(Tensor A, Tensor W, Tensor y, Tensor(a0!) dx, *, str? raster=None, "
                         "int? swizzle=None) -> Tensor")
    assert k.op.default._schema.arguments[3].alias_info.is_write
