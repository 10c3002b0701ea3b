"""The torch.library custom op behind every kernel: schema, fake (meta) implementation, mutation
of accumulated outputs. Runs on the CPU with fake tensors; tests/gpu covers real calls."""

from __future__ import annotations

from unittest import mock

import pytest

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import coda_cutlass as cc
from coda_cutlass.runtime.torch_op import as_returned, op_name, schema


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


# ---------------------------------------------------------------- one op per distinct kernel (issue 14)
@cc.epilogue
def biased(acc, b: cc.PerCol):
    return {"D": acc + b, "s": cc.row_sum(acc)}


def _config(**runtime):
    return cc.KernelConfig(tile_m=128, tile_n=128, cluster_m=1, cluster_n=2, schedule="pingpong", **runtime)


def test_kernels_differing_in_runtime_defaults_or_path_get_their_own_ops(fake_nvcc, tmp_path):
    base = cc.compile_epilogue(biased, config=_config())
    same = cc.compile_epilogue(biased, config=_config())
    raster = cc.compile_epilogue(biased, config=_config(raster="m"))
    swizzle = cc.compile_epilogue(biased, config=_config(swizzle=4))
    elsewhere = cc.compile_epilogue(biased, config=_config(), cache_dir=tmp_path / "other-cache")
    partial = cc.compile_epilogue(biased, config=_config(), partial_reductions=True)
    kernels = (base, raster, swizzle, elsewhere, partial)
    assert len({k.source_key for k in kernels}) == 1 and elsewhere.path != base.path
    assert same.op is base.op                                     # the same kernel: registered once
    assert len({op_name(k) for k in kernels}) == len(kernels)     # every other one: its own op
    assert len({id(k.op) for k in kernels}) == len(kernels)


def test_compiled_calls_pass_each_kernels_op_and_its_runtime_overrides(fake_nvcc):
    """What torch.compile records for k(A, W, ...): each kernel's own op, with the call's raster and
    swizzle as op arguments (traced here with make_fx on fake tensors, as Dynamo would)."""
    km = cc.compile_epilogue(biased, config=_config(raster="m"))
    kn = cc.compile_epilogue(biased, config=_config(raster="n"))

    def f(A, W, b):
        return km(A, W, b=b)["D"], kn(A, W, b=b, raster="heuristic", swizzle=4)["s"]

    with FakeTensorMode():
        A = torch.empty(100, 64, device="cuda", dtype=torch.bfloat16)
        W = torch.empty(48, 64, device="cuda", dtype=torch.bfloat16)
        b = torch.empty(48, device="cuda", dtype=torch.bfloat16)
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        graph = make_fx(f, tracing_mode="fake")(A, W, b)
    calls = [n for n in graph.graph.nodes if n.op == "call_function" and "coda_cutlass" in str(n.target)]
    assert [str(n.target) for n in calls] == [f"coda_cutlass.{op_name(km)}.default",
                                              f"coda_cutlass.{op_name(kn)}.default"]
    assert calls[0].kwargs == {} and calls[1].kwargs == {"raster": "heuristic", "swizzle": 4}


# ---------------------------------------------------------------- non-ASCII names (issue 14, item 4)
@cc.epilogue
def greek(acc, β: cc.PerCol, γ: cc.Scalar, arg0: cc.PerRow):
    return {"Dé": acc * γ + β + arg0, "σ": cc.row_sum(acc), "dé": cc.accumulate(acc)}


def scale(acc, s: cc.Scalar):
    return acc * s


def test_non_ascii_names_compile_and_register(fake_nvcc):
    k = cc.compile_epilogue(greek)
    assert schema(k) == ("(Tensor A, Tensor W, Tensor _arg0, float arg1, Tensor arg0, Tensor(a0!) arg3, *, "
                         "str? raster=None, int? swizzle=None) -> (Tensor, Tensor)")
    assert op_name(k).isascii() and op_name(k).startswith("greek_")
    with FakeTensorMode():
        A = torch.empty(100, 64, device="cuda", dtype=torch.bfloat16)
        W = torch.empty(48, 64, device="cuda", dtype=torch.bfloat16)
        β = torch.empty(48, device="cuda", dtype=torch.bfloat16)
        r = torch.empty(100, device="cuda", dtype=torch.bfloat16)
        dé = torch.empty(100, 48, device="cuda", dtype=torch.bfloat16)
        D, σ = k.op(A, W, β, 2.0, r, dé)
        with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
            out = k(A, W, β=β, γ=2.0, arg0=r, dé=dé)
    assert (D.shape, σ.shape) == ((100, 48), (100,))
    assert list(out) == ["Dé", "σ", "dé"] and out["dé"] is dé



def test_programs_whose_names_read_alike_in_ascii_get_their_own_ops(fake_nvcc):
    kernels = [cc.compile_epilogue(cc.epilogue(scale, name=name)) for name in ("α", "β", "2σ", "σ2")]
    names = [op_name(k) for k in kernels]
    assert [n.split("_")[0] for n in names] == ["epilogue", "epilogue", "p2", "p2"]
    assert len(set(names)) == 4 and len({id(k.op) for k in kernels}) == 4


# ---------------------------------------------------------------- fake strides = eager strides (issue 23, item 8)
@cc.epilogue
def reductions(acc, resid: cc.Tile):
    x = acc + resid
    return {"D": x, "ss": cc.row_sum(x * x), "dg": cc.col_sum(x), "lse": cc.row_logsumexp(x)}


@pytest.mark.parametrize("partial", [True, False])
@pytest.mark.parametrize("M,N", [(64, 256), (300, 520), (128, 64), (1, 8)])
def test_the_fake_implementation_gives_the_eager_calls_shapes_and_strides(fake_nvcc, partial, M, N):
    """Inductor checks a custom op's real outputs against the fake's strides (it failed with
    'expected size 2==2, stride 128==64' on a partials buffer padded to the tile). The eager call
    returns partials as views of the padded buffer; the fake, and the op's implementation, give
    those strides too, and the op returns no view."""
    k = cc.compile_epilogue(reductions, torch.bfloat16, partial_reductions=partial)
    with FakeTensorMode():
        A = torch.empty(M, 64, device="cuda", dtype=torch.bfloat16)
        W = torch.empty(N, 64, device="cuda", dtype=torch.bfloat16)
        R = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        fakes = dict(zip(("D", "ss", "dg", "lse"), k.op(A, W, R)))
    A, W = torch.empty(M, 64, dtype=torch.bfloat16), torch.empty(N, 64, dtype=torch.bfloat16)
    for name, fake in fakes.items():
        if name == "D":
            eager = torch.randn(M, N).bfloat16()          # as Kernel.run allocates it
        else:                   # Kernel.run's own finishing of the kernel's padded partials buffer
            layout = k._finish_plan[name][0]
            buf = torch.rand(layout.buffer_shape(M, N, k.config.tile))
            eager = k._finish(name, buf, M, N)
        assert (tuple(fake.shape), fake.stride(), fake.dtype) == (tuple(eager.shape), eager.stride(), eager.dtype), name
        returned = as_returned(k, name, eager, A, W)
        assert returned._base is None and returned.stride() == fake.stride(), name
        torch.testing.assert_close(returned, eager, rtol=0, atol=0, msg=name)
    if partial and M % k.config.tile_m:
        assert fakes["ss"].stride(0) > M       # the padded row stride (the case Inductor refused)
