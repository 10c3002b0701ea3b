"""Exporting built kernels as prebuilt files (``<source_key>.so`` + ``<source_key>.json``), for a
wheel's ``coda_cutlass/prebuilt`` folder or a directory on $CODA_CUTLASS_PREBUILT_PATH."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from .cache import FILE_MODE, KernelCache, mkdirs, sha256_file

if TYPE_CHECKING:
    from ..runtime.kernel import CompiledEpilogue


def _write_prebuilt(so_path: Path, source_key: str, meta: dict, dest: Path | str) -> Path:
    dest = Path(dest)
    mkdirs(dest)
    so = dest / f"{source_key}.so"
    tmp = dest / f".{source_key}.so.tmp"
    shutil.copyfile(so_path, tmp)
    tmp.chmod(FILE_MODE)
    tmp.replace(so)
    meta = {"source_key": source_key, **meta, "so_sha256": sha256_file(so)}
    (dest / f"{source_key}.json").write_text(json.dumps(meta, indent=2))
    (dest / f"{source_key}.json").chmod(FILE_MODE)
    return so


def export_prebuilt(kernel: "CompiledEpilogue", dest: Path | str) -> Path:
    return _write_prebuilt(kernel.path, kernel.source_key, {"name": kernel.name,
                                                            "description": kernel.graph.describe()}, dest)


def export_cache_entry(cache: KernelCache, key: str, dest: Path | str) -> bool:
    """Export one cache entry (if it verifies) as a prebuilt kernel."""
    so = cache.lookup(key)
    if so is None:
        return False
    meta = cache.meta(key)
    _write_prebuilt(so, meta["source_key"], {"name": meta.get("name", "")}, dest)
    return True


def export_sources(items: list, dest: Path | str) -> list[Path]:
    """Write ``<source_key>.cu`` for each (program, options) and the coda headers under include/."""
    from ..api import split_options
    from ..pipeline import lower_program
    from .cache import write_file
    from .keys import header_files, source_key
    dest = Path(dest)
    mkdirs(dest)
    for rel, text in header_files():
        mkdirs((dest / "include" / rel).parent)
        write_file(dest / "include" / rel, text)
    paths = []
    for prog, opts in items:
        lo = lower_program(prog, split_options(opts)[0])
        path = dest / f"{source_key(lo.source)}.cu"
        write_file(path, lo.source)
        paths.append(path)
    return paths
