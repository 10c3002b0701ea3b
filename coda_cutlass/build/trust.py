"""Who may control the files a kernel is loaded from.

A kernel .so is code that runs inside the user's process, so it is loaded only from a path that
nobody else controls: every folder from / down to the file, and the file itself, must be owned
by a trusted user (you, root, or the owner of the installed coda_cutlass package, who controls
the Python code that runs anyway) and writable by nobody else. The one exception is a sticky
folder such as /tmp: others can write there but cannot rename or delete what they do not own.
This is the rule ssh applies to ~/.ssh; it closes the hole of a shared /tmp cache that another
user pre-creates and fills with a kernel.so and a matching meta.json (keys are deterministic).

A cache's folders are claimed before anything is written into them: created private, repaired if
they are yours but others can write to them, refused if someone else owns them or they are links.
Which root folder may be a cache at all is layout.py's and cache.py's business.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .files import PRIVATE_DIR
from .progress import warn

_PACKAGE = Path(__file__).resolve().parent.parent


def trusted_uids() -> frozenset[int]:
    uids = {os.getuid(), 0}
    try:
        uids.add(_PACKAGE.stat().st_uid)
    except OSError:
        pass
    return frozenset(uids)


def describe_mode(st: os.stat_result) -> str:
    return f"mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}"


def untrusted_reason(path: Path, parent: bool = False) -> str | None:
    """Why loading ``path`` could run code another user controls, or None if it cannot.
    ``parent``: ``path`` is the folder something will be created in (so it may be sticky, /tmp)."""
    real = Path(os.path.realpath(path))
    trusted = trusted_uids()
    parts = real.parts
    for i in range(1, len(parts) + 1):
        p = Path(*parts[:i])
        try:
            st = os.lstat(p)
        except OSError as e:
            return f"cannot check {p}: {e.strerror}"
        if stat.S_ISLNK(st.st_mode):
            return f"{p} was replaced by a symbolic link while being checked"
        sticky_dir = (i < len(parts) or parent) and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
        reason = stat_problem(st, p, trusted, sticky_ok=bool(sticky_dir))
        if reason:
            return reason
    return None


def stat_problem(st: os.stat_result, what: object, trusted: frozenset[int] | None = None,
                 sticky_ok: bool = False) -> str | None:
    """Why one file or folder (its stat) could be changed by someone untrusted, or None."""
    if st.st_uid not in (trusted or trusted_uids()):
        return f"{what} is owned by uid {st.st_uid}, not by you, root or the owner of the coda_cutlass install"
    if st.st_mode & 0o022 and not sticky_ok:
        return f"{what} is writable by {others_can_write(st)} ({describe_mode(st)})"
    return None


def claim_dir(path: Path) -> str | None:
    """Make ``path``, a folder of a cache root you own (so one the cache creates), a folder only
    you control: created 0700 if missing, made 0700 again (with a warning) if others can write to
    it. A link, or a folder owned by someone else, is refused and left as it is. Returns why it
    was refused, or None."""
    try:
        os.mkdir(path, PRIVATE_DIR)
        os.chmod(path, PRIVATE_DIR)
        return None
    except FileExistsError:
        pass
    except OSError as e:
        return f"cannot create {path}: {e.strerror}"
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot check {path}: {e.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link (made by uid {st.st_uid}), not a folder the cache created"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a folder"
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()})"
    return repair(path, st)


def repair(path: Path, st: os.stat_result) -> str | None:
    """Make a folder the cache created, found writable by others, private again (with a warning);
    why that failed, or None."""
    if not st.st_mode & 0o022:
        return None
    try:
        os.chmod(path, PRIVATE_DIR)
    except OSError as e:
        return f"{path} is writable by others ({describe_mode(st)}) and cannot be repaired: {e.strerror}"
    warn(f"{path} was writable by others (mode {stat.S_IMODE(st.st_mode):04o}); made it private (0700). "
         "Anything others put there is ignored", stacklevel=3)
    return None


def others_can_write(st: os.stat_result) -> str:
    return "group and others" if st.st_mode & 0o002 else "its group"
