"""The FP8 kernels the GPU tests run (tests/gpu/test_fp8_gpu.py), in one list so scripts/gpu_fp8.sh
can build them all in parallel before the tests start (the tests then load them from the cache).

Each case: a library epilogue, its FP8 options, and how to make its epilogue operands."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import coda_cutlass as cc
from coda_cutlass import epilogues as E

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _resid_g(M: int, N: int, g: torch.Generator) -> dict[str, Any]:
    return {"resid": torch.randn(M, N, generator=g, device="cuda").bfloat16(),
            "g": (torch.rand(N, generator=g, device="cuda") + 0.5).bfloat16()}


def _r(M: int, N: int, g: torch.Generator) -> dict[str, Any]:
    return {"r": torch.rand(M, generator=g, device="cuda") + 0.5}


def _lse(M: int, N: int, g: torch.Generator) -> dict[str, Any]:
    return {"r": torch.rand(M, generator=g, device="cuda") + 0.5,
            "target": torch.randint(0, N, (M,), generator=g, device="cuda")}


def _none(M: int, N: int, g: torch.Generator) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Fp8Case:
    name: str
    program: Any
    options: dict[str, Any]
    operands: Callable[[int, int, torch.Generator], dict[str, Any]]
    n_multiple: int = 128              # N of the test shapes is a multiple of this
    fast: bool = False                 # fast accumulation: judged by a looser, measured bound
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        d = self.options["dtype"]
        return d if isinstance(d, tuple) else (d, d)

    @property
    def scaling(self) -> str:
        return self.options.get("scaling", "tensor")


PINGPONG_64 = cc.KernelConfig(tile_m=64, tile_n=128, tile_k=128, cluster_m=2, cluster_n=1, schedule="pingpong")

CASES: tuple[Fp8Case, ...] = (
    Fp8Case("identity_tensor", E.identity, {"dtype": E4}, _none),
    Fp8Case("identity_block", E.identity, {"dtype": E4, "scaling": "block"}, _none),
    Fp8Case("norm_stats_tensor", E.residual_norm_stats, {"dtype": E4}, _resid_g),
    Fp8Case("norm_stats_block", E.residual_norm_stats, {"dtype": E4, "scaling": "block"}, _resid_g),
    Fp8Case("swiglu_row", E.swiglu, {"dtype": E4, "scaling": "row"}, _r),
    Fp8Case("swiglu_block", E.swiglu, {"dtype": E4, "scaling": "block"}, _r),
    Fp8Case("identity_block_16x128", E.identity, {"dtype": E4, "scaling": "block_16x128"}, _none),
    Fp8Case("lm_head_lse_block_1x128_mixed", E.lm_head_lse, {"dtype": (E4, E5), "scaling": "block_1x128"}, _lse),
    Fp8Case("identity_tensor_e5m2_x_e4m3", E.identity, {"dtype": (E5, E4)}, _none),
    Fp8Case("identity_tensor_e5m2", E.identity, {"dtype": E5}, _none),
    Fp8Case("identity_block_pingpong64", E.identity, {"dtype": E4, "scaling": "block", "config": PINGPONG_64},
            _none),
    Fp8Case("identity_tensor_fast", E.identity, {"dtype": E4, "fast_accum": True}, _none, fast=True),
    Fp8Case("identity_row_fast", E.identity, {"dtype": E4, "scaling": "row", "fast_accum": True}, _none, fast=True),
)
BY_NAME = {c.name: c for c in CASES}


def build_items() -> list[tuple[Any, dict[str, Any]]]:
    """(program, options) of every case, for cc.compile_many."""
    return [(c.program, dict(c.options)) for c in CASES]
