"""What a cache folder holds, and how the cache tells its own folder from anyone else's.

The cache writes a marker, ``CACHEDIR.TAG`` (the Cache Directory Tagging format, so backup tools
skip the folder, plus a line naming coda-cutlass), into a root it creates. It uses a folder
only if it is missing, empty, marked, or an unmarked cache made by coda-cutlass before the marker
existed (every name in it is one the cache generates, owned by the folder's owner, and a
tuning.json in it is a tuning cache: adopted by writing the marker). A damaged marker (empty,
garbled: anything but another tool's tag) counts as a missing one, so such a cache is adopted again
and the marker rewritten. Anything else is someone's folder: refused, naming what is in it. Inside a
cache, only names of the shapes below are ever removed, so a user's folder that happens to lie
in ``tmp/`` or ``kernels/`` is never touched.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

MARKER = "CACHEDIR.TAG"
_SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55"
_OURS = "# coda-cutlass kernel cache: it deletes only what it created here."
MARKER_TEXT = f"{_SIGNATURE}\n{_OURS}\n# See https://bford.info/cachedir/ for the tag.\n"

KEY = re.compile(r"[0-9a-f]{64}")
_HEX8 = "[0-9a-f]{8}"
BUILD_DIR = re.compile(rf"({KEY.pattern})-\d+-{_HEX8}")      # tmp/<key>-<pid>-<hex>: a build in progress
ASIDE = re.compile(rf"({KEY.pattern})-aside-{_HEX8}")         # tmp/: an entry moved aside for a swap
TRASH = re.compile(rf"trash-({KEY.pattern})(?:-\d+-{_HEX8})?-{_HEX8}")   # tmp/: an entry being deleted
PROBE = re.compile(r"\.probe-[0-9a-f]{32}")                   # tmp/: the write probe
_TMP_NAMES = (BUILD_DIR, ASIDE, TRASH, PROBE)
_ROOT_FILES = re.compile(r"tuning\.json|tuning\.lock|\.tuning-[0-9a-f]{32}\.json|\.CACHEDIR\.TAG-[0-9a-f]{32}")
_LOCK = re.compile(rf"{KEY.pattern}\.lock")


def is_key(name: str) -> bool:
    return KEY.fullmatch(name) is not None


def tmp_key(name: str) -> str | None:
    """The key a name in tmp/ belongs to ('' for a probe); None if the cache never makes it."""
    for pattern in _TMP_NAMES:
        m = pattern.fullmatch(name)
        if m:
            return m.group(1) if m.groups() else ""
    return None


@dataclass(frozen=True)
class Found:
    """What a candidate cache root is: "missing", "not a folder", "marked", "empty", "old cache"
    (unmarked, made by an earlier coda-cutlass) or "foreign"; ``detail`` says why / what is in it."""
    kind: str
    detail: str = ""


def inspect(root: Path) -> Found:
    """What ``root`` is, looking at it without following a link at its last component."""
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return Found("missing")
    except OSError as e:
        return Found("not a folder", f"cannot check {root}: {e.strerror}")
    if not stat.S_ISDIR(st.st_mode):
        return Found("not a folder", f"{root} is not a folder")
    try:
        names = sorted(os.listdir(root))
    except OSError as e:
        return Found("not a folder", f"cannot list {root}: {e.strerror}")
    if MARKER in names and has_marker(root):
        return Found("marked")
    if not names:
        return Found("empty")
    strays = sorted(_strays(root, names, st.st_uid))
    if not strays:
        return Found("old cache")
    shown = ", ".join(strays[:6]) + (f" and {len(strays) - 6} more" if len(strays) > 6 else "")
    return Found("foreign", shown)


def _read_small(path: Path, limit: int) -> bytes | None:
    """The first ``limit`` bytes of a regular file (no link followed); None if it is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            return f.read(limit)
        except OSError:
            return None


def _marker_lines(root: Path) -> list[str] | None:
    data = _read_small(root / MARKER, 4096)
    return None if data is None else data.decode("utf-8", errors="replace").splitlines()


def has_marker(root: Path) -> bool:
    lines = _marker_lines(root)
    return bool(lines) and lines[0] == _SIGNATURE and _OURS in lines


def _is_other_tag(root: Path) -> bool:
    """Whether CACHEDIR.TAG is a valid tag of another tool (cargo's, say): not ours, not damaged."""
    lines = _marker_lines(root) or []
    return bool(lines) and lines[0] == _SIGNATURE and any(l.strip() for l in lines[1:]) and _OURS not in lines


def is_tuning_cache(path: Path) -> bool:
    """Whether ``path`` holds what the tuning store writes: a JSON object of JSON objects (a
    user's tuning.json of another shape is theirs, not the cache's)."""
    data = _read_small(path, 1 << 26)
    if data is None:
        return not os.path.lexists(path)     # gone since listed (nothing of anyone's), or not a file
    try:
        value = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict) and all(isinstance(v, dict) for v in value.values())


def _strays(root: Path, names: list[str], owner: int) -> list[str]:
    """Paths (relative to root) in an unmarked folder that the cache would never have made."""
    strays: list[str] = []
    damaged: list[str] = []     # a damaged marker: named only beside real strays (else it is rewritten)
    evidence: list[str] = []    # what only the cache makes: entries, failed builds, locks, a tuning cache
    unread_tuning = False       # tuning.json that is not a tuning cache: an old cache's, cut short by a crash?

    def odd(rel: str, is_dir: bool) -> str | None:
        """None if ``rel`` is a folder (a file) of the root's owner, else how it differs."""
        try:
            st = os.lstat(root / rel)
        except FileNotFoundError:
            # gone since the folder was listed: another process of the cache renamed or removed it
            # (its marker's temporary file becomes CACHEDIR.TAG); what is not there is no one's folder
            return None
        except OSError as e:
            return f"{rel} ({e.strerror})"
        if st.st_uid != owner:
            return f"{rel} (owned by uid {st.st_uid})"
        if (stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)):
            return None
        return f"{rel} (not a {'folder' if is_dir else 'file'})"

    def check(rel: str, shaped: bool, is_dir: bool) -> bool:
        """Whether ``rel`` is one of the cache's (else it is recorded as a stray)."""
        problem = odd(rel, is_dir) if shaped else rel
        if problem:
            strays.append(problem)
        return problem is None

    def children(rel: str) -> list[str]:
        try:
            return sorted(os.listdir(root / rel))
        except OSError:
            strays.append(f"{rel} (unreadable)")
            return []

    for name in names:
        is_dir = name in ("kernels", "failed", "locks", "tmp")
        if name == MARKER:     # not ours (else the folder is "marked"): damaged, or another tool's
            if _is_other_tag(root):
                strays.append(f"{MARKER} (another program's cache tag)")
            elif check(name, True, False):
                damaged.append(f"{MARKER} (damaged: not the marker of coda-cutlass)")
            continue
        ours = check(name, is_dir or _ROOT_FILES.fullmatch(name) is not None, is_dir)
        if ours and name == "tuning.json":
            if is_tuning_cache(root / name):
                evidence.append(name)
            else:
                unread_tuning = True
        if not ours or not is_dir:
            continue
        if name == "kernels":
            for prefix in children("kernels"):
                if check(f"kernels/{prefix}", re.fullmatch("[0-9a-f]{2}", prefix) is not None, True):
                    for k in children(f"kernels/{prefix}"):
                        if check(f"kernels/{prefix}/{k}", is_key(k) and k.startswith(prefix), True):
                            evidence.append(k)
        elif name == "failed":
            for k in children("failed"):
                if check(f"failed/{k}", is_key(k), True):
                    evidence.append(k)
        elif name == "locks":
            for n in children("locks"):
                if check(f"locks/{n}", _LOCK.fullmatch(n) is not None, False):
                    evidence.append(n)
        else:
            for n in children("tmp"):
                check(f"tmp/{n}", tmp_key(n) is not None, tmp_key(n) != "")
    # A tuning.json the store cannot read, or a damaged marker, is the cache's own (cut short by a
    # crash: adopted, the file replaced with a warning) only beside what only the cache makes; alone
    # (with empty folders at most) it may be a user's file of that name, which is never overwritten.
    if not evidence:
        if unread_tuning:
            strays.append("tuning.json (not a tuning cache of coda-cutlass)")
        strays.extend(d.replace("damaged: ", "damaged or not ours: ") for d in damaged)
        damaged = []
    return strays + damaged if strays else []
