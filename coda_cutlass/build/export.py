"""Exporting built kernels as prebuilt files (``<source_key>.so`` + ``<source_key>.json``), for a
wheel's ``coda_cutlass/prebuilt`` folder or a directory on $CODA_CUTLASS_PREBUILT_PATH.

Unlike the private cache, exported files are meant to be shipped and shared: readable by all
(folders 0755, files 0644), writable by their owner only, whatever the umask. Files are written
to a hidden temporary name and renamed into place; a failed write (a full disk) names the file
and leaves no temporary behind. Exporting a cache only reads it: a damaged entry is skipped with a warning and
left for the next compile to rebuild. Nothing is written through a link inside the export folder
(an ``include`` linked into the user's own tree, say)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from . import keys
from ..errors import ConfigError
from .cache import KernelCache
from .files import make_dirs, sha256_file, write_file
from .progress import warn

SHARED_DIR = 0o755
SHARED_FILE = 0o644

if TYPE_CHECKING:
    from ..runtime.kernel import Kernel


def _install(data: str | bytes, path: Path) -> None:
    """Write ``path`` through a hidden temporary file renamed over it; the temporary is removed
    if anything fails (write_file removes a partial one itself)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write_file(tmp, data, SHARED_FILE, sync=True)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OSError(e.errno, e.strerror, str(path)) from e      # name the file meant, not the temporary


def _write_prebuilt(so_path: Path, source_key: str, meta: dict, dest: Path | str) -> Path:
    dest = Path(dest)
    make_dirs(dest, SHARED_DIR)
    so = dest / f"{source_key}.so"
    _install(so_path.read_bytes(), so)
    meta = {"source_key": source_key, **meta, "so_sha256": sha256_file(so)}
    _install(json.dumps(meta, indent=2), dest / f"{source_key}.json")
    return so


def export_prebuilt(kernel: "Kernel", dest: Path | str) -> Path:
    res = kernel.resources
    return _write_prebuilt(kernel.path, kernel.source_key, {"name": kernel.name, "description": kernel.plan.describe(),
                                                            "resources": res.to_json() if res else None}, dest)


def export_cache_entry(cache: KernelCache, key: str, dest: Path | str) -> bool:
    """Export one cache entry (if it verifies) as a prebuilt kernel. The cache is only read: a
    damaged entry is skipped with a warning, not discarded (lookup would move it aside)."""
    reason = cache.problem(key)
    if reason is not None:
        warn(f"not exporting cache entry {cache.entry_dir(key)}: {reason} (left in place; the next compile "
             "that needs it rebuilds it)", stacklevel=3)
        return False
    so = cache.entry_dir(key) / "kernel.so"
    meta = cache.meta(key)
    _write_prebuilt(so, meta["source_key"], {"name": meta.get("name", ""), "resources": meta.get("resources")}, dest)
    return True


def export_sources(sources: list[str], dest: Path | str) -> list[Path]:
    """Write ``<source_key>.cu`` for each generated source and the coda headers under include/."""
    dest = Path(dest)
    make_dirs(dest, SHARED_DIR)
    for rel, text in keys.header_files():
        _no_links_below(dest, (dest / "include" / rel).parent)
        make_dirs((dest / "include" / rel).parent, SHARED_DIR)
        write_file(dest / "include" / rel, text, SHARED_FILE)
    paths = []
    for source in sources:
        path = dest / f"{keys.source_key(source)}.cu"
        write_file(path, source, SHARED_FILE)
        paths.append(path)
    return paths


def _no_links_below(dest: Path, folder: Path) -> None:
    """A ConfigError if a folder between ``dest`` (excluded: the user chose it) and ``folder`` is a
    symbolic link: the headers would be written into whatever it points at."""
    for p in reversed(folder.relative_to(dest).parents[:-1] if folder != dest else ()):
        _refuse_link(dest / p)
    _refuse_link(folder)


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise ConfigError(f"{path} is a symbolic link (to {os.path.realpath(path)}); the generated headers are "
                          "written only into a real folder: remove the link or choose another --out folder")
