"""Real nvcc builds of a few catalogue kernels (about a minute each on 2 cores), then a look inside
the built library through its C ABI, which works without a GPU."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

import coda_cutlass as cc
from coda_cutlass import epilogues as E
from catalog import BUILD_KEYS, CASES, compile_options
from coda_cutlass.runtime.library import load

CI_CASES = [c for c in CASES if c.nvcc_ci]

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None and not __import__("os").environ.get(
    "CODA_CUTLASS_NVCC"), reason="nvcc not installed")


@pytest.fixture(scope="module")
def built():
    items = [(c.program, {k: v for k, v in compile_options(c).items() if k in BUILD_KEYS}) for c in CI_CASES]
    return dict(zip([c.name for c in CI_CASES], cc.compile_many(items, jobs=2)))


@pytest.mark.parametrize("case", CI_CASES, ids=lambda c: c.name)
def test_kernel_builds_and_describes_itself(built, case):
    k = built[case.name]
    assert k.path.is_file() and k.path.stat().st_size > 100_000
    syms = subprocess.run(["nm", "-D", "--defined-only", str(k.path)], capture_output=True, text=True).stdout
    exported = {line.split()[-1] for line in syms.splitlines() if " T " in line}
    assert {"coda_run", "coda_workspace_size", "coda_describe", "coda_abi_version",
            "coda_status_string"} <= exported
    assert not [s for s in exported if not s.startswith("coda_") and not s.startswith("_")], exported
    lib = load(k.path)
    assert lib.description == k.plan.describe()
    assert lib.status_string(3) == "a tensor accessed by TMA is not 16-byte aligned"
    assert lib.workspace_size(1000, 776, 520) >= 0
    if k.origin == "built":      # (an entry built by an older coda-cutlass has no record)
        r = k.resources
        assert r is not None and 32 <= r.registers <= 255 and r.entry_functions >= 1, r


def test_cached_second_compile_is_instant(built):
    case = CI_CASES[0]
    k = cc.compile_epilogue(case.program, **{k: v for k, v in compile_options(case).items() if k in BUILD_KEYS})
    assert k.origin == "cache" and k.path == built[case.name].path


def test_calling_without_gpu_raises_device_error(built):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; tests/gpu covers calls")
    k = built["residual_norm_stats"]
    A = torch.zeros(128, 64, dtype=torch.bfloat16)
    with pytest.raises(cc.DeviceError, match="no CUDA GPU"):
        k(A, A, resid=None, g=None)


# One FP8 kernel per kind of mainloop: the FP8 mainloop with tensor scales applied by a visitor node,
# and the blockwise-scaled mainloop with mixed e4m3 x e5m2 operands (CUTLASS's static_asserts accept
# both configurations only if these build).
FP8_CI = {
    "fp8_tensor_norm_stats": (E.residual_norm_stats, {"dtype": torch.float8_e4m3fn}),
    "fp8_block_swiglu_mixed": (E.swiglu, {"dtype": (torch.float8_e4m3fn, torch.float8_e5m2), "scaling": "block"}),
}


@pytest.fixture(scope="module")
def built_fp8():
    return dict(zip(FP8_CI, cc.compile_many(list(FP8_CI.values()), jobs=2)))


@pytest.mark.parametrize("name", list(FP8_CI))
def test_fp8_kernel_builds_and_describes_itself(built_fp8, name):
    k = built_fp8[name]
    lib = load(k.path)
    assert lib.description == k.plan.describe()
    assert lib.description["fp8"]["scaling"] == FP8_CI[name][1].get("scaling", "tensor")
    assert [t["name"] for t in lib.description["tensors"] if t["role"] == "gemm_scale"] == ["scale_a", "scale_b"]
    assert lib.workspace_size(1024, 512, 512) >= 0
    assert "FP8" in k.source[:1500] and k.config.tile_k == 128
    if not torch.cuda.is_available():
        A = torch.zeros(128, 128, dtype=torch.float8_e4m3fn)
        with pytest.raises(cc.DeviceError, match="no CUDA GPU"):
            k(A, A, scale_a=torch.ones(()), scale_b=torch.ones(()))


LAYOUT_CHECKS = r"""
// The compile-time fragment-layout checks of coda/pairwise.hpp must accept the wgmma-style
// pairing and refuse layouts where pairs are not adjacent columns or start at odd columns.
#include "coda/pairwise.hpp"
using namespace cute;
using C0 = ScaledBasis<_1, 0>;  // one row down
using C1 = ScaledBasis<_1, 1>;  // one column right
// fragment (relative to the thread's origin): (col+1) x (row+8) x (col+8), as wgmma accumulators
using Good = Layout<Shape<_2, _2, _2>, Stride<C1, ScaledBasis<_8, 0>, ScaledBasis<_8, 1>>>;
using Vertical = Layout<Shape<_2, _2>, Stride<C0, C1>>;                        // pairs stacked in rows
using OddStart = Layout<Shape<_2, _2>, Stride<C1, ScaledBasis<_3, 1>>>;       // 2nd pair at column 3
static_assert(coda::detail::coordinate_pairs_adjacent<Good>(), "wgmma pairs");
static_assert(!coda::detail::coordinate_pairs_adjacent<Vertical>(), "vertical pairs");
static_assert(!coda::detail::coordinate_pairs_adjacent<OddStart>(), "odd start");
// thread -> origin: quads step two columns (wgmma) vs one column
using ThrEven = Layout<Shape<_4, _8>, Stride<ScaledBasis<_2, 1>, C0>>;
using ThrOdd = Layout<Shape<_4, _8>, Stride<C1, C0>>;
static_assert(coda::detail::mode_steps_even<ThrEven>(std::make_index_sequence<2>{}), "even origins");
static_assert(!coda::detail::mode_steps_even<ThrOdd>(std::make_index_sequence<2>{}), "odd origins");
int main() { return 0; }
"""


def test_pair_layout_checks_accept_and_refuse(tmp_path):
    """The static layout predicates behind every pairwise kernel, compiled by nvcc: the build fails
    if a check accepts a bad layout or refuses the good one."""
    from coda_cutlass.build.toolchain import toolchain
    from coda_cutlass.paths import include_dir
    tc = toolchain()
    src = tmp_path / "layout_checks.cu"
    src.write_text(LAYOUT_CHECKS)
    cmd = [tc.nvcc, "-std=c++17", "--expt-relaxed-constexpr", "-arch=sm_90a", "-c", "-o", str(tmp_path / "x.o"),
           f"-I{include_dir()}"] + [f"-I{i}" for i in tc.cutlass_include] + [str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def test_wheel_with_a_prebuilt_kernel_works_without_nvcc(built, tmp_path):
    """The README's `pip wheel --no-deps -w dist .` with one real prebuilt kernel (the catalogue's
    residual_norm_stats, the same source as coda_cutlass.epilogues.residual_norm_stats), installed
    into a fresh environment without nvcc, without nvidia-cutlass and without the repository on
    sys.path: the kernel is found as prebuilt (and its .so loads); a program that was not prebuilt
    raises an error naming the program, the dtype and the folders searched."""
    from coda_cutlass.build.export import export_prebuilt
    from wheelcheck import (PREBUILT_CHECK, REPO, build_wheel, env_without_toolchain, expected_manylinux_tag,
                            fresh_venv, install_wheel, run_python, source_copy, wheel_files)
    kernel = built["residual_norm_stats"]
    so = export_prebuilt(kernel, tmp_path / "prebuilt")
    src = source_copy(tmp_path / "src", prebuilt=[so, so.with_suffix(".json")])
    whl = build_wheel(src)
    tag = expected_manylinux_tag([so])        # what PyPI takes (readelf: e.g. GLIBC_2.34 -> manylinux_2_34)
    assert whl.name.endswith(f"-py3-none-{tag}.whl") and f"coda_cutlass/prebuilt/{so.name}" in wheel_files(whl)
    python = fresh_venv(tmp_path)
    install_wheel(python, whl)
    work = tmp_path / "work"
    work.mkdir()
    out = run_python(python, PREBUILT_CHECK, env_without_toolchain(tmp_path / "cache"), work)
    site = str(tmp_path / "venv")
    assert out["package"].startswith(site), out["package"]
    assert not [p for p in out["sys_path"] if p and (p == str(REPO) or p.startswith(str(REPO / "tests")))]
    assert out["nvcc"] is None and not out["cutlass"]
    assert [r for r in out["requires"] if r.startswith("nvidia-cutlass")] and \
        all('extra == "jit"' in r or 'extra == "test"' in r for r in out["requires"] if r.startswith("nvidia-cutlass"))
    assert out["origin"] == "prebuilt" and out["path"].startswith(site) and out["path"].endswith(so.name)
    assert out["described"]
    missing = out["missing"]
    assert missing and missing["type"] == "ToolchainError", out
    prebuilt_dir = out["path"].rsplit("/", 1)[0]
    for part in ("epilogue kernel 'residual_add'", "torch.float16", prebuilt_dir):
        assert part in missing["message"], (part, missing["message"])
    assert out["emit"]["rc"] == 0 and "coda-cutlass generated kernel: swiglu" in out["emit"]["stdout"]
    err = out["prebuild"]["stderr"].strip()
    assert out["prebuild"]["rc"] == 2 and err.startswith("error: cannot build epilogue kernel") and \
        "Traceback" not in err, err
