"""Checking a kernel .so against its metadata: at cache or prebuilt lookup, and again right
before dlopen (the file is loaded lazily, at the first call, so a swap in between would otherwise
go unnoticed).

A kernel passes when its path and its metadata's path are controlled by you alone (trust.py),
the metadata is a JSON object (anything else is corrupt), records the fields expected of it, and
its ``so_sha256`` equals the SHA-256 of the bytes read through the same open file whose identity
(device, inode) is returned, so the loader can check that what it dlopen'ed is that file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from .files import read_json_object
from .trust import untrusted_reason


class Rejected(Exception):
    """Why a kernel file must not be used (the message is the reason)."""


def metadata_path(so: Path) -> Path:
    """Where a kernel's metadata lives: meta.json beside a cache entry's kernel.so,
    <source_key>.json beside a prebuilt <source_key>.so."""
    return so.with_name("meta.json") if so.name == "kernel.so" else so.with_suffix(".json")


def verify(so: Path, meta_path: Path | None = None, **expected: Any) -> tuple[int, int]:
    """(device, inode) of ``so`` once it passes; raises Rejected otherwise."""
    meta_path = meta_path or metadata_path(so)
    if not so.is_file() or not meta_path.is_file():
        raise Rejected(f"{so.name} or {meta_path.name} is missing")
    reason = untrusted_reason(so) or untrusted_reason(meta_path)
    if reason:
        raise Rejected(f"not controlled by you alone: {reason}")
    meta = read_json_object(meta_path)
    if meta is None:
        raise Rejected(f"{meta_path.name} is not a JSON object")
    for field, value in expected.items():
        if meta.get(field) != value:
            raise Rejected(f"{meta_path.name} records {field}={meta.get(field)!r}, expected {value!r}")
    h = hashlib.sha256()
    try:
        with open(so, "rb") as f:
            st = os.fstat(f.fileno())
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as e:
        raise Rejected(f"cannot read {so}: {e.strerror}") from None
    if meta.get("so_sha256") != h.hexdigest():
        raise Rejected(f"{so.name} does not match the SHA-256 recorded in {meta_path.name} "
                       "(changed after it was built)")
    return st.st_dev, st.st_ino
