"""Prebuilt kernels, found before any JIT build.

Search order: directories in $CODA_CUTLASS_PREBUILT_PATH (os.pathsep-separated), then the
``coda_cutlass/prebuilt`` folder shipped in a wheel. A prebuilt kernel is ``<source_key>.so`` with
``<source_key>.json`` (its metadata, including the .so's SHA-256) beside it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .cache import sha256_file

PACKAGE_PREBUILT = Path(__file__).resolve().parent.parent / "prebuilt"


def search_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("CODA_CUTLASS_PREBUILT_PATH", "").split(os.pathsep) if p]
    dirs.append(PACKAGE_PREBUILT)
    return dirs


def find_prebuilt(source_key: str) -> Path | None:
    for d in search_dirs():
        so = d / f"{source_key}.so"
        meta = d / f"{source_key}.json"
        if not so.is_file() or not meta.is_file():
            continue
        try:
            if json.loads(meta.read_text()).get("so_sha256") == sha256_file(so):
                return so
        except (OSError, ValueError):
            continue
    return None
