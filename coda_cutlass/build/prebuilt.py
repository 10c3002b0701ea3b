"""Prebuilt kernels, found before any JIT build.

Search order: directories in $CODA_CUTLASS_PREBUILT_PATH (os.pathsep-separated), then the
``coda_cutlass/prebuilt`` folder shipped in a wheel. A prebuilt kernel is ``<source_key>.so`` with
``<source_key>.json`` (its metadata, including the .so's SHA-256) beside it. Like a cache entry, it
is used only from a path nobody but you, root or the package's owner controls (trust.py); a
foreign, corrupt or mismatching one is skipped with a warning, as is one whose metadata records
another source key (an export copied under another kernel's name). Relative folders in the
variable are made absolute once, when the value is first seen, so a later chdir changes nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

from .files import read_json_object
from .progress import warn
from .verify import Rejected, verify

PACKAGE_PREBUILT = Path(__file__).resolve().parent.parent / "prebuilt"
_DIRS_FROM_ENV: dict[str, tuple[Path, ...]] = {}


def search_dirs() -> list[Path]:
    env = os.environ.get("CODA_CUTLASS_PREBUILT_PATH", "")
    # Resolved against the directory current when the value is first seen (as the cache root is):
    # a kernel found through "good" must still load after the script changes directory.
    if env not in _DIRS_FROM_ENV:
        _DIRS_FROM_ENV[env] = tuple(Path(os.path.abspath(Path(p).expanduser()))
                                    for p in env.split(os.pathsep) if p.strip())
        # a misspelt folder, or the .so itself, would otherwise mean a silent JIT build of every kernel
        for d in _DIRS_FROM_ENV[env]:
            if not d.is_dir():
                what = "a file, not a folder" if d.exists() else "no such folder"
                warn(f"$CODA_CUTLASS_PREBUILT_PATH entry {d}: {what}; no prebuilt kernels are found there "
                     "(the variable lists folders of <key>.so and <key>.json files)", stacklevel=3)
    return [*_DIRS_FROM_ENV[env], PACKAGE_PREBUILT]


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
        except Rejected as e:
            warn(f"skipping prebuilt kernel {so}: {e}", stacklevel=3)
            continue
        recorded = (read_json_object(meta) or {}).get("source_key", source_key)
        if recorded != source_key:
            warn(f"skipping prebuilt kernel {so}: {meta.name} records source_key={recorded!r}, another kernel's "
                 "(copied under this name?); remove it or export it again", stacklevel=3)
            continue
        return so
    return None
