"""The exact GELU kernels use (templates/coda/gelu.hpp): x * Phi(x) with Phi(-|x|) = 2^p(|x|).

The coefficients are read from the header itself and evaluated the way the device does (fp32,
one rounding per fma); the result is compared with Phi and GELU in float64. The GPU tests check
the compiled kernels against torch."""

from __future__ import annotations

import re

import torch

from coda_cutlass.paths import include_dir

CLAMP = 14.0


def _coefficients() -> list[float]:
    src = (include_dir() / "coda" / "gelu.hpp").read_text()
    body = src[src.index("#if defined(__CUDA_ARCH__)"):src.index("#else")]
    lead = re.search(r"float p = (\S+)f;", body)
    steps = re.findall(r"p = fmaf\(p, t, (\S+)f\);", body)
    assert lead and len(steps) == 10, "gelu.hpp: expected a degree-10 Horner scheme"
    return [float(lead.group(1))] + [float(s) for s in steps]     # highest degree first


def _device_e(t: torch.Tensor) -> torch.Tensor:
    """Phi(-t) as the kernel computes it: fp32 Horner with fma (one rounding), exact exp2,
    flushed to 0 below 2^-126 (ex2.approx.ftz)."""
    t32 = torch.clamp(t.float(), max=CLAMP)
    co = _coefficients()
    p = torch.full_like(t32, co[0])
    for c in co[1:]:
        p = (p.double() * t32.double() + c).float()
    e = torch.exp2(p.double()).float().double()
    return torch.where(p < -126, torch.zeros_like(e), e)


def _phi_neg(t: torch.Tensor) -> torch.Tensor:
    return 0.5 * torch.erfc(t.double() / 2 ** 0.5)


def test_coefficients_start_at_phi_of_zero_and_its_slope():
    co = _coefficients()
    assert co[-1] == -1.0                                         # log2 Phi(0) = -1
    assert abs(co[-2] + (2 / torch.pi) ** 0.5 / torch.log(torch.tensor(2.0)).item()) < 1e-5


def test_phi_error_is_small_in_absolute_terms_and_relative_in_the_tail():
    t = torch.linspace(0, 16, 2_000_001, dtype=torch.float64).float()
    e, ref = _device_e(t), _phi_neg(t)
    err = (e - ref).abs()
    assert err.max() <= 5e-8                      # on Phi itself: x >= 0 gives x * (1 - e)
    rel = err / ref
    assert rel[t < 3].max() <= 4e-6               # x < 0 gives x * e: relative accuracy of e
    assert rel[t < 5].max() <= 1e-3
    assert (e[t >= CLAMP] == 0).all()             # underflows: gelu(-inf) = -inf * 0 = NaN, as torch


def test_gelu_matches_float64_better_than_torch_float32_does():
    x = torch.linspace(-9, 9, 1_000_001, dtype=torch.float64).float()
    e = _device_e(x.abs())
    phi = torch.where(x < 0, e, 1.0 - e)
    ours = (x.double() * phi).float().double()
    exact = x.double() * 0.5 * torch.erfc(-x.double() / 2 ** 0.5)
    torch32 = torch.nn.functional.gelu(x).double()
    scale = x.double().abs().clamp(min=1e-30)
    ours_err = ((ours - exact).abs() / scale).max()
    torch_err = ((torch32 - exact).abs() / scale).max()
    assert ours_err <= 2.5e-7, ours_err           # ~2 fp32 ulps of x, before exp2's own ~2 ulps
    assert ours_err <= 2 * torch_err


def test_exact_gelu_kernels_include_the_header_and_others_do_not():
    import coda_cutlass as cc
    from coda_cutlass import epilogues as E
    from coda_cutlass.build.keys import included_headers

    def source(program):
        return cc.emit(program, torch.bfloat16)
    exact, tanh_form = source(E.bias_gelu), source(E.geglu)
    assert "coda/gelu.hpp" in included_headers(exact) and "coda::gelu_exact" in exact
    assert "coda/gelu.hpp" not in included_headers(tanh_form) and "gelu_exact" not in tanh_form
