"""FP8 outputs that quantise themselves (cc.quantize), on the CPU: the reference interpreter against
a hand-written emulation (dequantise -> fp32 program -> quantise, written here independently of
coda_cutlass.quantization), the scale and saturation semantics, the generated CUDA, and the errors
for programs or configurations that cannot work."""

from __future__ import annotations

import math

import pytest
import torch

import coda_cutlass as cc
from coda_cutlass import epilogues as E
from coda_cutlass.errors import ConfigError, EpilogueError

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}


@cc.epilogue
def rows_and_t(acc, r: cc.PerRow, t: cc.Tile):
    y = acc * r + t
    return {"q": cc.quantize(y, block=128), "qt": cc.quantize(y, block=128, transpose=True)}


@cc.epilogue
def fp32_scales(acc, r: cc.PerRow):
    y = acc * r
    return {"q": cc.quantize(y, E5M2, block=128, pow2=False)}


@cc.epilogue
def per_tensor(acc, s: cc.DeviceScalar):
    return {"D": acc, "q": cc.quantize(acc, scale=s), "qt": cc.quantize(acc, E5M2, scale=s, transpose=True),
            "amax": cc.amax(acc)}


swiglu_fp8 = E.swiglu_fp8_rows      # SwiGLU output quantised in the epilogue with its transposed copy


def emulate_blocks(x: torch.Tensor, dtype, pow2: bool, block: int = 128):
    """1 x block runs of each row, element by element in Python floats for the scales."""
    R, C = x.shape
    codes = torch.empty(R, C, dtype=dtype)
    scales = torch.empty(R, math.ceil(C / block))
    fmax = FMAX[dtype]
    for i in range(R):
        for b in range(scales.shape[1]):
            run = x[i, b * block:(b + 1) * block]
            amax = float(run.abs().max())
            if math.isnan(amax) or math.isinf(amax):
                s = inv = float("nan")
            elif amax == 0:
                s = inv = 1.0
            elif pow2:
                v = float(torch.tensor(amax / fmax, dtype=torch.float32))     # amax / fmax rounded to fp32
                s = v if math.frexp(v)[0] == 0.5 else 2.0 ** math.frexp(v)[1]
                inv = 1.0 / s
            else:
                s = float(torch.tensor(amax, dtype=torch.float32) / fmax)
                inv = float(torch.tensor(fmax, dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32))
            scales[i, b] = s
            y = run.float() * torch.tensor(inv, dtype=torch.float32)
            codes[i, b * block:(b + 1) * block] = y.clamp(-fmax, fmax).to(dtype)
    return codes, scales


def same_bits(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype in (E4M3, E5M2) else \
        torch.equal(torch.nan_to_num(a, nan=-7.0), torch.nan_to_num(b, nan=-7.0))


def inputs(M, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(M, K, generator=g).to(torch.bfloat16)
    W = (torch.randn(N, K, generator=g) * 3).to(torch.bfloat16)
    r = (torch.rand(M, generator=g) + 0.5).to(torch.bfloat16)
    t = torch.randn(M, N, generator=g).to(torch.bfloat16)
    return A, W, r, t


@pytest.mark.parametrize("shape", [(200, 384, 64), (130, 200, 32)])
def test_block_quantisation_matches_a_hand_written_emulation(shape):
    M, N, K = shape
    A, W, r, t = inputs(M, N, K, M + N)
    out = cc.reference(rows_and_t, A, W, r=r, t=t)
    y = (A.float() @ W.float().t()) * r.float()[:, None] + t.float()      # the fp32 program
    codes, scales = emulate_blocks(y, E4M3, pow2=True)
    assert same_bits(out["q"], codes) and same_bits(out["q_scale"], scales)
    codes_t, scales_t = emulate_blocks(y.t().contiguous(), E4M3, pow2=True)
    assert same_bits(out["qt"], codes_t) and same_bits(out["qt_scale"], scales_t)
    assert out["qt"].shape == (N, M) and out["qt_scale"].shape == (N, math.ceil(M / 128))
    # dequantised, the codes are within fp8's relative step of the value
    deq = out["q"].float() * out["q_scale"].repeat_interleave(128, 1)[:, :N]
    assert ((deq - y).abs() <= y.abs() * 2 ** -4 + 1e-30 + out["q_scale"].repeat_interleave(128, 1)[:, :N] * 2 ** -9).all()


def test_fp32_scales_and_e5m2():
    A, W, r, _ = inputs(150, 256, 64, 9)
    out = cc.reference(fp32_scales, A, W, r=r)
    y = (A.float() @ W.float().t()) * r.float()[:, None]
    codes, scales = emulate_blocks(y, E5M2, pow2=False)
    assert same_bits(out["q"], codes) and same_bits(out["q_scale"], scales)


def test_half_width_outputs_quantise_their_own_columns():
    A, W, r, _ = inputs(140, 512, 64, 4)
    r = r.float()
    out = cc.reference(swiglu_fp8, A, W, r=r)
    z = (A.float() @ W.float().t()) * r[:, None]
    y = torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]
    codes, scales = emulate_blocks(y, E4M3, pow2=True)
    assert out["y"].shape == (140, 256) and same_bits(out["y"], codes) and same_bits(out["y_scale"], scales)
    codes_t, scales_t = emulate_blocks(y.t().contiguous(), E4M3, pow2=True)
    assert same_bits(out["yt"], codes_t) and same_bits(out["yt_scale"], scales_t)


def test_per_tensor_codes_saturate_and_amax_propagates_nan():
    A = torch.zeros(4, 16).to(torch.bfloat16)
    A[0, 0], A[1, 0], A[2, 0] = 1000.0, float("inf"), float("nan")
    A[3, 0] = 3.0
    W = torch.zeros(32, 16).to(torch.bfloat16)
    W[:, 0] = 1.0
    s = torch.tensor(2.0)
    out = cc.reference(per_tensor, A, W, s=s)
    q = out["q"].float()
    assert q[0, 0] == 448.0 and q[1, 0] == 448.0 and q[2, 0].isnan() and q[3, 0] == 1.5   # 1000 / 2 saturates
    assert out["qt"].shape == (32, 4) and out["qt"].float()[0, 1] == 57344.0              # inf saturates in e5m2
    assert out["amax"].isnan()


def test_a_run_with_inf_or_nan_has_nan_scale_and_codes_and_a_zero_run_scale_one():
    x = torch.zeros(3, 256)
    x[0, 5] = float("inf")
    x[1, 200] = float("nan")
    x[2, 130] = 1.0
    A = torch.eye(3, 256).to(torch.bfloat16)    # acc = A @ W.T picks W's rows: build W = x.T
    out = cc.reference(rows_and_t, A, torch.zeros(256, 256).to(torch.bfloat16), r=torch.ones(3).to(torch.bfloat16),
                       t=x.to(torch.bfloat16))
    s = out["q_scale"]
    assert s[0, 0].isnan() and s[0, 1] == 1.0 and s[1, 1].isnan() and s[1, 0] == 1.0
    assert out["q"][0, :128].float().isnan().all() and (out["q"][0, 128:].float() == 0).all()
    assert s[2, 0] == 1.0 and s[2, 1] == 2.0 ** -8       # 1 / 448 rounds up to 2^-8
    assert out["q"][2, 130].float() == 256.0


def test_kernel_source_names_the_quantising_nodes():
    src = cc.emit(rows_and_t, config=cc.KernelConfig(tile_m=128, tile_n=128, tile_k=64, cluster_m=1, cluster_n=2))
    assert ("coda::QuantRowStore<cutlass::float_e4m3_t, TileShape, typename EpilogueDescriptor::EpilogueTile, 256, 128, "
            "/*Half=*/false, /*Pow2=*/true>") in src
    assert "coda::TransposedStore<cutlass::float_e4m3_t, TileShape" in src and "/*Block=*/128" in src
    assert '#include "coda/quant_store.hpp"' in src
    assert "q_scale: output f32 block scales, stored [runs, M]" in src
    src = cc.emit(per_tensor)
    assert "fusion::Sm90ScalarBroadcast<ElementCompute, StrideScalar>" in src and "/*Block=*/0" in src
    assert "using ElementD = cutlass::float_e4m3_t;" not in src      # D is the bf16 'D' output


def test_default_config_fits_the_runs():
    from coda_cutlass.pipeline import Options, generate, lower_program
    gen = generate(lower_program(swiglu_fp8, Options.make(torch.bfloat16)))
    assert gen.config.tile_n % 256 == 0 and gen.config.tile_m == 128


@pytest.mark.parametrize("config, needs", [
    (cc.KernelConfig(tile_m=128, tile_n=128, tile_k=64, cluster_m=1, cluster_n=2), "multiple of 256"),
    (cc.KernelConfig(tile_m=64, tile_n=256, tile_k=64, cluster_m=2, cluster_n=1, schedule="pingpong"),
     "tile_m must be 128"),
])
def test_configs_whose_tiles_split_a_run_are_refused(config, needs):
    with pytest.raises(ConfigError, match=needs):
        cc.emit(swiglu_fp8, config=config)


@pytest.mark.parametrize("body, message", [
    (lambda acc: {"q": cc.quantize(acc, torch.bfloat16, block=128)}, "float8"),
    (lambda acc: {"q": cc.quantize(acc, block=64)}, "block must be one of"),
    (lambda acc: {"q": cc.quantize(acc)}, "exactly one of"),
    (lambda acc: {"q": cc.quantize(acc, scale=2.0, block=128)}, "exactly one of"),
    (lambda acc: {"q": cc.quantize(cc.row_sum(acc), block=128)}, "elementwise value"),
    (lambda acc: {"q": cc.quantize(acc, block=128) * 2}, "may only appear as a value of the returned dict"),
    (lambda acc: {"q": cc.quantize(acc, scale=1.0, pow2=False)}, "pow2= applies to block scales"),
])
def test_misuse_is_a_clear_error(body, message):
    prog = cc.epilogue(body)
    with pytest.raises(EpilogueError, match=message):
        cc.emit(prog)


def test_output_dtypes_cannot_unquantise_an_output():
    with pytest.raises(EpilogueError, match="cannot make it torch.bfloat16"):
        cc.emit(rows_and_t, output_dtypes={"q": torch.bfloat16})
    with pytest.raises(EpilogueError, match="block scales are fp32"):
        cc.emit(rows_and_t, output_dtypes={"q_scale": torch.bfloat16})


def test_a_device_scalar_must_be_one_fp32_value():
    A, W = torch.randn(8, 16).to(torch.bfloat16), torch.randn(16, 16).to(torch.bfloat16)
    with pytest.raises(cc.CallError, match="0-dim fp32 tensor"):
        cc.reference(per_tensor, A, W, s=2.0)
    with pytest.raises(cc.CallError, match="expected torch.float32"):
        cc.reference(per_tensor, A, W, s=torch.tensor(2.0, dtype=torch.float64))
    with pytest.raises(cc.CallError, match="expected a 0-dim"):
        cc.reference(per_tensor, A, W, s=torch.ones(2))


@cc.epilogue
def map_quant(acc, s: cc.DeviceScalar, g: cc.PerCol):
    y = acc * g
    return {"q": cc.quantize(y, block=128), "p": cc.quantize(y, E5M2, scale=s), "amax": cc.amax(y),
            "h": cc.quantize(cc.half_width(y), block=128, pow2=False)}


def test_map_kernels_quantise_their_outputs_too():
    g0 = torch.Generator().manual_seed(2)
    X = (torch.randn(70, 392, generator=g0) * 5).to(torch.bfloat16)
    gam = (torch.rand(392, generator=g0) + 0.5).to(torch.bfloat16)
    out = cc.map_reference(map_quant, X, s=torch.tensor(0.25), g=gam)
    y = X.float() * gam.float()
    codes, scales = emulate_blocks(y, E4M3, pow2=True)
    assert same_bits(out["q"], codes) and same_bits(out["q_scale"], scales)
    hc, hs = emulate_blocks(y[:, 0::2].contiguous(), E4M3, pow2=False)
    assert same_bits(out["h"], hc) and same_bits(out["h_scale"], hs)
    assert same_bits(out["p"], (y * 4).clamp(-57344, 57344).to(E5M2))
    src = cc.emit_map(map_quant)
    assert "coda::quant::shuffle_max(a, 15)" in src and "coda::quant::shuffle_max(a, 31)" in src
    assert "coda::map::store8<cutlass::float_e5m2_t>" in src


def test_map_kernels_write_block_scaled_transposed_outputs_and_refuse_half_width_ones():
    prog = cc.epilogue(lambda acc: {"t": cc.quantize(acc, block=128, transpose=True)})
    assert "ColumnScales" in cc.emit_map(prog)
    half = cc.epilogue(lambda acc: {"t": cc.quantize(cc.half_width(acc), block=128, transpose=True)})
    with pytest.raises(EpilogueError, match="half-width transposed"):
        cc.emit_map(half)


# ---------------------------------------------------------------------------- grouped transposed copies
@cc.epilogue
def rows_and_grouped_t(acc, r: cc.PerRow, t: cc.Tile):
    y = acc * r + t
    return {"q": cc.quantize(y, block=128), "qt": cc.quantize(y, block=128, transpose=True, group=16)}


def emulate_groups(xt: torch.Tensor, dtype, group: int = 16, block: int = 128):
    """Blocks of ``group`` rows x ``block`` columns of the stored transpose (pow2 scales): the max over
    the block's rows of each row's run amax, then each row's run as emulate_blocks does it."""
    R, C = xt.shape
    amax_rows = torch.stack([xt[:, b * block:(b + 1) * block].abs().amax(1) for b in range(math.ceil(C / block))], 1)
    scales = torch.stack([amax_rows[g:g + group].amax(0) for g in range(0, R, group)])   # (ceil(R/group), runs)
    codes = torch.empty(R, C, dtype=dtype)
    for i in range(R):
        for b in range(scales.shape[1]):
            # one row whose run amax is the group's: emulate_blocks gives that run the group's scale
            run = xt[i, b * block:(b + 1) * block]
            probe = torch.cat([run, scales[i // group, b].reshape(1)])
            c, s = emulate_blocks(probe.reshape(1, -1), dtype, pow2=True, block=probe.numel())
            codes[i, b * block:(b + 1) * block] = c[0, :-1]
    _, s = emulate_blocks(scales.reshape(-1, 1), dtype, pow2=True, block=1)
    return codes, s.reshape(scales.shape)


@pytest.mark.parametrize("shape", [(200, 384, 64), (130, 200, 32)])   # 200 channels: a partial last group
def test_grouped_transposed_copies_match_a_hand_written_emulation(shape):
    M, N, K = shape
    A, W, r, t = inputs(M, N, K, M * N)
    out = cc.reference(rows_and_grouped_t, A, W, r=r, t=t)
    y = (A.float() @ W.float().t()) * r.float()[:, None] + t.float()
    codes, scales = emulate_groups(y.t().contiguous(), E4M3)
    assert out["qt"].shape == (N, M) and out["qt_scale"].shape == (math.ceil(N / 16), math.ceil(M / 128))
    assert same_bits(out["qt"], codes) and same_bits(out["qt_scale"], scales)
    rows, _ = emulate_blocks(y, E4M3, pow2=True)                      # the row-major copy is unchanged
    assert same_bits(out["q"], rows)
    # the scales are what a block_16x128 GEMM reads as W's: (N/16, M/128), rows contiguous, padded ld
    assert out["qt_scale"].stride(0) == 1 and out["qt_scale"].stride(1) % 4 == 0


def test_grouped_half_width_and_map_kernel_copies():
    A, W, r, _ = inputs(140, 512, 64, 5)
    out = cc.reference(E.swiglu_fp8_g16, A, W, r=r.float())
    z = (A.float() @ W.float().t()) * r.float()[:, None]
    y = (torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]).bfloat16().float()   # y is stored as bf16 too
    yt = torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]
    codes, scales = emulate_groups(yt.t().contiguous(), E4M3)        # groups of 16 outputs: 32 tile columns
    assert out["yt_scale"].shape == (16, 2) and same_bits(out["yt"], codes) and same_bits(out["yt_scale"], scales)
    assert torch.equal(out["y"].float(), y)
    X = (torch.randn(260, 400, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16)
    m = cc.map_reference(E.quantize_rows_t_g16, X)
    codes, scales = emulate_groups(X.float().t().contiguous(), E4M3)
    assert same_bits(m["qt"], codes) and same_bits(m["qt_scale"], scales) and m["qt_scale"].shape == (25, 3)


def test_grouped_copies_in_the_generated_source_and_their_configuration_errors():
    src = cc.emit(rows_and_grouped_t, config=cc.KernelConfig(tile_m=128, tile_n=128, tile_k=64, cluster_m=1,
                                                             cluster_n=2))
    assert "/*Block=*/128, /*Half=*/false, /*Pow2=*/true, /*Group=*/16>" in src
    assert "qt_scale: output f32 block scales, stored [runs, N/16]" in src and "16x128 block scales" in src
    assert "ColumnScales<cutlass::float_e4m3_t, true, /*Group=*/16>" in cc.emit_map(E.quantize_rows_t_g16)
    assert "Group" not in cc.emit(rows_and_t, config=cc.KernelConfig(tile_m=128, tile_n=128, tile_k=64,
                                                                      cluster_m=1, cluster_n=2))
    narrow = cc.KernelConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=1, cluster_n=2, epilogue_tile=(128, 16))
    with pytest.raises(ConfigError, match="16 half-width output columns are 32 tile columns.*multiple of 32"):
        cc.emit(E.swiglu_fp8_g16, torch.float8_e4m3fn, scaling="block", config=narrow)


@pytest.mark.parametrize("body, message", [
    (lambda acc: {"q": cc.quantize(acc, block=128, transpose=True, group=8)}, r"group must be one of \(1, 16\)"),
    (lambda acc: {"q": cc.quantize(acc, block=128, group=16)}, "group= applies to transposed copies"),
    (lambda acc: {"q": cc.quantize(acc, scale=1.0, transpose=True, group=16)}, "group= applies to transposed"),
])
def test_group_misuse_is_a_clear_error(body, message):
    with pytest.raises(EpilogueError, match=message):
        cc.emit(cc.epilogue(body))
