"""The test catalogue: epilogue programs covering every op, operand kind, output kind, both weight
layouts and both operand dtypes, each with a hand-written torch version of the same math.

Used by the CPU tests (interpreter vs hand-written torch, code generation) and by the GPU tests
(compiled kernel vs interpreter under the 2x-error rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

import coda_cutlass as cc

T = torch.Tensor


@dataclass
class Case:
    name: str
    program: Any
    inputs: Callable[[int, int, torch.dtype, torch.device, torch.Generator], dict[str, Any]]
    expect: Callable[..., dict[str, T]]      # fp32 math: expect(acc, **operands as fp32) -> outputs
    options: dict[str, Any] = field(default_factory=dict)
    nvcc_ci: bool = False                    # one of the few kernels CI compiles with nvcc
    n_multiple: int = 8                      # N must be a multiple of this (segment widths)


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, g: torch.Generator,
           scale: float = 1.0, offset: float = 0.0) -> T:
    return (torch.randn(shape, generator=g, device="cpu") * scale + offset).to(device=device, dtype=dtype)


def _rand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, g: torch.Generator,
          lo: float, hi: float) -> T:
    return (torch.rand(shape, generator=g, device="cpu") * (hi - lo) + lo).to(device=device, dtype=dtype)


def tile(name: str, scale: float = 1.0, dtype: torch.dtype | None = None):
    return lambda M, N, dt, dev, g: {name: _randn((M, N), dtype or dt, dev, g, scale)}


def merge(*fns: Callable[..., dict[str, Any]]):
    def make(M: int, N: int, dt: torch.dtype, dev: torch.device, g: torch.Generator) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fns:
            out.update(f(M, N, dt, dev, g))
        return out
    return make


def row(name: str, lo: float = 0.5, hi: float = 1.5, dtype: torch.dtype | None = None):
    return lambda M, N, dt, dev, g: {name: _rand((M,), dtype or dt, dev, g, lo, hi)}


def col(name: str, lo: float = -1.0, hi: float = 1.0, dtype: torch.dtype | None = None):
    return lambda M, N, dt, dev, g: {name: _rand((N,), dtype or dt, dev, g, lo, hi)}


def scalar(name: str, lo: float = 0.5, hi: float = 2.0):
    return lambda M, N, dt, dev, g: {name: float(torch.rand((), generator=g) * (hi - lo) + lo)}


def mask(name: str):
    return lambda M, N, dt, dev, g: {name: torch.randint(0, 2, (M, N), generator=g).to(device=dev, dtype=dt)}


def none(M: int, N: int, dt: torch.dtype, dev: torch.device, g: torch.Generator) -> dict[str, Any]:
    return {}


CASES: list[Case] = []


def case(name: str, inputs: Callable[..., dict[str, Any]], expect: Callable[..., dict[str, T]],
         nvcc_ci: bool = False, n_multiple: int = 8, **options: Any):
    def deco(fn: Callable[..., Any]) -> Any:
        prog = cc.epilogue(fn, name=name)
        CASES.append(Case(name, prog, inputs, expect, options, nvcc_ci, n_multiple))
        return prog
    return deco


# ---------------------------------------------------------------------------------------------- basics
@case("identity", none, lambda acc: {"D": acc})
def _identity(acc):
    return acc


@case("residual_add", tile("resid"), lambda acc, resid: {"D": acc + resid})
def _residual_add(acc, resid: cc.Tile):
    return {"D": acc + resid}


def _norm_stats_expect(acc, resid, g):
    return {"D": acc + resid, "h": (acc + resid) * g, "sumsq": ((acc + resid) ** 2).sum(1)}


def _norm_stats(acc, resid: cc.Tile, g: cc.PerCol):
    x = acc + resid
    return {"D": x, "h": x * g, "sumsq": cc.row_sum(x * x)}


case("residual_norm_stats", merge(tile("resid"), col("g")), _norm_stats_expect, nvcc_ci=True)(_norm_stats)


@case("bias_gelu", col("bias"), lambda acc, bias: {"D": F.gelu(acc + bias)})
def _bias_gelu(acc, bias: cc.PerCol):
    return cc.gelu(acc + bias)


@case("bias_gelu_tanh", col("bias"), lambda acc, bias: {"D": F.gelu(acc + bias, approximate="tanh")})
def _bias_gelu_tanh(acc, bias: cc.PerCol):
    return torch.nn.functional.gelu(acc + bias, approximate="tanh")


@case("rowscale_silu", row("r", dtype=torch.float32), lambda acc, r: {"D": F.silu(acc * r[:, None])})
def _rowscale_silu(acc, r: cc.PerRow(torch.float32)):
    return cc.silu(acc * r)


@case("alpha_beta", merge(tile("C"), scalar("alpha"), scalar("beta")),
      lambda acc, C, alpha, beta: {"D": alpha * acc + beta * C})
def _alpha_beta(acc, C: cc.Tile, alpha: cc.Scalar, beta: cc.Scalar):
    return alpha * acc + beta * C


@case("relu_squared", none, lambda acc: {"D": torch.relu(acc) ** 2})
def _relu_squared(acc):
    return cc.relu(acc) ** 2


@case("sigmoid_gate", tile("gate"), lambda acc, gate: {"D": torch.sigmoid(acc) * gate})
def _sigmoid_gate(acc, gate: cc.Tile):
    return cc.sigmoid(acc) * gate


@case("tanh_softcap", none, lambda acc: {"D": 30.0 * torch.tanh(acc / 30.0)})
def _tanh_softcap(acc, cap: float = 30.0):
    return cap * cc.tanh(acc / cap)


@case("softplus", none, lambda acc: {"D": torch.log(1.0 + torch.exp(acc * 0.05))})
def _softplus(acc):
    return cc.log(1.0 + cc.exp(acc * 0.05))


@case("sqrt_rsqrt", none, lambda acc: {"D": torch.sqrt(acc.abs()) + torch.rsqrt(acc.abs() + 1.0)})
def _sqrt_rsqrt(acc):
    return cc.sqrt(abs(acc)) + cc.rsqrt(cc.abs(acc) + 1.0)


@case("reciprocal", none, lambda acc: {"D": torch.reciprocal(1.0 + acc * acc)})
def _reciprocal(acc):
    return cc.reciprocal(1.0 + cc.square(acc))


@case("pow_const", none, lambda acc: {"D": acc.abs() ** 1.5, "E": acc ** 3})
def _pow_const(acc):
    return {"D": abs(acc) ** 1.5, "E": cc.pow(acc, 3)}


@case("clamp", col("lo", -2.0, -0.5), lambda acc, lo: {"D": torch.minimum(torch.maximum(acc, lo), 3.0 + lo * 0)})
def _clamp(acc, lo: cc.PerCol):
    return cc.minimum(cc.maximum(acc, lo), 3.0)


@case("where_sign", tile("s"), lambda acc, s: {"D": torch.where(s > 0, acc, -acc)})
def _where_sign(acc, s: cc.Tile):
    return cc.where(s > 0, acc, -acc)


@case("comparisons", merge(tile("x"), mask("m")),
      lambda acc, x, m: {
          "D": torch.where(x < -0.5, acc, 0.0) + torch.where(x <= 0.25, 1.0, 2.0) * (x >= 1.0).float()
          + torch.where(m == 1, acc, 0.0) - torch.where(m != 0, 0.5, 0.0)})
def _comparisons(acc, x: cc.Tile, m: cc.Tile):
    return (cc.where(x < -0.5, acc, 0.0) + cc.where(x <= 0.25, 1.0, 2.0) * (x >= 1.0)
            + cc.where(m == 1, acc, 0.0) - cc.where(m != 0, 0.5, 0.0))


@case("cast_midway", none,
      lambda acc: {"D": acc.to(torch.bfloat16).float() * 3.0 - acc.to(torch.float16).float()})
def _cast_midway(acc):
    return cc.cast(acc, torch.bfloat16) * 3.0 - cc.cast(acc, torch.float16)


@case("neg_sub_div", merge(tile("t"), col("c", 1.0, 2.0)),
      lambda acc, t, c: {"D": -(acc - t) / c - 1.0 / c})
def _neg_sub_div(acc, t: cc.Tile, c: cc.PerCol):
    return -(acc - t) / c - 1.0 / c


# ---------------------------------------------------------------------------------------------- reductions
@case("row_max_min", none, lambda acc: {"D": acc, "mx": acc.amax(1), "mn": acc.amin(1)})
def _row_max_min(acc):
    return {"D": acc, "mx": cc.row_max(acc), "mn": cc.row_min(acc)}


@case("col_sum_dgamma", tile("x"), lambda acc, x: {"dgamma": (acc * x).sum(0), "D": acc})
def _col_sum_dgamma(acc, x: cc.Tile):
    return {"dgamma": cc.col_sum(acc * x), "D": acc}


@case("col_max_min", none, lambda acc: {"D": acc * 2.0, "cmx": acc.amax(0), "cmn": acc.amin(0)})
def _col_max_min(acc):
    return {"D": acc * 2.0, "cmx": cc.col_max(acc), "cmn": cc.col_min(acc)}


@case("total_sum", none, lambda acc: {"D": acc, "loss": (acc * acc).sum()})
def _total_sum(acc):
    return {"D": acc, "loss": cc.total_sum(acc * acc)}


# fp8 amax scaling: the global max |y| (a 0-dim fp32 tensor), finished from per-tile row partials.
@case("total_max_min", tile("x"),
      lambda acc, x: {"D": acc * x, "amax": (acc * x).abs().amax(), "tmin": (acc + x).amin()}, nvcc_ci=True)
def _total_max_min(acc, x: cc.Tile):
    y = acc * x
    return {"D": y, "amax": cc.total_max(abs(y)), "tmin": cc.total_min(acc + x)}


@case("many_reductions", tile("x"),
      lambda acc, x: {"D": acc + x, "rs": (acc + x).sum(1), "rmx": acc.amax(1), "cs": (acc * x).sum(0),
                      "cmn": x.amin(0) + 0 * acc.amin(0), "tot": (acc + x).sum()})
def _many_reductions(acc, x: cc.Tile):
    y = acc + x
    return {"D": y, "rs": cc.row_sum(y), "rmx": cc.row_max(acc), "cs": cc.col_sum(acc * x),
            "cmn": cc.col_min(x + 0.0 * acc), "tot": cc.total_sum(y)}


@case("reductions_only", tile("x"), lambda acc, x: {"sumsq": ((acc + x) ** 2).sum(1), "cmax": acc.amax(0)})
def _reductions_only(acc, x: cc.Tile):
    y = acc + x
    return {"sumsq": cc.row_sum(y * y), "cmax": cc.col_max(acc)}


@case("lse_partials", none,
      lambda acc: {"mx": acc.amax(1), "se": torch.exp(acc * 0.1 - 4.0).sum(1)})
def _lse_partials(acc):
    return {"mx": cc.row_max(acc), "se": cc.row_sum(cc.exp(acc * 0.1 - 4.0))}


# ---------------------------------------------------------------------------------------------- outputs
@case("multi_output_dtypes", tile("r"),
      lambda acc, r: {"D": acc + r, "h32": (acc + r) * 0.5, "h16": torch.relu(acc)},
      output_dtypes={"h32": torch.float32, "h16": torch.float16})
def _multi_output_dtypes(acc, r: cc.Tile):
    x = acc + r
    return {"D": x, "h32": x * 0.5, "h16": cc.relu(acc)}


@case("aux_only_named", col("g"), lambda acc, g: {"h": acc * g, "h2": acc - g})
def _aux_only_named(acc, g: cc.PerCol):
    return {"h": acc * g, "h2": acc - g}


@case("accumulate_D", merge(tile("D"), row("r")), lambda acc, D, r: {"D": D + acc * r[:, None]})
def _accumulate_d(acc, r: cc.PerRow):
    return {"D": cc.accumulate(acc * r)}


@case("accumulate_named", merge(tile("dx"), tile("y")),
      lambda acc, dx, y: {"out": acc * y, "dx": dx + acc})
def _accumulate_named(acc, y: cc.Tile):
    return {"out": acc * y, "dx": cc.accumulate(acc)}


@case("fp32_tile_input", tile("resid", dtype=torch.float32), lambda acc, resid: {"D": acc + resid},
      input_dtypes={"resid": torch.float32})
def _fp32_tile_input(acc, resid: cc.Tile):
    return acc + resid


@case("mixed_operands", merge(tile("t"), row("r"), col("c"), scalar("s")),
      lambda acc, t, r, c, s: {"D": (acc * s + r[:, None] + c) * t})
def _mixed_operands(acc, t: cc.Tile, r: cc.PerRow, c: cc.PerCol, s: cc.Scalar):
    return (acc * s + r + c) * t


@case("swiglu_separate", tile("up"), lambda acc, up: {"D": F.silu(acc) * up})
def _swiglu_separate(acc, up: cc.Tile):
    return torch.nn.functional.silu(acc) * up


# The RMSNorm backward dX epilogue of docs/TRANSFORMER_MATH.md: acc = delta.
@case("norm_backward",
      merge(tile("x"), row("r", 0.5, 1.5, torch.float32), row("c", -0.5, 0.5, torch.float32), col("g", 0.5, 1.5),
            tile("dres")),
      lambda acc, x, r, c, g, dres: {
          "dres": dres + (acc * g - x * r[:, None] * c[:, None]) * r[:, None],
          "y": x * r[:, None] * g,
          "dgamma": (acc * x * r[:, None]).sum(0)},
      input_dtypes={"r": torch.float32, "c": torch.float32})
def _norm_backward(acc, x: cc.Tile, r: cc.PerRow, c: cc.PerRow, g: cc.PerCol):
    xhat = x * r
    return {"dres": cc.accumulate((acc * g - xhat * c) * r), "y": xhat * g, "dgamma": cc.col_sum(acc * xhat)}


# ---------------------------------------------------------------------------------------------- layouts, dtypes
@case("kn_residual", tile("resid"), lambda acc, resid: {"D": acc + resid}, weight_layout="kn")
def _kn_residual(acc, resid: cc.Tile):
    return acc + resid


@case("fp16_bias_relu", col("bias"), lambda acc, bias: {"D": torch.relu(acc + bias), "s": (acc + bias).sum(1)},
      dtype=torch.float16)
def _fp16_bias_relu(acc, bias: cc.PerCol):
    return {"D": cc.relu(acc + bias), "s": cc.row_sum(acc + bias)}


@case("every_op", merge(tile("t"), row("r"), col("c", 1.0, 2.0), scalar("s")),
      lambda acc, t, r, c, s: {
          "D": (torch.exp(acc * 0.01) + torch.log(acc.abs() + 1.0) + torch.sqrt(acc.abs()) + torch.rsqrt(acc.abs() + 1.0)
                + torch.reciprocal(c) + torch.tanh(acc) + torch.sigmoid(acc) + F.silu(acc) + F.gelu(acc)
                + F.gelu(acc, approximate="tanh") + torch.relu(-acc) + torch.square(t) + (acc.abs() + 1.0) ** 0.7
                + torch.maximum(acc, t) - torch.minimum(acc, t) + acc / c - r[:, None] * s
                + torch.where(t > 0, 1.0, 0.0) + torch.where(t < 0, 1.0, 0.0) + torch.where(t >= 0.5, 1.0, 0.0)
                + torch.where(t <= -0.5, 1.0, 0.0) + torch.where(t == 0, 1.0, 0.0) + torch.where(t != 0, 1.0, 0.0)
                + acc.to(torch.bfloat16).float()),
          "rs": acc.sum(1), "rmx": acc.amax(1), "rmn": acc.amin(1),
          "cs": acc.sum(0), "cmx": acc.amax(0), "cmn": acc.amin(0), "tot": acc.sum()},
      nvcc_ci=True)
def _every_op(acc, t: cc.Tile, r: cc.PerRow, c: cc.PerCol, s: cc.Scalar):
    y = (cc.exp(acc * 0.01) + cc.log(abs(acc) + 1.0) + cc.sqrt(abs(acc)) + cc.rsqrt(abs(acc) + 1.0)
         + cc.reciprocal(c) + cc.tanh(acc) + cc.sigmoid(acc) + cc.silu(acc) + cc.gelu(acc)
         + cc.gelu(acc, approximate="tanh") + cc.relu(-acc) + cc.square(t) + (abs(acc) + 1.0) ** 0.7
         + cc.maximum(acc, t) - cc.minimum(acc, t) + acc / c - r * s
         + (t > 0) + (t < 0) + (t >= 0.5) + (t <= -0.5) + (t == 0) + (t != 0)
         + cc.cast(acc, torch.bfloat16))
    return {"D": y, "rs": cc.row_sum(acc), "rmx": cc.row_max(acc), "rmn": cc.row_min(acc),
            "cs": cc.col_sum(acc), "cmx": cc.col_max(acc), "cmn": cc.col_min(acc), "tot": cc.total_sum(acc)}


# A CI compile that covers the kn layout, accumulation into a named output, scalars and no "D".
@case("kn_accumulate_no_d", merge(tile("dx"), scalar("s"), row("r")),
      lambda acc, dx, s, r: {"dx": dx + acc * s, "rsum": (acc * r[:, None]).sum(1)},
      weight_layout="kn", nvcc_ci=True)
def _kn_accumulate_no_d(acc, s: cc.Scalar, r: cc.PerRow):
    return {"dx": cc.accumulate(acc * s), "rsum": cc.row_sum(acc * r)}


case("partials_norm_stats", merge(tile("resid"), col("g")), _norm_stats_expect,
     partial_reductions=True)(_norm_stats)


@case("small_tile_config", tile("resid"), lambda acc, resid: {"D": acc + resid, "s": (acc + resid).sum(1)},
      config=cc.KernelConfig(tile_m=128, tile_n=128, tile_k=64, cluster_m=1, cluster_n=1))
def _small_tile_config(acc, resid: cc.Tile):
    x = acc + resid
    return {"D": x, "s": cc.row_sum(x)}


# ------------------------------------------------------------------------ pairwise, LSE, gather, segments
def _pairs(x: T) -> tuple[T, T]:
    return x[:, 0::2], x[:, 1::2]


def _interleave(a: T, b: T) -> T:
    return torch.stack((a, b), -1).flatten(-2)


def _swiglu_expect(acc, r):
    z = acc * r[:, None]
    g, u = _pairs(z)
    return {"z": z, "y": F.silu(g) * u}


@case("swiglu", row("r", dtype=torch.float32), _swiglu_expect)
def _swiglu(acc, r: cc.PerRow(torch.float32)):
    z = acc * r
    g, u = cc.pairs(z)
    return {"z": z, "y": cc.half_width(cc.silu(g) * u)}


@case("geglu_f16_half_only", row("r", dtype=torch.float32),
      lambda acc, r: {"y": F.gelu((acc * r[:, None])[:, 0::2], approximate="tanh") * (acc * r[:, None])[:, 1::2]},
      dtype=torch.float16)
def _geglu_f16(acc, r: cc.PerRow(torch.float32)):
    g, u = cc.pairs(acc * r)
    return {"y": cc.half_width(cc.gelu(g, approximate="tanh") * u)}


def _rope_inputs(M: int, N: int, dt: torch.dtype, dev: torch.device, g: torch.Generator) -> dict[str, Any]:
    pos = torch.randint(0, 8192, (M,), generator=g).float()
    inv = 10000.0 ** (-torch.arange(0, N // 2, dtype=torch.float32) / max(N // 2, 1))
    freq = inv.repeat_interleave(2)
    freq[(2 * N) // 3 // 2 * 2:] = 0.0          # the last third: "V" columns, not rotated
    return {"r": _rand((M,), torch.float32, dev, g, 0.5, 1.5), "pos": pos.to(dev), "freq": freq.to(dev)}


def _rope_expect(acc, r, pos, freq):
    z = acc * r[:, None]
    theta = pos[:, None] * freq[None, :]
    c, s = torch.cos(theta)[:, 0::2], torch.sin(theta)[:, 0::2]
    x, y = _pairs(z)
    return {"D": _interleave(x * c - y * s, x * s + y * c)}


@case("rope", _rope_inputs, _rope_expect)
def _rope(acc, r: cc.PerRow(torch.float32), pos: cc.PerRow(torch.float32), freq: cc.PerCol(torch.float32)):
    theta = pos * freq
    c, s = cc.cos(theta), cc.sin(theta)
    return cc.pair_map(lambda x, y: (x * c - y * s, x * s + y * c), acc * r)


@case("rope_rotate_pairs_f16", _rope_inputs, _rope_expect, dtype=torch.float16, nvcc_ci=True)
def _rope_rotate(acc, r: cc.PerRow(torch.float32), pos: cc.PerRow(torch.float32), freq: cc.PerCol(torch.float32)):
    return cc.rotate_pairs(acc * r, pos * freq)


def _pair_generic_expect(acc, bias, r):
    e, o = _pairs(acc + bias)
    return {"D": _interleave(e * o, torch.maximum(e, o) - r[:, None]),
            "rr": _interleave(r[:, None].expand_as(e), 2 * r[:, None].expand_as(e)),
            "s": 2 * (e * o).sum(1)}


@case("pair_generic", merge(col("bias"), row("r")), _pair_generic_expect)
def _pair_generic(acc, bias: cc.PerCol, r: cc.PerRow):
    e, o = cc.pairs(acc + bias)
    prod = e * o
    return {"D": cc.interleave(prod, cc.maximum(e, o) - r), "rr": cc.interleave(r, 2.0 * r),
            "s": cc.row_sum(prod)}     # each pair's product sits on both of its columns


def _lm_inputs(M: int, N: int, dt: torch.dtype, dev: torch.device, g: torch.Generator) -> dict[str, Any]:
    t = torch.randint(0, N, (M,), generator=g)
    t[torch.rand(M, generator=g) < 0.1] = -100          # ignore_index rows gather 0
    return {"r": _rand((M,), torch.float32, dev, g, 4.0, 8.0), "target": t.to(dev)}


def _lm_expect(acc, r, target):
    x = acc * r[:, None]
    idx = target.long().clamp(0, x.shape[1] - 1)
    picked = x.gather(1, idx[:, None])[:, 0]
    return {"lse": torch.logsumexp(x, 1), "tgt": torch.where(target.long() >= 0, picked, torch.zeros_like(picked))}


@case("lm_head_lse_gather", _lm_inputs, _lm_expect)
def _lm_head(acc, r: cc.PerRow(torch.float32), target: cc.PerRow(torch.int64)):
    x = acc * r
    return {"lse": cc.row_logsumexp(x), "tgt": cc.gather(x, target)}


def _lm_logits_expect(acc, r, target):
    out = _lm_expect(acc, r, target)
    out["D"] = acc * r[:, None]
    return out


@case("lm_head_logits_i32", lambda M, N, dt, dev, g: {**_lm_inputs(M, N, dt, dev, g),
                                                      "target": torch.randint(0, N, (M,), generator=g).int().to(dev)},
      _lm_logits_expect)
def _lm_head_logits(acc, r: cc.PerRow(torch.float32), target: cc.PerRow(torch.int32)):
    x = acc * r
    return {"D": x, "lse": cc.row_logsumexp(x), "tgt": cc.gather(x, target)}


def _lm_head_partials(acc, r: cc.PerRow(torch.float32), target: cc.PerRow(torch.int64)):
    x = acc * r
    return {"lse": cc.row_logsumexp(x), "tgt": cc.gather(x, target)}


case("lm_head_lse_partials", _lm_inputs, _lm_expect, partial_reductions=True)(_lm_head_partials)


def _lse_mask_inputs(M: int, N: int, dt: torch.dtype, dev: torch.device, g: torch.Generator) -> dict[str, Any]:
    cm = (torch.rand(N, generator=g) < 0.7).float()
    cm[: min(N, 300)] = 0.0                     # whole N-tiles of -inf
    rm = (torch.rand(M, generator=g) < 0.9).float()
    return {"cm": cm.to(dev), "rm": rm.to(dev)}


def _lse_mask_expect(acc, cm, rm):
    x = torch.where((cm[None, :] * rm[:, None]) > 0, acc, torch.full_like(acc, float("-inf")))
    return {"lse": torch.logsumexp(x, 1)}


@case("lse_masked_rows_and_tiles", _lse_mask_inputs, _lse_mask_expect)
def _lse_masked(acc, cm: cc.PerCol(torch.float32), rm: cc.PerRow(torch.float32)):
    return {"lse": cc.row_logsumexp(cc.where(cm * rm > 0.0, acc, float("-inf")))}


def _pair_tile(name: str, scale: float = 1.0):
    return lambda M, N, dt, dev, g: {name: _randn((M, 2 * N), dt, dev, g, scale)}


def _swiglu_bwd_expect(acc, z):
    g, u = _pairs(z)
    s = torch.sigmoid(g)
    dg = acc * u * s * (1 + g * (1 - s))
    du = acc * g * s
    return {"D": g * s * u, "dz": _interleave(dg, du), "zdz": (g * dg + u * du).sum(1)}


@case("swiglu_backward", _pair_tile("z"), _swiglu_bwd_expect, nvcc_ci=True)
def _swiglu_backward(acc, z: cc.PairTile):
    g, u = cc.unpack(z)
    s = cc.sigmoid(g)
    dg = acc * u * s * (1.0 + g * (1.0 - s))
    du = acc * g * s
    return {"D": g * s * u, "dz": cc.pack(dg, du), "zdz": cc.row_sum(g * dg + u * du)}


def _segments(x: T, w: int) -> T:
    return x.reshape(x.shape[0], -1, w).sum(2)


@case("segment_sum_heads", row("r", dtype=torch.float32),
      lambda acc, r: {"D": acc * r[:, None], "ss": _segments((acc * r[:, None]) ** 2, 128)}, n_multiple=128)
def _segment_heads(acc, r: cc.PerRow(torch.float32)):
    z = acc * r
    return {"D": z, "ss": cc.segment_sum(z * z, 128)}


@case("segment_sum_narrow", none, lambda acc: {"ss": _segments(acc, 32), "rows": acc.sum(1) * 0 + torch.arange(
      acc.shape[0], dtype=acc.dtype)}, n_multiple=32)
def _segment_narrow(acc):
    return {"ss": cc.segment_sum(acc, 32), "rows": cc.row_max(cc.row_index() + acc * 0.0)}


@case("segment_sum_wide", none, lambda acc: {"s192": _segments(acc, 192), "s384": _segments(acc * acc, 384)},
      n_multiple=384)
def _segment_wide(acc):
    # widths the default 128-wide tile does not fit (issue 14 item 15): the default falls back to a
    # tile width both are multiples of
    return {"s192": cc.segment_sum(acc, 192), "s384": cc.segment_sum(acc * acc, 384)}


BY_NAME = {c.name: c for c in CASES}


def compile_options(c: Case) -> dict[str, Any]:
    opts = dict(c.options)
    opts.setdefault("dtype", torch.bfloat16)
    return opts


def fit_n(c: Case, N: int) -> int:
    """N rounded up to what the case needs (segment widths)."""
    return -(-N // c.n_multiple) * c.n_multiple


def make_inputs(c: Case, M: int, N: int, K: int, device: torch.device | str, seed: int):
    """(A, W, operands) with fresh random values for a case."""
    g = torch.Generator().manual_seed(seed)
    opts = compile_options(c)
    dt = opts["dtype"]
    dev = torch.device(device)
    A = _randn((M, K), dt, dev, g, scale=0.5)
    if opts.get("weight_layout", "nk") == "nk":
        W = _randn((N, K), dt, dev, g, scale=0.5)
    else:
        W = _randn((K, N), dt, dev, g, scale=0.5)
    return A, W, c.inputs(M, N, dt, dev, g)


BUILD_KEYS = ("dtype", "weight_layout", "config", "input_dtypes", "output_dtypes", "constants",
              "partial_reductions")

# What `python -m coda_cutlass prebuild tests/catalog.py` builds.
PREBUILD = [(c.program, {k: v for k, v in compile_options(c).items() if k in BUILD_KEYS}) for c in CASES]
