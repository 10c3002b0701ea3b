"""Checking a kernel .so against its metadata: at cache or prebuilt lookup, and again right
before dlopen (the file is loaded lazily, at the first call, so a swap in between would otherwise
go unnoticed).

A kernel passes when its path and its metadata's path are controlled by you alone (trust.py),
the metadata is a JSON object (anything else is corrupt), records the fields expected of it, and
its ``so_sha256`` equals the SHA-256 of the bytes read through the same open file whose identity
(device, inode) is returned, so the loader can check that what it dlopen'ed is that file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

from .files import parse_json_object, sha256_stream
from .trust import stat_problem, untrusted_reason


class Rejected(Exception):
    """Why a kernel file must not be used (the message is the reason)."""


def metadata_path(so: Path) -> Path:
    """Where a kernel's metadata lives: meta.json beside a cache entry's kernel.so,
    <source_key>.json beside a prebuilt <source_key>.so."""
    return so.with_name("meta.json") if so.name == "kernel.so" else so.with_suffix(".json")


def verify(so: Path, meta_path: Path | None = None, **expected: Any) -> tuple[int, int]:
    """(device, inode) of ``so`` once it passes; raises Rejected otherwise. Both files are read
    through one open handle on their folder, so a folder swapped in meanwhile (a forced rebuild
    elsewhere) cannot pair one version's metadata with the other's library."""
    meta_path = meta_path or metadata_path(so)
    if not so.is_file() or not meta_path.is_file():
        raise Rejected(f"{so.name} or {meta_path.name} is missing")
    reason = untrusted_reason(so) or untrusted_reason(meta_path)
    if reason:
        raise Rejected(f"not controlled by you alone: {reason}")
    try:
        folder = os.open(so.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise Rejected(f"cannot open {so.parent}: {e.strerror}") from None
    try:
        with _open_at(folder, meta_path.name) as f:
            meta_bytes = f.read(1 << 24)
        with _open_at(folder, so.name) as f:
            st = os.fstat(f.fileno())
            digest = sha256_stream(f)
    finally:
        os.close(folder)
    meta = parse_json_object(meta_bytes)
    if meta is None:
        raise Rejected(f"{meta_path.name} is not a JSON object")
    for field, value in expected.items():
        if meta.get(field) != value:
            raise Rejected(f"{meta_path.name} records {field}={meta.get(field)!r}, expected {value!r}")
    if meta.get("so_sha256") != digest:
        raise Rejected(f"{so.name} does not match the SHA-256 recorded in {meta_path.name} "
                       "(changed after it was built)")
    return st.st_dev, st.st_ino


def _open_at(folder: int, name: str) -> BinaryIO:
    """A file of the folder open for reading, checked by the same owner and mode rule as paths."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=folder)
    except OSError as e:
        raise Rejected(f"cannot open {name}: {e.strerror}") from None
    f = os.fdopen(fd, "rb")
    reason = stat_problem(os.fstat(fd), name)
    if reason:
        f.close()
        raise Rejected(f"not controlled by you alone: {reason}")
    return f
