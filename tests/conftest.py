"""Shared test set-up: the catalogue on sys.path, an isolated kernel cache, GPU detection."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Keep test builds out of the user's cache unless a cache was chosen explicitly (the GPU runs carry
# a prebuilt one).
if "CODA_CUTLASS_CACHE_DIR" not in os.environ:
    os.environ["CODA_CUTLASS_CACHE_DIR"] = tempfile.mkdtemp(prefix="coda-cutlass-test-cache-")


def hopper_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)


requires_hopper = pytest.mark.skipif(not hopper_available(), reason="needs an sm_90 GPU (H100/H200)")
