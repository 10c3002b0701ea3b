"""The persistent tuning cache: one JSON file under the kernel cache root, updated atomically
under a file lock. Keyed by GPU name and compute capability, CUDA version, program hash, dtypes,
layout, N, K and a power-of-two M bucket."""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from pathlib import Path
from typing import Any

from ..build.cache import FILE_MODE, default_root, mkdirs


def m_bucket(M: int) -> int:
    b = 128
    while b < M and b < 65536:
        b *= 2
    return b


class TuningStore:
    def __init__(self, root: Path | str | None = None):
        self.root = Path(root) if root is not None else default_root()
        self.path = self.root / "tuning.json"

    def load(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def get(self, key: str) -> dict[str, Any] | None:
        return self.load().get(key)

    def put(self, key: str, record: dict[str, Any]) -> None:
        try:
            mkdirs(self.root)
            lock = os.open(self.root / "tuning.lock", os.O_RDWR | os.O_CREAT, FILE_MODE)
        except OSError:
            return   # read-only cache: the choice is kept in memory only
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self.load()
            data[key] = record
            tmp = self.path.with_name(f".tuning-{uuid.uuid4().hex}.json")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.chmod(tmp, FILE_MODE)
            os.replace(tmp, self.path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            os.close(lock)
