"""The element types the compiler knows, and their names in torch and in CUTLASS C++."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ConfigError


@dataclass(frozen=True)
class DType:
    name: str          # short name used in the IR: "bf16", "f16", "f32", "e4m3", ...
    torch: torch.dtype
    cpp: str           # CUTLASS element type
    bits: int

    def __repr__(self) -> str:
        return self.name


BF16 = DType("bf16", torch.bfloat16, "cutlass::bfloat16_t", 16)
F16 = DType("f16", torch.float16, "cutlass::half_t", 16)
F32 = DType("f32", torch.float32, "float", 32)
# Integer index vectors (per-row targets of a gather); the kernel reads them as exact fp32 (< 2^24).
I32 = DType("i32", torch.int32, "int32_t", 32)
I64 = DType("i64", torch.int64, "int64_t", 64)
# FP8 (Hopper's two formats): scaled GEMM operands (coda_cutlass/fp8), and tile outputs, which convert
# to them saturating to the largest finite value (CUTLASS's cvt.rn.satfinite): +-inf becomes +-max,
# NaN stays NaN.
E4M3 = DType("e4m3", torch.float8_e4m3fn, "cutlass::float_e4m3_t", 8)
E5M2 = DType("e5m2", torch.float8_e5m2, "cutlass::float_e5m2_t", 8)

ALL: tuple[DType, ...] = (BF16, F16, F32, I32, I64, E4M3, E5M2)
FLOAT_DTYPES: tuple[DType, ...] = (BF16, F16, F32)
FP8_DTYPES: tuple[DType, ...] = (E4M3, E5M2)
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}    # the largest finite value of each format
INDEX_DTYPES: tuple[DType, ...] = (I32, I64)
OPERAND_DTYPES: tuple[DType, ...] = (BF16, F16)   # GEMM A/W operands without scales

_BY_NAME = {d.name: d for d in ALL}
_BY_TORCH = {d.torch: d for d in ALL}
_ALIASES = {"bfloat16": BF16, "float16": F16, "half": F16, "float32": F32, "float": F32, "fp32": F32,
            "fp16": F16, "int32": I32, "int64": I64, "long": I64, "int": I32,
            "float8_e4m3fn": E4M3, "fp8_e4m3": E4M3, "float8_e5m2": E5M2, "fp8_e5m2": E5M2}


def round_to(x: torch.Tensor, dtype: "DType") -> torch.Tensor:
    """``x`` (fp32) rounded to ``dtype`` as the kernel stores it: round to nearest even, and for FP8
    saturating to the largest finite value (NaN stays NaN) as CUTLASS's conversion does."""
    if dtype in FP8_MAX:
        m = FP8_MAX[dtype]
        return x.clamp(-m, m).to(dtype.torch)     # clamp keeps NaN; e5m2 would otherwise overflow to inf
    return x.to(dtype.torch)


def as_dtype(value: object, *, what: str = "dtype", allowed: tuple[DType, ...] | None = None) -> DType:
    """Accepts a DType, a torch.dtype or a name ("bf16", "bfloat16", ...); an unknown one is an error
    that lists ``allowed`` (the dtypes the caller takes; default every one known)."""
    if isinstance(value, DType):
        return value
    if isinstance(value, torch.dtype):
        if value in _BY_TORCH:
            return _BY_TORCH[value]
    elif isinstance(value, str):
        key = value.lower()
        if key in _BY_NAME:
            return _BY_NAME[key]
        if key in _ALIASES:
            return _ALIASES[key]
    supported = ", ".join(str(d.torch) for d in (allowed or ALL))
    raise ConfigError(f"{what} {value!r} is not supported; use one of {supported}")


def as_operand_dtype(value: object) -> DType:
    try:
        d = as_dtype(value, what="GEMM operand dtype")
    except ConfigError:
        d = None
    if d not in OPERAND_DTYPES:
        shown = d.torch if d is not None else repr(value)
        raise ConfigError(f"GEMM operand dtype {shown} is not supported; use torch.bfloat16, torch.float16, or "
                          "torch.float8_e4m3fn / torch.float8_e5m2 (scaled FP8 operands, coda_cutlass.fp8)")
    return d
