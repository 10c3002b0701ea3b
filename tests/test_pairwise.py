"""Pairwise ops, packed pairs, half-width outputs, online log-sum-exp, gather and segment sums on
the CPU: tracing and its errors, the interpreter against direct torch (including -inf / +inf /
NaN / empty tiles for log-sum-exp), the finishing steps, code generation and content keys, and
the custom op's fake shapes. The GPU side is in tests/gpu (catalogue cases)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import coda_cutlass as cc
from coda_cutlass import epilogues as E
from coda_cutlass.build.keys import included_headers
from coda_cutlass.config import DEFAULT
from coda_cutlass.ir.nodes import Kind
from coda_cutlass.partials import PartialLayout, finish_lse, finish_segments, lse_partials, segment_partials
from coda_cutlass.pipeline import Options, generate, lower_program

BASE_HEADERS = {"coda/functors.hpp", "coda/visitor.hpp", "coda/host_abi.hpp", "coda/driver_check.hpp"}


def ref(program, A, W, **ops):
    return cc.reference(program, A, W, precision="fp32", **ops)


def gemm(A, W):
    return A.float() @ W.float().t()


# ---------------------------------------------------------------------------------------------- tracing
def test_pairs_of_per_row_values_are_the_value_itself():
    @cc.epilogue
    def p(acc, r: cc.PerRow):
        e, o = cc.pairs(r)
        return cc.interleave(e, o * 2.0) + acc
    ir = p.trace()
    ops = [n.op for n in ir.nodes]
    assert "pair_first" not in ops and "pair_second" not in ops and "pair_merge" in ops
    # interleaving two per-row values gives a value that varies along N
    merge = next(n for n in ir.nodes if n.op == "pair_merge")
    assert merge.kind == Kind.TILE


def test_pair_map_matches_explicit_pairs():
    A, W = torch.randn(5, 16), torch.randn(24, 16)     # N a multiple of 8, as the kernel needs

    @cc.epilogue
    def swap(acc):
        return cc.pair_map(lambda x, y: (y, -x), acc)
    got = ref(swap, A, W)["D"]
    acc = gemm(A, W)
    want = torch.stack((acc[:, 1::2], -acc[:, 0::2]), -1).flatten(-2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def err(fn, match: str, **kw) -> None:
    with pytest.raises(cc.EpilogueError, match=match):
        cc.epilogue(fn, **kw).trace()


def test_pair_map_misuse_is_named():
    # fn and x swapped said "cc.pairs: cannot use a function"; a non-function or a wrong arity was a bare TypeError
    err(lambda acc: cc.pair_map(acc, lambda a, b: (b, a)), r"fn must be a function .*got a traced value")
    err(lambda acc: cc.pair_map(3, acc), r"cc.pair_map\(fn, x, \*args\): fn must be a function.*got int")
    err(lambda acc: cc.pair_map(lambda a: (a, a), acc), r"called as fn\(x_2i, x_2i\+1, \*args\) with 2 arguments")

    def extra_argument(acc, t: cc.PerCol):
        return cc.pair_map(lambda a, b: (a, b), acc, t)
    err(extra_argument, "with 3 arguments")


def test_errors():
    err(lambda acc: cc.unpack(acc), "cc.PairTile")

    def bad_pack_use(acc, z: cc.PairTile):
        return cc.pack(acc, acc) * 2.0
    err(bad_pack_use, "can only be returned")

    def packed_in_math(acc, z: cc.PairTile):
        return acc + z
    err(packed_in_math, "packed pairs")

    def packed_stored(acc, z: cc.PairTile):
        return {"o": z}
    err(packed_stored, "cannot be stored directly|packed pairs")

    def half_in_math(acc):
        return cc.half_width(acc) + 1.0
    err(half_in_math, r"cc.half_width\(...\) may only appear as a value of the returned dict")

    def accumulate_in_math(acc):
        return {"o": cc.accumulate(acc) * 2.0}
    err(accumulate_in_math, r"cc.accumulate\(...\) may only appear as a value of the returned dict")

    def half_of_pack(acc):
        return {"o": cc.half_width(cc.pack(acc, acc))}
    err(half_of_pack, "half width")

    def gather_bad(acc, c: cc.PerCol(torch.int32)):
        return {"g": cc.gather(acc, c)}
    err(gather_bad, "per-row")
    err(lambda acc: {"s": cc.segment_sum(acc, 12)}, "multiple of 8")
    err(lambda acc: cc.cast(acc, torch.int32), "not supported")
    with pytest.raises(cc.EpilogueError, match="only be used inside"):
        cc.col_index()


def test_type_errors():
    def int_tile(acc, t: cc.Tile(torch.int32)):
        return acc + t
    with pytest.raises(cc.EpilogueError, match="index vectors"):
        cc.emit(cc.epilogue(int_tile))

    def f32_pairs(acc, z: cc.PairTile(torch.float32)):
        a, b = cc.unpack(z)
        return acc * a
    with pytest.raises(cc.EpilogueError, match="16-bit"):
        cc.emit(cc.epilogue(f32_pairs))

    def pack_f32(acc):
        return {"p": cc.pack(acc, acc)}
    with pytest.raises(cc.EpilogueError, match="16-bit"):
        cc.emit(cc.epilogue(pack_f32), output_dtypes={"p": torch.float32})


# ---------------------------------------------------------------------------------------------- interpreter
def test_swiglu_and_backward_reference():
    M, N, K = 7, 24, 16
    A, W, r = torch.randn(M, K), torch.randn(N, K), torch.rand(M) + 0.5
    out = ref(E.swiglu, A, W, r=r)
    z = gemm(A, W) * r[:, None]
    torch.testing.assert_close(out["z"], z)
    torch.testing.assert_close(out["y"], torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2])
    assert out["y"].shape == (M, N // 2)

    zs = torch.randn(M, 2 * N).bfloat16()
    A, W = A.bfloat16(), W.bfloat16()       # the kernel's rounding points need the kernel's operands
    b = cc.reference(E.swiglu_backward, A, W, z=zs, precision="kernel")
    assert b["dz"].shape == (M, 2 * N) and b["dz"].dtype == torch.bfloat16
    g, u = zs[:, 0::2].float(), zs[:, 1::2].float()
    s = torch.sigmoid(g)
    dy = gemm(A, W)
    torch.testing.assert_close(b["dz"][:, 0::2].float(), (dy * u * s * (1 + g * (1 - s))).bfloat16().float())
    torch.testing.assert_close(b["dz"][:, 1::2].float(), (dy * g * s).bfloat16().float())


def test_rope_reference_rotates_pairs_and_passes_frequency_zero():
    M, N, K = 6, 16, 8
    A, W = torch.randn(M, K), torch.randn(N, K)
    r = torch.ones(M)
    pos = torch.arange(M).float()
    freq = torch.rand(N // 2).repeat_interleave(2)
    freq[8:] = 0.0
    out = ref(E.rope, A, W, r=r, pos=pos, freq=freq)["D"]
    generic = ref(E.rope_generic, A, W, r=r, pos=pos, freq=freq)["D"]
    torch.testing.assert_close(out, generic, rtol=0, atol=0)
    z = gemm(A, W)
    theta = pos[:, None] * freq[None, 0::2]
    x, y = z[:, 0::2], z[:, 1::2]
    want = torch.stack((x * torch.cos(theta) - y * torch.sin(theta), x * torch.sin(theta) + y * torch.cos(theta)), -1)
    torch.testing.assert_close(out, want.flatten(-2))
    assert torch.equal(out[:, 8:], z[:, 8:])            # frequency 0: unchanged, bit for bit
    # rotation keeps each pair's norm
    torch.testing.assert_close(out[:, 0::2] ** 2 + out[:, 1::2] ** 2, x ** 2 + y ** 2)


def test_gather_picks_one_column_and_zero_for_ignored_rows():
    M, N, K = 9, 40, 8
    A, W = torch.randn(M, K), torch.randn(N, K)
    t = torch.randint(0, N, (M,))
    t[2] = -100
    out = ref(E.lm_head_lse, A, W, r=torch.ones(M), target=t)
    x = gemm(A, W)
    want = x[torch.arange(M), t.clamp_min(0)]
    want[2] = 0.0
    torch.testing.assert_close(out["target_logit"], want)
    torch.testing.assert_close(out["lse"], torch.logsumexp(x, 1))


@pytest.mark.parametrize("tn", [8, 16, 64])
def test_lse_partials_finish_like_logsumexp(tn):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=g) * 300.0            # large magnitudes: exp overflows without the max
    x[1] = float("-inf")                                    # a row of only -inf
    x[2, :16] = float("-inf")                               # whole tiles of -inf
    x[3, 5] = float("inf")
    x[4, 7] = float("nan")
    p = lse_partials(x, tn)
    assert p.shape == (-(-40 // tn), 6, 2)
    got = finish_lse(p)
    want = torch.logsumexp(x, 1)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    torch.testing.assert_close(got[ok], want[ok], rtol=1e-6, atol=1e-4)
    assert got[1] == float("-inf") and got[3] == float("inf")
    # the tile that is entirely -inf carries (-inf, count of its elements)
    if tn == 8:
        assert p[0, 2, 0] == float("-inf") and p[0, 2, 1] == 8


@pytest.mark.parametrize("width,tn", [(32, 64), (32, 128), (64, 32), (128, 32), (16, 16)])
def test_segment_partials_finish(width, tn):
    M, N = 5, 256
    x = torch.randn(M, N)
    p = segment_partials(x, width, tn)
    got = finish_segments(p, width, tn, N)
    torch.testing.assert_close(got, x.view(M, N // width, width).sum(2), rtol=1e-5, atol=1e-5)
    layout = PartialLayout("sum", "segment", width)
    assert torch.equal(layout.reference(x, (128, tn)), p)
    assert p.shape == layout.partial_shape(M, N, (128, tn))
    torch.testing.assert_close(layout.finish(p, M, N, tn), got)


def test_segment_sum_reference():
    A, W = torch.randn(3, 8), torch.randn(256, 8)
    out = ref(E.qk_norm_stats, A, W, r=torch.ones(3))
    z = gemm(A, W)
    torch.testing.assert_close(out["head_sumsq"], (z * z).view(3, 2, 128).sum(2))


def test_segment_width_from_a_float_constant_or_numpy_int():
    # as cc.quantize's block: a whole float (a float constant) or a numpy int is that int; the old
    # message said "must be a positive multiple of 8, got 64.0"
    def float_constant(acc, hd: float = 64):
        return {"s": cc.segment_sum(acc, hd)}

    A, W = torch.randn(3, 8), torch.randn(256, 8)
    want = gemm(A, W).view(3, 4, 64).sum(2)
    torch.testing.assert_close(ref(cc.epilogue(float_constant), A, W)["s"], want)
    torch.testing.assert_close(ref(cc.epilogue(lambda acc: {"s": cc.segment_sum(acc, np.int64(64))}), A, W)["s"], want)
    with pytest.raises(cc.EpilogueError, match="multiple of 8 known when tracing.*got 64.5"):
        cc.epilogue(lambda acc: {"s": cc.segment_sum(acc, 64.5)}).trace()
    with pytest.raises(cc.EpilogueError, match="multiple of 8 known when tracing.*got True"):
        cc.epilogue(lambda acc: {"s": cc.segment_sum(acc, True)}).trace()


# ---------------------------------------------------------------------------------------------- codegen
def lowered(program, **opts):
    return generate(lower_program(program, Options.make(torch.bfloat16, **opts)))


def test_extra_headers_only_when_used():
    plain = lowered(E.residual_add).source
    assert set(included_headers(plain)) == BASE_HEADERS
    stats = lowered(E.residual_norm_stats).source       # a row sum
    assert set(included_headers(stats)) == BASE_HEADERS | {"coda/row_reduction.hpp"}
    swiglu = lowered(E.swiglu).source
    assert {"coda/pairwise.hpp", "coda/half_store.hpp"} <= set(included_headers(swiglu))
    lse = lowered(E.lm_head_lse).source
    assert {"coda/logsumexp.hpp", "coda/coordinates.hpp"} <= set(included_headers(lse))
    rope = lowered(E.rope).source
    assert {"coda/rotate.hpp", "coda/math_extra.hpp"} <= set(included_headers(rope))
    assert "coda::PairRotate<float, ElementCompute, RoundStyle>" in rope
    assert "coda/math_extra.hpp" in included_headers(lowered(E.rope_generic).source)


def test_generated_nodes():
    src = lowered(E.swiglu).source
    assert "coda::PairCompute<coda::pair_first" in src and "coda::HalfWidthStore<cutlass::bfloat16_t>" in src
    src = lowered(E.lm_head_lse).source
    assert "Sm90ColReduction<\n      coda::lse_combine" in src and "coda::IndexFetch<1>" in src
    assert "ElementD = void" in src          # logits not written
    src = lowered(E.swiglu_backward).source
    assert "coda::Unpack<cutlass::bfloat16_t>::lo" in src and "coda::Unpack<cutlass::bfloat16_t>::pack" in src
    assert "ElementC = float;" in src         # packed pairs travel as 32-bit words


@pytest.mark.parametrize("tile_n,node", [(256, "coda::SegmentRowSum<128, TileShape>"),
                                         (128, "coda::ColumnCheckedRowReduction"),
                                         (64, "coda::ColumnCheckedRowReduction")])
def test_segment_sum_lowering_depends_on_tile(tile_n, node):
    cfg = cc.KernelConfig(tile_m=128, tile_n=tile_n, tile_k=64, cluster_m=1, cluster_n=1)
    lo = lowered(E.qk_norm_stats, config=cfg)
    assert len(re.findall(r"^using Node\d+ = (?:fusion::)?" + re.escape(node), lo.source, re.M)) == 1
    slot = lo.graph.slot("head_sumsq")
    assert (slot.partials.width, lo.plan.segments(slot.index)) == (128, max(1, tile_n // 128))
    assert ("coda/segments.hpp" in included_headers(lo.source)) == (tile_n > 128)
    assert ("coda/row_reduction.hpp" in included_headers(lo.source)) == (tile_n <= 128)


def test_segment_width_must_fit_the_tile():
    @cc.epilogue
    def odd(acc):
        return {"s": cc.segment_sum(acc, 96)}
    cfg = cc.KernelConfig(tile_m=128, tile_n=128, tile_k=64, cluster_m=1, cluster_n=1)
    with pytest.raises(cc.ConfigError, match="divide one another"):
        lowered(odd, config=cfg)
    # without a config: no default tile width fits 96 either; the error names the output and width
    with pytest.raises(cc.ConfigError, match=r"output 's': segment width 96 and none of the default tile widths"):
        cc.emit(odd)


@pytest.mark.parametrize("width", [192, 384])
def test_segment_widths_that_do_not_fit_the_default_tile_compile_without_a_config(width, fake_nvcc):
    """Issue 14 item 15: lowering used to pick the segment count from a 128x256 config while the
    default is 128x128, so widths 192 and 384 failed without a config and with config="tune"."""
    @cc.epilogue
    def seg(acc):
        return {"s": cc.segment_sum(acc, width)}
    gen = lowered(seg)
    fits = lambda c: width % c.tile_n == 0 or c.tile_n % width == 0  # noqa: E731
    assert fits(gen.config) and cc.emit(seg) == gen.source
    assert gen.config == (cc.KernelConfig(tile_m=128, tile_n=64, tile_k=32, cluster_m=2, cluster_n=1)
                          if width == 192 else DEFAULT)
    k = cc.compile_epilogue(seg, torch.bfloat16)
    assert k.config == gen.config
    tuned = cc.compile_epilogue(seg, torch.bfloat16, config="tune")
    assert tuned.default == gen.config and tuned.candidates and all(fits(c) for c in tuned.candidates)
    assert tuned.kernel(tuned.candidates[-1]).config == tuned.candidates[-1]


# ---------------------------------------------------------------------------------------------- runtime (no GPU)
def test_fake_shapes_of_new_outputs(fake_nvcc):
    k = cc.compile_epilogue(E.swiglu_backward, torch.bfloat16)
    s = cc.compile_epilogue(E.swiglu, torch.bfloat16)
    lm = cc.compile_epilogue(E.lm_head_lse, torch.bfloat16)
    q = cc.compile_epilogue(E.qk_norm_stats, torch.bfloat16)
    with FakeTensorMode():
        A = torch.empty(100, 64, device="cuda", dtype=torch.bfloat16)
        W = torch.empty(512, 64, device="cuda", dtype=torch.bfloat16)
        z = torch.empty(100, 1024, device="cuda", dtype=torch.bfloat16)
        D, dz, zdz = k.op(A, W, z)
        zz, y = s.op(A, W, torch.empty(100, device="cuda"))
        lse, tgt = lm.op(A, W, torch.empty(100, device="cuda"), torch.empty(100, device="cuda", dtype=torch.int64))
        Dq, ss = q.op(A, W, torch.empty(100, device="cuda"))
    assert (D.shape, dz.shape, zdz.shape) == ((100, 512), (100, 1024), (100,))
    assert (zz.shape, y.shape) == ((100, 512), (100, 256))
    assert (lse.shape, tgt.shape) == ((100,), (100,))
    assert ss.shape == (100, 4)
