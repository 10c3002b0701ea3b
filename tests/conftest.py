"""Shared test set-up: the catalogue on sys.path, an isolated kernel cache, GPU detection."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Keep test builds out of the user's cache unless a cache was chosen explicitly (the GPU runs carry
# a prebuilt one).
if "CODA_CUTLASS_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="coda-cutlass-test-cache-")
    os.environ["CODA_CUTLASS_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)


def hopper_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)


requires_hopper = pytest.mark.skipif(not hopper_available(), reason="needs an sm_90 GPU (H100/H200)")


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    """Builds go through tests/fake_nvcc.py (instant, countable) into a private cache."""
    log = tmp_path / "nvcc.calls"
    log.write_text("")
    monkeypatch.setenv("CODA_CUTLASS_NVCC", str(Path(__file__).resolve().parent / "fake_nvcc.py"))
    monkeypatch.setenv("FAKE_NVCC_LOG", str(log))
    monkeypatch.setenv("CODA_CUTLASS_QUIET", "1")
    monkeypatch.delenv("CODA_CUTLASS_PREBUILT_PATH", raising=False)
    cache = tmp_path / "cache"
    monkeypatch.setenv("CODA_CUTLASS_CACHE_DIR", str(cache))
    return {"log": log, "cache": cache, "tmp": tmp_path}


@pytest.fixture
def ops_on_cpu(fake_nvcc, monkeypatch):
    """The kernels' custom ops (registered for CUDA) served on the CPU too, Dynamo's caches fresh
    (the tests then stand in for the launches: Kernel.run, CompiledMap.run)."""
    real_impl = torch.library.Library.impl

    def impl(self, name, fn, key="", **kw):
        real_impl(self, name, fn, key, **kw)
        if key == "CUDA":
            real_impl(self, name, fn, "CPU", **kw)
    monkeypatch.setattr(torch.library.Library, "impl", impl)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
