"""The on-disk kernel cache, keyed by content only.

Layout under the cache root ($CODA_CUTLASS_CACHE_DIR, else $XDG_CACHE_HOME/coda-cutlass, else
~/.cache/coda-cutlass; a relative path is made absolute once, so a later chdir changes nothing):

    kernels/<k[:2]>/<k>/   kernel.cu, kernel.so, include/coda/*.hpp, build.sh, nvcc.log, meta.json
    failed/<k>/            the same for a build that failed (source + nvcc log kept for the user)
    locks/<k>.lock         flock held (and the holder's pid) while one process builds <k>
    tmp/                   builds in progress, published by one atomic rename (or, to replace an
                           entry, an atomic exchange); leftovers of killed builds are swept

An entry is used only if its path is controlled by you alone (trust.py) and meta.json records the
SHA-256 of kernel.so and the file still matches it; a corrupt or foreign entry is moved aside and
rebuilt. Everything is created private (0700 folders, 0600 files) whatever the umask. A cache
folder owned by someone else is never written; one of yours that others can write is repaired.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import os
import shutil
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import ContextManager

from ..errors import BuildError
from .files import make_dirs, read_json_object, write_file
from .locks import hold, is_held
from .trust import claim_dir, untrusted_reason
from .verify import Rejected, verify

SUBDIRS = ("kernels", "failed", "locks", "tmp")
_ROOTS_FROM_ENV: dict[str, Path] = {}


def absolute(path: str | Path) -> Path:
    return Path(os.path.abspath(Path(path).expanduser()))


def default_root() -> Path:
    env = os.environ.get("CODA_CUTLASS_CACHE_DIR")
    if env:
        # Resolved against the directory current when the value is first seen.
        return _ROOTS_FROM_ENV.setdefault(env, absolute(env))
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = absolute(xdg) if xdg else Path.home() / ".cache"
    return base / "coda-cutlass"


def resolve_root(root: str | Path | None) -> Path:
    return default_root() if root is None else absolute(root)


def fallback_root() -> Path:
    return Path(tempfile.gettempdir()) / f"coda-cutlass-{os.getuid()}"


class KernelCache:
    def __init__(self, root: Path | str | None = None):
        self.root = resolve_root(root)

    def __repr__(self) -> str:
        return f"KernelCache({str(self.root)!r})"

    def entry_dir(self, key: str) -> Path:
        return self.root / "kernels" / key[:2] / key

    def failed_dir(self, key: str) -> Path:
        return self.root / "failed" / key

    def claim(self) -> str | None:
        """Make the root and its folders private to you (creating or repairing them); why this
        cache cannot be written, or None. A root below a folder others can write to is refused
        too: its entries could never be loaded (trust.py)."""
        for d in (self.root, *(self.root / s for s in SUBDIRS)):
            refusal = claim_dir(d)
            if refusal:
                return refusal
        return untrusted_reason(self.root)

    @property
    def writable(self) -> bool:
        if self.claim() is not None:
            return False
        try:
            probe = self.root / "tmp" / f".probe-{uuid.uuid4().hex}"
            write_file(probe, b"")
            probe.unlink()
            return True
        except OSError:
            return False

    # ------------------------------------------------------------------ entries
    def problem(self, key: str) -> str | None:
        """Why the entry for ``key`` must not be used, or None."""
        try:
            verify(self.entry_dir(key) / "kernel.so", key=key)
        except Rejected as e:
            return str(e)
        return None

    def lookup(self, key: str) -> Path | None:
        """The path of a verified kernel.so for ``key``, or None (a bad entry is moved aside)."""
        entry = self.entry_dir(key)
        if not os.path.lexists(entry):
            return None
        reason = self.problem(key)
        if reason is None:
            return entry / "kernel.so"
        self.discard(key, reason)
        return None

    def meta(self, key: str) -> dict:
        meta = read_json_object(self.entry_dir(key) / "meta.json")
        if meta is None:
            raise BuildError(f"cache entry {self.entry_dir(key)} has no valid meta.json")
        return meta

    def discard(self, key: str, reason: str) -> None:
        entry = self.entry_dir(key)
        moved = self._trash(entry)
        warnings.warn(f"coda-cutlass: {'discarded' if moved else 'ignoring'} cache entry {entry}: {reason}; "
                      "it will be rebuilt", RuntimeWarning, stacklevel=3)

    def _trash(self, path: Path) -> bool:
        """Move ``path`` out of the way atomically (others never see it half removed), then delete."""
        trash = self.root / "tmp" / f"trash-{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            make_dirs(trash.parent)
            os.rename(path, trash)
        except OSError:
            return False
        shutil.rmtree(trash, ignore_errors=True)
        return True

    # ------------------------------------------------------------------ building
    def new_build_dir(self, key: str) -> Path:
        d = self.root / "tmp" / f"{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        make_dirs(d)
        return d

    def publish(self, key: str, build_dir: Path, replace: bool = False) -> Path:
        """Move a finished build into place atomically. ``replace``: swap it with an existing entry
        in one step (processes that loaded the old kernel.so keep their mapping; nobody ever sees
        no entry). Otherwise an existing good entry (same content, built by another process) wins."""
        entry = self.entry_dir(key)
        refusal = claim_dir(entry.parent)
        if refusal:
            raise BuildError(f"cannot publish the kernel built in {build_dir}: {refusal}")
        try:
            os.rename(build_dir, entry)
            return entry / "kernel.so"
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        if replace:
            _exchange(build_dir, entry, self)     # build_dir now holds the old entry
            self._trash(build_dir)
        elif self.lookup(key) is not None:
            shutil.rmtree(build_dir, ignore_errors=True)
        else:
            os.rename(build_dir, entry)         # lookup moved the bad entry aside
        return entry / "kernel.so"

    def keep_failed(self, key: str, build_dir: Path) -> Path:
        dest = self.failed_dir(key)
        if os.path.lexists(dest):
            self._trash(dest)
        try:
            make_dirs(dest.parent)
            os.rename(build_dir, dest)
        except OSError:
            return build_dir
        return dest

    def sweep_tmp(self, held: str | None = None) -> None:
        """Remove what killed processes left in tmp/: build folders whose key nobody is building
        (its lock is free, or is ``held`` by the caller), trash, stale probes."""
        tmp = self.root / "tmp"
        try:
            names = os.listdir(tmp)
        except OSError:
            return
        for name in names:
            path = tmp / name
            if name.startswith(".probe-"):
                with contextlib.suppress(OSError):
                    if time.time() - os.lstat(path).st_mtime > 60:
                        path.unlink()
            elif name.startswith("trash-") or name.split("-")[0] == held or not self._building(name.split("-")[0]):
                shutil.rmtree(path, ignore_errors=True)

    def _building(self, key: str) -> bool:
        return is_held(self.root / "locks" / f"{key}.lock")

    def lock(self, key: str, what: str = "", timeout: float | None = None,
             verbose: bool | None = None) -> ContextManager[None]:
        """Exclusive per-key lock across processes, so one of them builds and the others wait."""
        make_dirs(self.root / "locks")
        return hold(self.root / "locks" / f"{key}.lock", what or key[:12], timeout, verbose)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path, cache: KernelCache) -> None:
    """Swap two folders atomically (renameat2 RENAME_EXCHANGE); where the filesystem cannot, move
    ``b`` aside then ``a`` in (a moment without ``b``, under the build lock)."""
    if _swap(a, b):
        return
    aside = cache.root / "tmp" / f"{b.name}-aside-{uuid.uuid4().hex[:8]}"    # named by its key: swept only
                                                                              # when nobody holds the key's lock
    os.rename(b, aside)
    try:
        os.rename(a, b)
    except OSError:
        os.rename(aside, b)
        raise
    os.rename(aside, a)


def _swap(a: Path, b: Path) -> bool:
    """renameat2(a, b, RENAME_EXCHANGE); False where libc or the filesystem lacks it."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    return fn is not None and fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


_PRIVATE_FALLBACK: list[KernelCache] = []
_PRIVATE_LOCK = threading.Lock()


def _process_private_cache() -> KernelCache:
    """A cache only this process uses (removed at exit): the last resort when both the cache
    folder and the shared-temp fallback are unusable."""
    with _PRIVATE_LOCK:
        return _private_cache_locked()


def _private_cache_locked() -> KernelCache:
    if not _PRIVATE_FALLBACK:
        root = tempfile.mkdtemp(prefix=f"coda-cutlass-{os.getuid()}-")      # 0700, unique
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _PRIVATE_FALLBACK.append(KernelCache(root))
    return _PRIVATE_FALLBACK[0]


def resolve_cache(root: Path | str | None = None) -> tuple[KernelCache, KernelCache | None]:
    """(cache to read, cache to write). A cache you cannot write still serves hits (each checked
    by ``problem``); builds then go to the private fallback under the system temp dir, which is
    itself refused (and a per-process folder used) if someone else owns it."""
    primary = KernelCache(root)
    if primary.writable:
        return primary, primary
    why = f"cache directory {primary.root} is not writable ({primary.claim() or 'cannot create files in it'})"
    fallback = KernelCache(fallback_root())
    if fallback.writable:
        warnings.warn(f"coda-cutlass: {why}; new kernels go to "
                      f"{fallback.root} (set CODA_CUTLASS_CACHE_DIR to choose another)", RuntimeWarning,
                      stacklevel=3)
        return primary, fallback
    refused = fallback.claim() or f"{fallback.root} is not writable"
    private = _process_private_cache()
    if not private.writable:
        return primary, None
    warnings.warn(f"coda-cutlass: {why} and the fallback is refused "
                  f"({refused}); new kernels go to {private.root}, for this process only "
                  "(set CODA_CUTLASS_CACHE_DIR to a folder of yours)", RuntimeWarning, stacklevel=3)
    return primary, private
