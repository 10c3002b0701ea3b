"""Reading and writing the cache's files.

What coda-cutlass creates is private whatever the umask: folders 0700, files 0600 (kernel.so and
build.sh 0700), created with O_EXCL | O_NOFOLLOW so a planted file or link is never written
through. Metadata is JSON; valid JSON that is not an object ([], null, 1, "x") is as corrupt as
invalid JSON. A write that fails (a full disk) removes its partial file and names it in the error.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from pathlib import Path
from typing import BinaryIO

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
PRIVATE_EXEC = 0o700


def sha256_stream(f: BinaryIO) -> str:
    """SHA-256 of what is left to read in an open binary file."""
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return sha256_stream(f)


def parse_json_object(data: str | bytes) -> dict | None:
    """The JSON object in ``data`` (bytes as UTF-8); None if it is not JSON or not an object."""
    try:
        value = json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def read_json_object(path: Path) -> dict | None:
    """The JSON object in ``path``; None if it is missing, unreadable, not JSON, or not an object."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return None
    return parse_json_object(text)


def make_dirs(path: Path, mode: int = PRIVATE_DIR) -> None:
    """``mkdir -p`` whose every new level gets ``mode`` whatever the umask (Path.mkdir(parents=True)
    gives intermediate levels 0777 & ~umask: world-writable under umask 000)."""
    missing = []
    p = path
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode & PRIVATE_DIR)
        except FileExistsError:
            if not d.is_dir():      # a file where a folder must go: say so, not "File exists"
                raise NotADirectoryError(errno.ENOTDIR, "exists and is not a folder", str(d)) from None
            continue
        os.chmod(d, mode)


def write_file(path: Path, data: str | bytes, mode: int = PRIVATE_FILE, sync: bool = False) -> None:
    """Create ``path`` (replacing a file of ours) with ``mode``, never following a link. ``sync``:
    on disk before returning (for a file about to be renamed into place: after a crash the name
    must not point at an empty file). On failure (ENOSPC, EFBIG) the partial file is removed and the
    OSError names ``path`` (a failed write() names no file)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, mode)
            f.write(data)
            if sync:
                f.flush()
                os.fsync(fd)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(path)         # created above with O_EXCL: ours
        raise OSError(e.errno, e.strerror, str(path)) from e


def sync_file(path: Path) -> None:
    """fsync an existing file (best effort: a file system that cannot is no reason to fail)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
