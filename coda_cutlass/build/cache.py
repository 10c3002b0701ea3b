"""The on-disk kernel cache, keyed by content only.

Layout under the cache root ($CODA_CUTLASS_CACHE_DIR, else $XDG_CACHE_HOME/coda-cutlass, else
~/.cache/coda-cutlass; a relative path is made absolute once, so a later chdir changes nothing):

    CACHEDIR.TAG           the marker: this folder is a coda-cutlass cache (layout.py)
    kernels/<k[:2]>/<k>/   kernel.cu, kernel.so, include/coda/*.hpp, build.sh, nvcc.log, meta.json
    failed/<k>/            the same for a build that failed (source + nvcc log kept for the user)
    locks/<k>.lock         flock held (and the holder's pid) while one process builds <k>
    tmp/                   builds in progress, published by one atomic rename (or, to replace an
                           entry, an atomic exchange); leftovers of killed builds are swept

The cache takes a folder only if it is missing, empty and private, marked, or an old unmarked
cache (layout.py); a folder with anything else in it is refused with an error naming it, and
only names the cache generates are ever removed. An entry is used only if its path is controlled
by you alone (trust.py) and meta.json records the SHA-256 of kernel.so and the file still matches
it. In a cache you own, a corrupt or foreign entry is moved aside and rebuilt; a cache you cannot
claim (a teammate's, say) is read-only for you: such entries are skipped, never moved, deleted or
chmodded, and builds go to your fallback. Everything is created private (0700 folders, 0600
files) whatever the umask; a folder the cache created that others can write is repaired (a
prefix folder kernels/<k[:2]> before its entries are judged, so a group-writable prefix folder
costs no intact entry; an entry whose own folder or files others could write is rebuilt, since
they could have rewritten both kernel.so and its recorded SHA), and no folder it did not create is
ever chmodded. A root whose path holds
a character nvcc's shell would interpret (run.shell_unsafe) is read, never built in.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import ContextManager, Iterator

from ..errors import BuildError, ConfigError
from .files import make_dirs, read_json_object, sync_file, write_file
from .layout import MARKER, MARKER_TEXT, inspect, is_key, tmp_key
from .locks import hold, is_held
from .progress import LOGGER, warn
from .run import shell_unsafe
from .trust import claim_dir, others_can_write, repair, untrusted_reason
from .verify import Rejected, verify

SUBDIRS = ("kernels", "failed", "locks", "tmp")
_ROOTS_FROM_ENV: dict[str, Path] = {}


def absolute(path: str | Path) -> Path:
    return Path(os.path.abspath(Path(path).expanduser()))


def default_root() -> Path:
    env = os.environ.get("CODA_CUTLASS_CACHE_DIR")
    if env and env.strip():          # empty or blank: unset (never a folder named " ")
        # Resolved against the directory current when the value is first seen.
        return _ROOTS_FROM_ENV.setdefault(env, absolute(env))
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = absolute(xdg) if xdg else Path.home() / ".cache"
    return base / "coda-cutlass"


def resolve_root(root: str | Path | None) -> Path:
    if root is not None and str(root).strip() == "":
        raise ConfigError(f"cache_dir={str(root)!r} is empty: pass None (the default, $CODA_CUTLASS_CACHE_DIR or "
                          "~/.cache/coda-cutlass) or the folder to use")
    return default_root() if root is None else absolute(root)


def fallback_root() -> Path:
    return Path(tempfile.gettempdir()) / f"coda-cutlass-{os.getuid()}"


class KernelCache:
    """``follow_link``: whether the root may be a symbolic link of yours (a root in a shared
    folder such as /tmp, the fallback, must be a real folder)."""

    def __init__(self, root: Path | str | None = None, follow_link: bool = True):
        self.root = resolve_root(root)
        self.follow_link = follow_link

    def __repr__(self) -> str:
        return f"KernelCache({str(self.root)!r})"

    def entry_dir(self, key: str) -> Path:
        return self.root / "kernels" / _checked(key)[:2] / key

    def failed_dir(self, key: str) -> Path:
        return self.root / "failed" / _checked(key)

    def keys(self) -> Iterator[str]:
        """The keys of the entries in kernels/ (names of another shape are not the cache's)."""
        kernels = self.root / "kernels"
        for prefix in sorted(os.listdir(kernels)) if kernels.is_dir() else ():
            for key in sorted(os.listdir(kernels / prefix)) if (kernels / prefix).is_dir() else ():
                if is_key(key) and key[:2] == prefix and self.entry_dir(key).is_dir():
                    yield key

    # ------------------------------------------------------------------ the root
    def check_root(self) -> str:
        """What the root is (layout.Found.kind), without changing anything; a ConfigError naming
        the folder and what is in it if it is someone's folder, not a cache."""
        found = inspect(Path(os.path.realpath(self.root)))
        if found.kind == "foreign":
            raise ConfigError(f"{self.root} is not a coda-cutlass cache: it holds {found.detail}, and is not marked "
                              f"as one ({MARKER}); the cache only takes a new or empty folder or one it created. "
                              "Point CODA_CUTLASS_CACHE_DIR (or cache_dir=) at a new folder")
        return found.kind

    def claim(self) -> str | None:
        """Make this cache yours to write: create (and mark) or adopt the root, create or repair
        its folders. Why it cannot be written, or None; nothing is written into a root that is
        refused, and a folder the cache did not create is never chmodded. A ConfigError if the root is
        someone's folder (check_root). A root below a folder others can write to is refused too:
        its entries could never be loaded (trust.py)."""
        refusal = self._link_problem()
        if refusal:
            return refusal
        root = Path(os.path.realpath(self.root))
        kind = self.check_root()
        unsafe = shell_unsafe(self.root) or shell_unsafe(root)
        if unsafe:
            return (f"its path contains {unsafe}, which nvcc cannot take (it passes its temp folder, made inside "
                    "the cache, through sh -c): choose a folder without ` $ \" or \\")
        if kind == "not a folder":
            return inspect(root).detail
        if kind == "missing":
            refusal = untrusted_reason(_existing_ancestor(root), parent=True)     # create nothing below it
            if refusal:
                return refusal
            try:
                make_dirs(root)
            except OSError as e:
                return f"cannot create {root}: {e.strerror}"
        else:
            st = os.lstat(root)
            if st.st_uid != os.getuid():
                return f"{root} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): read-only for you"
            if kind == "empty" and st.st_mode & 0o022:
                return (f"{root} is writable by {others_can_write(st)} (mode {stat.S_IMODE(st.st_mode):04o}) and "
                        "the cache does not change the mode of a folder it did not create: make it private "
                        "(chmod 700) or choose a new folder")
            if kind != "empty":           # a folder the cache created (marked, or an old cache)
                refusal = repair(root, st)
                if refusal:
                    return refusal
        if kind != "marked":
            damaged = kind == "old cache" and os.path.lexists(root / MARKER)
            refusal = _mark(root)
            if refusal:
                return refusal
            if damaged:
                warn(f"{root / MARKER} was damaged (not the marker of coda-cutlass) in a folder that is otherwise "
                     "a coda-cutlass cache; rewrote it", stacklevel=3)
            elif kind == "old cache":
                LOGGER.info("adopted %s, a cache made before coda-cutlass marked its caches", root)
        for sub in SUBDIRS:
            refusal = claim_dir(root / sub)
            if refusal:
                return refusal
        return untrusted_reason(root)

    def _link_problem(self) -> str | None:
        """Why a root that is a symbolic link must not be followed, or None (also when it is none)."""
        try:
            st = os.lstat(self.root)
        except OSError:
            return None
        if not stat.S_ISLNK(st.st_mode):
            return None
        link = f"{self.root} is a symbolic link (made by uid {st.st_uid}) to {os.path.realpath(self.root)}"
        if not self.follow_link:
            return f"{link}; this cache folder lies in a shared folder and must be a real folder"
        if st.st_uid not in (os.getuid(), 0):
            return f"{link}, not made by you"
        return untrusted_reason(self.root.parent, parent=True)

    def refusal(self) -> str | None:
        """Why new kernels cannot be written here (claim, then a write probe), or None."""
        refusal = self.claim()
        if refusal is not None:
            return refusal
        try:
            probe = self.root / "tmp" / f".probe-{uuid.uuid4().hex}"
            write_file(probe, b"")
            probe.unlink()
            return None
        except OSError as e:
            return f"cannot create files in {self.root / 'tmp'}: {e.strerror}"

    @property
    def writable(self) -> bool:
        return self.refusal() is None

    # ------------------------------------------------------------------ entries
    def problem(self, key: str) -> str | None:
        """Why the entry for ``key`` must not be used, or None. An entry swapped in while it was read
        (a forced rebuild elsewhere exchanges the folders, then trashes the old one under the reader)
        is read again: the reader would otherwise judge, and discard, the new entry by the old one."""
        entry = self.entry_dir(key)
        reason = None
        for _ in range(3):
            before = _inode(entry)
            try:
                verify(entry / "kernel.so", key=key)
                return None
            except Rejected as e:
                reason = str(e)
            if _inode(entry) == before:
                return reason
        return reason

    def lookup(self, key: str) -> Path | None:
        """The path of a verified kernel.so for ``key``, or None. A bad entry is moved aside in a
        cache of yours; in one you cannot claim it is skipped and left as it is."""
        entry = self.entry_dir(key)
        if not os.path.lexists(entry):
            return None
        reason = self.problem(key)
        if reason is None:
            return entry / "kernel.so"
        not_mine = self.claim()            # also repairs the root and kernels/
        if not_mine:
            LOGGER.info("skipping cache entry %s: %s (left in place: %s)", entry, reason, not_mine)
            return None
        # The prefix folder is the cache's too: made private again, the entry may pass now (its
        # owner, key and SHA-256 are still checked), instead of being rebuilt for the folder's mode.
        if claim_dir(entry.parent) is None:
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
        """Move the entry for ``key`` aside and delete it (only ever called on a cache of yours)."""
        entry = self.entry_dir(key)
        moved = self._trash(entry, key)
        warn(f"{'discarded' if moved else 'ignoring'} cache entry {entry}: {reason}; it will be rebuilt",
             stacklevel=3)

    def _trash(self, path: Path, key: str) -> bool:
        """Move ``path`` (the cache's folder for ``key``) out of the way atomically (others never
        see it half removed), then delete it."""
        trash = self.root / "tmp" / f"trash-{_checked(key)}-{uuid.uuid4().hex[:8]}"
        try:
            make_dirs(trash.parent)
            os.rename(path, trash)
        except OSError:
            return False
        _remove(trash)
        return True

    # ------------------------------------------------------------------ building
    def new_build_dir(self, key: str) -> Path:
        d = self.root / "tmp" / f"{_checked(key)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
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
        for name in ("kernel.so", "meta.json"):    # on disk before the rename makes them the entry
            sync_file(build_dir / name)
        try:
            os.rename(build_dir, entry)
            return entry / "kernel.so"
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        if replace:
            _exchange(build_dir, entry, self)     # build_dir now holds the old entry
            self._trash(build_dir, key)
        elif self.lookup(key) is not None:
            shutil.rmtree(build_dir, ignore_errors=True)
        else:
            os.rename(build_dir, entry)         # lookup moved the bad entry aside
        return entry / "kernel.so"

    def keep_failed(self, key: str, build_dir: Path) -> Path:
        dest = self.failed_dir(key)
        if os.path.lexists(dest):
            self._trash(dest, key)
        try:
            make_dirs(dest.parent)
            os.rename(build_dir, dest)
        except OSError:
            return build_dir
        return dest

    def sweep_tmp(self, held: str | None = None) -> None:
        """Remove what killed processes left in tmp/ of a cache of yours: build folders whose key
        nobody is building (its lock is free, or is ``held`` by the caller), trash, stale probes.
        Names the cache does not generate are left alone."""
        tmp = self.root / "tmp"
        try:
            names = os.listdir(tmp)
        except OSError:
            return
        for name in names:
            path = tmp / name
            key = tmp_key(name)
            if key == "":                       # a write probe
                with contextlib.suppress(OSError):
                    if time.time() - os.lstat(path).st_mtime > 60:
                        path.unlink()
            elif key is not None and (name.startswith("trash-") or key == held or not self._building(key)):
                _remove(path)

    def _building(self, key: str) -> bool:
        return is_held(self.root / "locks" / f"{key}.lock")

    def lock(self, key: str, what: str = "", timeout: float | None = None,
             verbose: bool | None = None) -> ContextManager[None]:
        """Exclusive per-key lock across processes, so one of them builds and the others wait."""
        make_dirs(self.root / "locks")
        return hold(self.root / "locks" / f"{key}.lock", what or key[:12], timeout, verbose)


def _checked(key: str) -> str:
    """``key`` if it has the shape of a build key (so a path built from it is the cache's own)."""
    if not is_key(key):
        raise ValueError(f"not a kernel cache key: {key!r}")
    return key


def _remove(path: Path) -> None:
    """Delete a folder or file of the cache's (an entry damaged into a plain file is one too)."""
    try:
        is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return
    if is_dir:
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _existing_ancestor(path: Path) -> Path:
    while not os.path.lexists(path) and path.parent != path:
        path = path.parent
    return path


def _mark(root: Path) -> str | None:
    """Write the marker (atomically: a reader sees none or all of it); why that failed, or None."""
    tmp = root / f".{MARKER}-{uuid.uuid4().hex}"
    try:
        write_file(tmp, MARKER_TEXT, sync=True)
        os.replace(tmp, root / MARKER)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return f"cannot write {root / MARKER}: {e.strerror}"
    return None


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


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
    by ``problem``, none moved); builds then go to the private fallback under the system temp
    dir, which is itself refused (and a per-process folder used) if it is a link, lies below a
    folder someone else controls, or is not yours. A ConfigError if ``root`` is not a cache."""
    primary = KernelCache(root)
    refusal = primary.refusal()          # a ConfigError if the folder is someone's, not a cache
    if refusal is None:
        return primary, primary
    why = f"cache directory {primary.root} is not writable ({refusal})"
    fallback = KernelCache(fallback_root(), follow_link=False)
    try:
        refused = fallback.refusal()
    except ConfigError as e:
        refused = str(e)
    if refused is None:
        warn(f"{why}; new kernels go to {fallback.root} (set CODA_CUTLASS_CACHE_DIR to choose another)",
             stacklevel=3)
        return primary, fallback
    private = _process_private_cache()
    last = private.refusal()
    if last is not None:
        warn(f"{why}, the fallback is refused ({refused}) and so is a folder for this process only ({last}): "
             "only kernels already built can be used", stacklevel=3)
        return primary, None
    warn(f"{why} and the fallback is refused ({refused}); new kernels go to {private.root}, for this "
         "process only (set CODA_CUTLASS_CACHE_DIR to a folder of yours)", stacklevel=3)
    return primary, private
