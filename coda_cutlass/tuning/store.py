"""The persistent tuning cache: one JSON file under the kernel cache root, updated atomically
under a file lock. Keyed by GPU name and compute capability, CUDA version, program hash, dtypes,
layout, N, K and a power-of-two M bucket.

A file that is not a JSON object, a record that is not one, or (when the reader names the fields it
reads) a record without them is corrupt: it is ignored with a warning (the shape is tuned again)
and replaced by the next write.
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch

from ..build.cache import resolve_root
from ..build.files import PRIVATE_FILE, make_dirs, read_json_object, write_file

# field -> type of a stored per-kernel choice (what TunedEpilogue reads back).
CHOICE_FIELDS: Mapping[str, type] = {"config": dict, "raster": str, "swizzle": int}


def device_tag(device: Any = None) -> str:
    """The GPU part of a tuning key: name, compute capability and CUDA version (current device by
    default)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
    return f"{props.name}|sm{props.major}{props.minor}|cuda{torch.version.cuda}"


def m_bucket(M: int) -> int:
    b = 128
    while b < M and b < 65536:
        b *= 2
    return b


class TuningStore:
    def __init__(self, root: Path | str | None = None):
        self.root = resolve_root(root)
        self.path = self.root / "tuning.json"

    def load(self) -> dict[str, Any]:
        data = read_json_object(self.path)
        if data is None:
            if self.path.exists():
                warnings.warn(f"coda-cutlass: ignoring tuning cache {self.path}: not a JSON object; "
                              "it is rewritten on the next tuning", RuntimeWarning, stacklevel=3)
            return {}
        return data

    def get(self, key: str, fields: Mapping[str, type] | None = None) -> dict[str, Any] | None:
        """The record stored under ``key``: a JSON object, with ``fields`` of these types if given."""
        rec = self.load().get(key)
        if rec is None:
            return None
        if not isinstance(rec, dict) or not all(isinstance(rec.get(f), t) for f, t in (fields or {}).items()):
            warnings.warn(f"coda-cutlass: ignoring corrupt tuning record {key!r} in {self.path}; the shape is "
                          "tuned again", RuntimeWarning, stacklevel=2)
            return None
        return rec

    def put(self, key: str, record: dict[str, Any]) -> None:
        try:
            make_dirs(self.root)
            lock = os.open(self.root / "tuning.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                           PRIVATE_FILE)
        except OSError:
            return   # read-only cache: the choice is kept in memory only
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = read_json_object(self.path) or {}
            data[key] = record
            tmp = self.path.with_name(f".tuning-{uuid.uuid4().hex}.json")
            write_file(tmp, json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            os.close(lock)
