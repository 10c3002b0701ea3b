"""Locks across processes (flock), with progress while waiting and a time limit: the per-key
build locks of the kernel cache and the tuning cache's lock.

The holder writes its pid into the lock file, so a waiting process can say whom it waits for. A
lock is released by the kernel when its holder dies, however it dies. (The filelock package
that torch brings is not used: the holder's pid must stay in the file, which filelock 3.x opens
with O_TRUNC on every attempt; the sweep of killed builds asks whether a lock is held without
waiting for it; and the behaviour must not change with the filelock version torch pulls in.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shlex
import time
from pathlib import Path
from typing import Iterator

from ..errors import BuildError
from .files import PRIVATE_FILE
from .progress import say, seconds_text

_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def hold(path: Path, what: str, timeout: float | None, verbose: bool | None,
         doing: str = "building") -> Iterator[None]:
    """Hold the lock at ``path``, waiting for another holder (``doing`` ``what``) at most
    ``timeout`` seconds (None: forever) with a progress line every 15 s; a BuildError when the
    time is up."""
    fd = _open(path)
    try:
        _wait(fd, path, f"{doing} {what}", timeout, verbose)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _open(path: Path) -> int:
    """The lock file, created if missing; a BuildError naming it if it is a folder or a link (which
    the cache never makes: a link is not followed, so its target is never written)."""
    try:
        return os.open(path, _FLAGS | os.O_CREAT, PRIVATE_FILE)
    except OSError as e:
        if e.errno in (errno.EISDIR, errno.ELOOP, errno.ENXIO, errno.EOPNOTSUPP):
            what = "a folder" if os.path.isdir(path) and not os.path.islink(path) else \
                   "a symbolic link" if os.path.islink(path) else "not a plain file"
            raise BuildError(f"cannot use the lock file {path}: it is {what}, and the cache only makes plain "
                             f"files there; remove it (rm -r {shlex.quote(str(path))}) and try again") from None
        raise BuildError(f"cannot open the lock file {path}: {e.strerror}") from None


def is_held(path: Path) -> bool:
    """Whether some open file (in any process, this one included) holds the lock at ``path``."""
    try:
        fd = os.open(path, _FLAGS)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)        # closing releases a lock we got
    return False


def _try(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _wait(fd: int, path: Path, task: str, timeout: float | None, verbose: bool | None,
          every: float = 15.0) -> None:
    if _try(fd):
        return
    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
    start = time.monotonic()
    limit = f", for at most {seconds_text(timeout)} s" if timeout is not None else ""
    say(f"waiting for another process (pid {holder}) {task}{limit} (lock {path})...", verbose)
    next_note = start + every
    while not _try(fd):
        time.sleep(0.2)
        now = time.monotonic()
        if timeout is not None and now - start >= timeout:
            raise BuildError(f"gave up after {seconds_text(now - start)} s waiting for another process (pid {holder}) "
                             f"{task} (lock {path}); set CODA_CUTLASS_LOCK_TIMEOUT to wait longer")
        if now >= next_note:
            say(f"  ... still waiting for pid {holder} {task} ({now - start:.0f} s)", verbose)
            next_note += every
