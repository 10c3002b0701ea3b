"""The on-disk kernel cache, keyed by content only.

Layout under the cache root ($CODA_CUTLASS_CACHE_DIR, else $XDG_CACHE_HOME/coda-cutlass, else
~/.cache/coda-cutlass):

    kernels/<k[:2]>/<k>/   kernel.cu, kernel.so, include/coda/*.hpp, build.sh, nvcc.log, meta.json
    failed/<k>/            the same for a build that failed (source + nvcc log kept for the user)
    locks/<k>.lock         flock held while one process builds <k>
    tmp/                   builds in progress; published by one atomic rename

An entry is used only if meta.json records the SHA-256 of kernel.so and the file still matches it;
a truncated or corrupt entry is moved aside and rebuilt. Nothing is world-writable.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import uuid
import warnings
from pathlib import Path
from typing import Iterator

DIR_MODE = 0o755
FILE_MODE = 0o644


def default_root() -> Path:
    env = os.environ.get("CODA_CUTLASS_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "coda-cutlass"


def fallback_root() -> Path:
    return Path(tempfile.gettempdir()) / f"coda-cutlass-{os.getuid()}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def mkdirs(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)


def write_file(path: Path, data: str | bytes) -> None:
    mode = "wb" if isinstance(data, bytes) else "w"
    with open(path, mode) as f:
        f.write(data)
    os.chmod(path, FILE_MODE)


class KernelCache:
    def __init__(self, root: Path | str | None = None):
        self.root = Path(root).expanduser() if root is not None else default_root()

    def __repr__(self) -> str:
        return f"KernelCache({str(self.root)!r})"

    def entry_dir(self, key: str) -> Path:
        return self.root / "kernels" / key[:2] / key

    def failed_dir(self, key: str) -> Path:
        return self.root / "failed" / key

    @property
    def writable(self) -> bool:
        try:
            mkdirs(self.root / "tmp")
            probe = self.root / "tmp" / f".probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
            return True
        except OSError:
            return False

    def lookup(self, key: str) -> Path | None:
        """The path of a verified kernel.so for ``key``, or None (a corrupt entry is discarded)."""
        entry = self.entry_dir(key)
        so = entry / "kernel.so"
        meta_path = entry / "meta.json"
        if not entry.is_dir():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("key") == key and meta.get("so_sha256") == sha256_file(so):
                return so
        except (OSError, ValueError):
            pass
        self.discard(key, reason="its kernel.so or meta.json is missing or does not match its recorded hash")
        return None

    def meta(self, key: str) -> dict:
        return json.loads((self.entry_dir(key) / "meta.json").read_text())

    def discard(self, key: str, reason: str) -> None:
        entry = self.entry_dir(key)
        trash = self.root / "tmp" / f"trash-{key}-{uuid.uuid4().hex[:8]}"
        try:
            mkdirs(trash.parent)
            os.rename(entry, trash)     # atomic: other processes never see a half-removed entry
        except OSError:
            return
        warnings.warn(f"coda-cutlass: discarded cache entry {entry}: {reason}; it will be rebuilt",
                      RuntimeWarning, stacklevel=3)
        shutil.rmtree(trash, ignore_errors=True)

    def new_build_dir(self, key: str) -> Path:
        d = self.root / "tmp" / f"{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        mkdirs(d)
        return d

    def publish(self, key: str, build_dir: Path) -> Path:
        """Atomically move a finished build into place. If another process published first, keep
        theirs (it is the same content) and drop ours."""
        entry = self.entry_dir(key)
        mkdirs(entry.parent)
        try:
            os.rename(build_dir, entry)
        except OSError:
            if self.lookup(key) is None:
                raise
            shutil.rmtree(build_dir, ignore_errors=True)
        return entry / "kernel.so"

    def keep_failed(self, key: str, build_dir: Path) -> Path:
        dest = self.failed_dir(key)
        mkdirs(dest.parent)
        shutil.rmtree(dest, ignore_errors=True)
        try:
            os.rename(build_dir, dest)
        except OSError:
            return build_dir
        return dest

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """Exclusive per-key lock across processes, so one of them builds and the others wait."""
        mkdirs(self.root / "locks")
        path = self.root / "locks" / f"{key}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def resolve_cache(root: Path | str | None = None) -> tuple[KernelCache, KernelCache | None]:
    """(cache to read, cache to write). A read-only cache still serves hits; builds then go to a
    private fallback directory under the system temp dir."""
    primary = KernelCache(root)
    if primary.writable:
        return primary, primary
    fallback = KernelCache(fallback_root())
    if fallback.writable:
        warnings.warn(f"coda-cutlass: cache directory {primary.root} is not writable; new kernels go to "
                      f"{fallback.root} (set CODA_CUTLASS_CACHE_DIR to choose another)", RuntimeWarning,
                      stacklevel=3)
        return primary, fallback
    return primary, None
