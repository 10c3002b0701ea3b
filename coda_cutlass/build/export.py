"""Exporting built kernels as prebuilt files (``<source_key>.so`` + ``<source_key>.json``), for a
wheel's ``coda_cutlass/prebuilt`` folder or a directory on $CODA_CUTLASS_PREBUILT_PATH.

Unlike the private cache, exported files are meant to be shipped and shared: readable by all
(folders 0755, files 0644), writable by their owner only, whatever the umask."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from . import keys
from .cache import KernelCache
from .files import make_dirs, sha256_file, write_file

SHARED_DIR = 0o755
SHARED_FILE = 0o644

if TYPE_CHECKING:
    from ..runtime.kernel import Kernel


def _write_prebuilt(so_path: Path, source_key: str, meta: dict, dest: Path | str) -> Path:
    dest = Path(dest)
    make_dirs(dest, SHARED_DIR)
    so = dest / f"{source_key}.so"
    tmp = dest / f".{source_key}.so.tmp"
    write_file(tmp, so_path.read_bytes(), SHARED_FILE)
    tmp.replace(so)
    meta = {"source_key": source_key, **meta, "so_sha256": sha256_file(so)}
    tmp = dest / f".{source_key}.json.tmp"
    write_file(tmp, json.dumps(meta, indent=2), SHARED_FILE)
    tmp.replace(dest / f"{source_key}.json")
    return so


def export_prebuilt(kernel: "Kernel", dest: Path | str) -> Path:
    res = kernel.resources
    return _write_prebuilt(kernel.path, kernel.source_key, {"name": kernel.name, "description": kernel.plan.describe(),
                                                            "resources": res.to_json() if res else None}, dest)


def export_cache_entry(cache: KernelCache, key: str, dest: Path | str) -> bool:
    """Export one cache entry (if it verifies) as a prebuilt kernel."""
    so = cache.lookup(key)
    if so is None:
        return False
    meta = cache.meta(key)
    _write_prebuilt(so, meta["source_key"], {"name": meta.get("name", ""), "resources": meta.get("resources")}, dest)
    return True


def export_sources(sources: list[str], dest: Path | str) -> list[Path]:
    """Write ``<source_key>.cu`` for each generated source and the coda headers under include/."""
    dest = Path(dest)
    make_dirs(dest, SHARED_DIR)
    for rel, text in keys.header_files():
        make_dirs((dest / "include" / rel).parent, SHARED_DIR)
        write_file(dest / "include" / rel, text, SHARED_FILE)
    paths = []
    for source in sources:
        path = dest / f"{keys.source_key(source)}.cu"
        write_file(path, source, SHARED_FILE)
        paths.append(path)
    return paths
