"""The reference interpreter against hand-written torch, for every program in the catalogue."""

from __future__ import annotations

import pytest
import torch

import coda_cutlass as cc
from catalog import CASES, compile_options, fit_n, make_inputs
from coda_cutlass.partials import PartialLayout

REF_KEYS = ("dtype", "weight_layout", "input_dtypes", "output_dtypes", "constants")


def ref_kwargs(case) -> dict:
    return {k: v for k, v in compile_options(case).items() if k in REF_KEYS}


def fp32(v):
    return v.float() if isinstance(v, torch.Tensor) else v


def clone(ops: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in ops.items()}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_interpreter_matches_handwritten_torch(case):
    M, N, K = 37, fit_n(case, 48), 24
    A, W, ops = make_inputs(case, M, N, K, "cpu", seed=1)
    layout = compile_options(case).get("weight_layout", "nk")
    acc = A.float() @ (W.float().t() if layout == "nk" else W.float())
    expect = case.expect(acc, **{k: fp32(v) for k, v in ops.items()})
    got = cc.reference(case.program, A.float(), W.float(), precision="fp32", **ref_kwargs(case),
                       **{k: fp32(v) for k, v in ops.items()})
    assert set(got) == set(expect)
    for name, e in expect.items():
        g = got[name]
        e = e.expand_as(g) if e.dim() < g.dim() else e
        assert g.shape == e.shape, name
        torch.testing.assert_close(g.float(), e.float(), rtol=2e-5, atol=2e-5, msg=f"{case.name}.{name}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kernel_precision_rounds_outputs_once(case):
    """'kernel' precision = fp32 math then one rounding of each tile output to its dtype."""
    M, N, K = 16, fit_n(case, 32), 16
    A, W, ops = make_inputs(case, M, N, K, "cpu", seed=2)
    kw = ref_kwargs(case)
    k = cc.reference(case.program, A, W, precision="kernel", **kw, **clone(ops))   # accumulated outputs
    f = cc.reference(case.program, A, W, precision="fp32", **kw, **clone(ops))     # are updated in place
    for name in k:
        if k[name].dtype != torch.float32:
            assert torch.equal(k[name], f[name].to(k[name].dtype)), name


def test_lowp_rounds_every_op():
    @cc.epilogue
    def p(acc):
        return {"D": (acc * 3.0) * (1.0 / 3.0)}
    A = torch.randn(8, 16).bfloat16()
    W = torch.randn(8, 16).bfloat16()
    lo = cc.reference(p, A, W, precision="lowp")["D"]
    k = cc.reference(p, A, W, precision="kernel")["D"]
    assert lo.dtype == torch.bfloat16 and not torch.equal(lo, k)


@pytest.mark.parametrize("fn,axis", [(f, a) for f in ("sum", "max", "min") for a in ("row", "col", "all")])
def test_partials_finish_to_full_reduction(fn, axis):
    x = torch.randn(300, 520)
    layout = PartialLayout(fn, axis)
    p = layout.reference(x, (128, 256))
    if axis == "col":
        assert p.shape == (3, 520)
    else:
        assert p.shape == (3, 300)
    assert p.shape == layout.partial_shape(300, 520, (128, 256))
    full = layout.finish(p, 300, 520, 256)
    dim = {"row": 1, "col": 0, "all": None}[axis]
    want = {"sum": x.sum, "max": x.amax, "min": x.amin}[fn]() if dim is None else \
        {"sum": x.sum, "max": x.amax, "min": x.amin}[fn](dim)
    torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-4)
    # the kernel's buffer is padded to whole tiles: finishing reads only the first M (or N) entries
    padded = torch.full((p.shape[0], p.shape[1] + 84), float("nan"))
    padded[:, :p.shape[1]] = p
    torch.testing.assert_close(layout.finish(padded, 300, 520, 256), full, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fn", ["sum", "max", "min"])
def test_total_of_no_partials_is_the_identity(fn):
    got = PartialLayout(fn, "all").finish(torch.empty(0, 300), 300, 0, 256)
    assert got.shape == () and got.item() == {"sum": 0.0, "max": float("-inf"), "min": float("inf")}[fn]


def test_reference_missing_operand():
    @cc.epilogue
    def p(acc, t: cc.Tile):
        return acc + t
    with pytest.raises(cc.CallError, match="missing operand 't'"):
        cc.reference(p, torch.randn(4, 8), torch.randn(8, 8), precision="fp32")
