"""The persistent tuning cache: one JSON file under the kernel cache root, updated atomically
under a file lock. Keyed by GPU name and compute capability, CUDA version, program hash, dtypes,
layout, N, K and a power-of-two M bucket.

A file that is not a JSON object, a record that is not one, or (when the reader names the fields it
reads) a record without them is corrupt: it is ignored with a warning (the shape is tuned again)
and replaced by the next write, which says so. (A folder whose tuning.json is not a tuning cache is
not taken as a cache at all: build/layout.py.) A choice is written only into a cache you can claim (a teammate's
is read-only for you) and under the build lock's implementation (build/locks.py), waiting at most
$CODA_CUTLASS_LOCK_TIMEOUT (default 60 s); otherwise it is kept in memory only, saying why.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any, Mapping

import torch

from ..env import env_seconds
from ..errors import BuildError, ConfigError
from ..build.cache import KernelCache, resolve_root
from ..build.files import read_json_object, write_file
from ..build.locks import hold
from ..build.progress import warn

LOCK_TIMEOUT_S = 60.0

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
                warn(f"ignoring tuning cache {self.path}: not a JSON object; it is rewritten on the next tuning",
                     stacklevel=3)
            return {}
        return data

    def get(self, key: str, fields: Mapping[str, type] | None = None) -> dict[str, Any] | None:
        """The record stored under ``key``: a JSON object, with ``fields`` of these types if given."""
        rec = self.load().get(key)
        if rec is None:
            return None
        if not isinstance(rec, dict) or not all(isinstance(rec.get(f), t) for f, t in (fields or {}).items()):
            warn(f"ignoring corrupt tuning record {key!r} in {self.path}; the shape is tuned again")
            return None
        return rec

    def put(self, key: str, record: dict[str, Any]) -> None:
        try:
            refusal = KernelCache(self.root).refusal()
        except ConfigError as e:    # someone's folder, not a cache: nothing is written into it
            warn(f"tuning choice {key!r} not saved in {self.path} ({e}); it is kept in memory only", stacklevel=3)
            return
        if refusal is not None:
            return   # a cache you cannot write (or a teammate's): the choice is kept in memory only
        try:
            with hold(self.root / "tuning.lock", "the tuning cache", env_seconds("CODA_CUTLASS_LOCK_TIMEOUT",
                      LOCK_TIMEOUT_S), None, doing="writing"):
                data = read_json_object(self.path)
                if data is None:
                    data = {}
                    if os.path.lexists(self.path):
                        warn(f"replacing {self.path}: it is not a JSON object (a damaged tuning cache); the "
                             "choices it held are tuned again", stacklevel=4)
                data[key] = record
                tmp = self.path.with_name(f".tuning-{uuid.uuid4().hex}.json")
                write_file(tmp, json.dumps(data, indent=1, sort_keys=True), sync=True)
                os.replace(tmp, self.path)
        except (BuildError, OSError) as e:
            warn(f"tuning choice {key!r} not saved in {self.path} ({e}); it is kept in memory only", stacklevel=3)
