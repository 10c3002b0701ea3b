"""Prebuilt kernels, found before any JIT build.

Search order: directories in $CODA_CUTLASS_PREBUILT_PATH (os.pathsep-separated), then the
``coda_cutlass/prebuilt`` folder shipped in a wheel. A prebuilt kernel is ``<source_key>.so`` with
``<source_key>.json`` (its metadata, including the .so's SHA-256) beside it. Like a cache entry, it
is used only from a path nobody but you, root or the package's owner controls (trust.py); a
foreign, corrupt or mismatching one is skipped with a warning.
"""

from __future__ import annotations

import os
from pathlib import Path

from .progress import warn
from .verify import Rejected, verify

PACKAGE_PREBUILT = Path(__file__).resolve().parent.parent / "prebuilt"


def search_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("CODA_CUTLASS_PREBUILT_PATH", "").split(os.pathsep) if p]
    dirs.append(PACKAGE_PREBUILT)
    return dirs


def search_report() -> str:
    """The folders searched, one a line, saying which exist (for error messages)."""
    lines = []
    for d in search_dirs():
        origin = "the installed package" if d == PACKAGE_PREBUILT else "$CODA_CUTLASS_PREBUILT_PATH"
        state = f"{sum(1 for _ in d.glob('*.so'))} kernels" if d.is_dir() else "no such folder"
        lines.append(f"{d} ({origin}; {state})")
    return "\n".join(lines)


def find_prebuilt(source_key: str) -> Path | None:
    for d in search_dirs():
        so = d / f"{source_key}.so"
        meta = d / f"{source_key}.json"
        if not so.is_file() or not meta.is_file():
            continue
        try:
            verify(so, meta)
            return so
        except Rejected as e:
            warn(f"skipping prebuilt kernel {so}: {e}", stacklevel=3)
    return None
