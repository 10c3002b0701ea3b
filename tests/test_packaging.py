"""The wheel, built with the README's command from a copy of the repository: every module and
template inside (packages are found, not listed), the right tag with and without prebuilt kernels,
licence and URL metadata, nvidia-cutlass only in the [jit] extra. The prebuilt-only install in a
fresh environment without nvcc is in test_nvcc_build.py (it needs one real kernel)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import coda_cutlass as cc
from wheelcheck import (build_wheel, expected_manylinux_tag, expected_package_files, platform_tag, source_copy,
                        system_library, wheel_files, wheel_metadata)


@pytest.fixture(scope="module")
def pure_wheel(tmp_path_factory):
    src = source_copy(tmp_path_factory.mktemp("pure"))
    stray = src / "coda_cutlass" / "nn" / "__pycache__"      # bytecode must never ship
    stray.mkdir(parents=True, exist_ok=True)
    (stray / "block.cpython-311.pyc").write_bytes(b"stale")
    return src, build_wheel(src)


def test_wheel_holds_every_module_and_template(pure_wheel):
    src, whl = pure_wheel
    files = wheel_files(whl)
    expected = expected_package_files(src)
    assert {"coda_cutlass/tuning/__init__.py", "coda_cutlass/epilogues/norms.py",
            "coda_cutlass/templates/kernel.cu.j2", "coda_cutlass/templates/coda/visitor.hpp",
            "coda_cutlass/prebuilt/README.md"} <= expected
    assert expected - files == set()
    assert not [f for f in files if f.endswith(".pyc") or "__pycache__" in f]
    assert not [f for f in files if f.startswith(("tests/", "bench/", "epilogues/", "templates/"))]
    assert any(f.endswith(".dist-info/licenses/LICENSE") or f.endswith(".dist-info/LICENSE") for f in files)


def test_pure_wheel_metadata(pure_wheel):
    _, whl = pure_wheel
    assert whl.name.endswith("-py3-none-any.whl")
    assert wheel_metadata(whl, "WHEEL")["Root-Is-Purelib"] == "true"
    meta = wheel_metadata(whl)
    assert "MIT" in (meta.get("License-Expression") or meta.get("License") or "")
    assert meta["Home-page"] or meta.get_all("Project-URL")
    requires = meta.get_all("Requires-Dist")
    plain = [r for r in requires if "extra ==" not in r]
    assert sorted(r.split(">")[0].split("<")[0] for r in plain) == ["jinja2", "torch"], requires
    assert any(r.startswith("nvidia-cutlass") and 'extra == "jit"' in r for r in requires)
    assert {"jit", "test"} <= set(meta.get_all("Provides-Extra"))


def test_a_wheel_with_an_unreadable_kernel_is_tagged_for_the_platform(tmp_path):
    """The tag depends on the .so files under coda_cutlass/prebuilt: a stand-in that is no ELF
    library meets no manylinux tag, so the wheel is impure and tagged for this platform."""
    (tmp_path / "k.so").write_bytes(b"\x7fELF stand-in")
    (tmp_path / "k.json").write_text(json.dumps({"source_key": "k"}))
    src = source_copy(tmp_path / "src", prebuilt=[tmp_path / "k.so", tmp_path / "k.json"])
    whl = build_wheel(src)
    assert whl.name.endswith(f"-py3-none-{platform_tag()}.whl"), whl.name
    wheel = wheel_metadata(whl, "WHEEL")
    assert wheel["Root-Is-Purelib"] == "false" and wheel["Tag"] == f"py3-none-{platform_tag()}"
    assert {"coda_cutlass/prebuilt/k.so", "coda_cutlass/prebuilt/k.json"} <= wheel_files(whl)


def test_a_wheel_with_shared_libraries_gets_the_manylinux_tag_they_meet(tmp_path):
    """PyPI refuses linux_x86_64: a wheel whose .so files need only what manylinux platforms have is
    tagged manylinux_2_X, X from the glibc symbol versions they need (here a system library stands
    in for a kernel, which needs the same kind of libraries; test_nvcc_build.py ships a real one)."""
    lib = system_library("libgcc_s.so.1")
    shutil.copy(lib, tmp_path / "k.so")
    src = source_copy(tmp_path / "src", prebuilt=[tmp_path / "k.so"])
    whl = build_wheel(src)
    tag = expected_manylinux_tag([lib])
    assert tag.startswith("manylinux_2_") and whl.name.endswith(f"-py3-none-{tag}.whl"), (whl.name, tag)
    assert wheel_metadata(whl, "WHEEL")["Tag"] == f"py3-none-{tag}"


def test_missing_map_kernel_without_toolchain_is_explained(tmp_path, monkeypatch):
    """Like a GEMM kernel's (test_build_process.py): a map kernel names its program and dtype."""
    @cc.epilogue
    def scale_rows(acc, r: cc.PerRow(torch.float32)):
        return acc * r
    monkeypatch.setenv("CODA_CUTLASS_NVCC", str(tmp_path / "no-nvcc"))
    with pytest.raises(cc.ToolchainError, match=r"epilogue kernel 'scale_rows' for (torch\.)?bf(loat)?16") as e:
        cc.compile_map(scale_rows, dtype=torch.bfloat16, verbose=False)
    assert "prebuilt kernels" in str(e.value)
