"""The build layer with a fake nvcc (fast): cache hits, content keys, corruption, concurrency,
read-only fallback, failure reporting, permissions. Real nvcc builds are in test_nvcc_build.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

import coda_cutlass as cc
from coda_cutlass.build import builder as builder_mod
from coda_cutlass.build.builder import build
from coda_cutlass.build.cache import KernelCache
from coda_cutlass.build.keys import build_key, source_key
from coda_cutlass.build.toolchain import toolchain
from fake_nvcc import payload

HERE = Path(__file__).resolve().parent
SRC = "// kernel source\nint x;\n"


@pytest.fixture
def fake(fake_nvcc):
    return fake_nvcc


def calls(fake) -> int:
    return len(fake["log"].read_text().splitlines())


def test_build_then_cache_hit(fake):
    r1 = build(SRC, "k")
    r2 = build(SRC, "k")
    assert (r1.origin, r2.origin) == ("built", "cache")
    assert r1.path == r2.path and calls(fake) == 1
    entry = r1.path.parent
    for f in ("kernel.cu", "kernel.so", "meta.json", "nvcc.log", "build.sh", "include/coda/functors.hpp"):
        assert (entry / f).is_file(), f
    assert "-DNDEBUG" in (entry / "build.sh").read_text()


def test_key_is_content_not_path(fake, tmp_path):
    tc = toolchain()
    k1 = build_key(SRC, tc)
    other = KernelCache(tmp_path / "elsewhere")
    assert k1 == build_key(SRC, tc)
    assert build_key(SRC + " ", tc) != k1
    assert str(tmp_path) not in k1 and other.entry_dir(k1).name == k1


def test_nvcc_version_change_misses(fake, monkeypatch, tmp_path):
    build(SRC, "k")
    other = tmp_path / "nvcc2.py"
    shutil.copy(HERE / "fake_nvcc.py", other)
    monkeypatch.setenv("CODA_CUTLASS_NVCC", str(other))
    monkeypatch.setenv("FAKE_NVCC_VERSION", "99.0.2")
    assert build(SRC, "k").origin == "built" and calls(fake) == 2


def test_cutlass_and_generator_version_changes_miss(fake, monkeypatch):
    from dataclasses import replace
    from coda_cutlass.build import keys
    tc = toolchain()
    base = build_key(SRC, tc)
    assert build_key(SRC, replace(tc, cutlass_version="9.9.9")) != base
    monkeypatch.setattr(keys, "__version__", "0.0.0-other")
    assert build_key(SRC, tc) != base


def test_corrupt_entry_is_rebuilt(fake):
    r1 = build(SRC, "k")
    r1.path.write_bytes(r1.path.read_bytes()[:5])      # truncated .so
    with pytest.warns(RuntimeWarning, match="discarded cache entry"):
        r2 = build(SRC, "k")
    assert r2.origin == "built" and calls(fake) == 2
    assert payload(r2.path) == SRC


def test_missing_meta_is_rebuilt(fake):
    r1 = build(SRC, "k")
    (r1.path.parent / "meta.json").unlink()
    with pytest.warns(RuntimeWarning):
        assert build(SRC, "k").origin == "built"


def test_failed_build_keeps_source_and_log(fake):
    with pytest.raises(cc.BuildError) as e:
        build(SRC + "FAKE_NVCC_FAIL\n", "broken")
    err = e.value
    assert Path(err.source_path).is_file() and Path(err.log_path).is_file()
    assert "FAKE_NVCC_FAIL" in Path(err.log_path).read_text()
    assert "kernel.cu" in str(err) and "nvcc log" in str(err) and "is undefined" in str(err)


def test_nothing_world_writable(fake):
    r = build(SRC, "k")
    for p in [r.path.parent, *r.path.parent.rglob("*")]:
        assert not (p.stat().st_mode & stat.S_IWOTH), p


def test_unwritable_cache_falls_back(fake, monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("CODA_CUTLASS_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr("coda_cutlass.build.cache.fallback_root", lambda: tmp_path / "fallback")
    with pytest.warns(RuntimeWarning, match="not writable"):
        r = build(SRC, "k")
    assert r.origin == "built" and str(r.path).startswith(str(tmp_path / "fallback"))


def test_read_only_cache_still_serves_hits(fake, monkeypatch, tmp_path):
    r = build(SRC, "k")
    monkeypatch.setattr(KernelCache, "writable", property(lambda self: False))
    monkeypatch.setattr("coda_cutlass.build.cache.fallback_root", lambda: tmp_path / "fallback")
    assert build(SRC, "k").origin == "cache"


def test_nvcc_runs_without_a_shell(fake, monkeypatch):
    from coda_cutlass.build import run as run_mod
    seen = {}
    real = subprocess.Popen

    def spy(cmd, **kw):
        seen["cmd"], seen["shell"] = cmd, kw.get("shell", False)
        return real(cmd, **kw)
    monkeypatch.setattr(run_mod.subprocess, "Popen", spy)
    build(SRC + "// again\n", "k")
    assert isinstance(seen["cmd"], list) and seen["shell"] is False
    nvcc = seen["cmd"][seen["cmd"].index("--") + 1:]         # under the supervisor
    assert nvcc[0] == os.environ["CODA_CUTLASS_NVCC"] and "-DNDEBUG" in nvcc


def _build_in_process(src: str) -> str:
    return str(build(src, "k").path)


def test_concurrent_processes_build_once(fake, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "1.0")
    ctx = mp.get_context("spawn")
    sources = [SRC] * 4 + [SRC + "// other\n"] * 2
    with ctx.Pool(6) as pool:
        paths = pool.map(_build_in_process, sources)
    assert len(set(paths[:4])) == 1 and len(set(paths[4:])) == 1
    assert calls(fake) == 2                         # one build per distinct source
    for p in set(paths):
        assert payload(Path(p)).startswith("// kernel source")
    leftovers = [p for p in (fake["cache"] / "tmp").iterdir() if not p.name.startswith(".")]
    assert leftovers == []


def test_prebuilt_found_before_jit(fake, monkeypatch, tmp_path):
    from coda_cutlass.build.files import sha256_file
    pre = tmp_path / "pre"
    pre.mkdir()
    skey = source_key(SRC)
    (pre / f"{skey}.so").write_text("prebuilt")
    (pre / f"{skey}.json").write_text('{"so_sha256": "%s"}' % sha256_file(pre / f"{skey}.so"))
    monkeypatch.setenv("CODA_CUTLASS_PREBUILT_PATH", str(pre))
    monkeypatch.setenv("CODA_CUTLASS_NVCC", "/nonexistent/nvcc")   # no toolchain needed
    r = build(SRC, "k")
    assert r.origin == "prebuilt" and r.path == pre / f"{skey}.so" and calls(fake) == 0


def test_missing_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CODA_CUTLASS_NVCC", str(tmp_path / "no-nvcc"))
    monkeypatch.setenv("CODA_CUTLASS_CACHE_DIR", str(tmp_path / "c"))
    with pytest.raises(cc.ToolchainError, match="not an executable"):
        build(SRC + "// x\n", "k")


def test_missing_cutlass_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CODA_CUTLASS_CUTLASS_DIR", str(tmp_path))
    with pytest.raises(cc.ToolchainError, match="include/cutlass/cutlass.h"):
        toolchain()


def test_compile_without_gpu_builds_and_call_explains(fake):
    import torch
    p = cc.epilogue(lambda acc, t=2.0: acc * t, name="scaled")
    k = cc.compile_epilogue(p, torch.bfloat16)
    assert k.origin == "built" and "Sm90TopologicalVisitor" in k.source and k.path.is_file()
    assert "scaled" in repr(k)
    if not torch.cuda.is_available():
        with pytest.raises(cc.DeviceError, match="no CUDA GPU"):
            k(torch.zeros(8, 8, dtype=torch.bfloat16), torch.zeros(8, 8, dtype=torch.bfloat16))


def test_compile_many_says_others_are_cached_only_when_some_built(fake, monkeypatch):
    """When every build failed, the error still said "(the others are cached)"."""
    import torch
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    progs = [cc.epilogue(lambda acc, c=float(i): acc + c, name=f"f{i}") for i in range(2)]
    with pytest.raises(cc.BuildError, match="2 of 2 kernels failed to build") as e:
        cc.compile_many(progs, torch.bfloat16, jobs=2)
    assert "the others are cached" not in str(e.value)


def test_compile_many_builds_in_parallel(fake, monkeypatch):
    import torch
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "0.5")
    progs = [cc.epilogue(lambda acc, c=float(i): acc + c, name=f"p{i}") for i in range(4)]
    ks = cc.compile_many(progs, torch.bfloat16, jobs=4)
    assert [k.name for k in ks] == ["p0", "p1", "p2", "p3"] and calls(fake) == 4
    assert len({k.path for k in ks}) == 4
