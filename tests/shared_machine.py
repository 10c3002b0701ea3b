"""Test helpers for a shared machine: acting as another user (setpriv, needs root), a shared
sticky temp folder like /tmp, and snapshots of a folder tree to show that nothing in it changed."""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from coda_cutlass.build import cache as cache_mod

OTHER_UID = 65534          # nobody


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def as_other_user(code: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
                           sys.executable, "-I", "-S", "-c", code, *args], check=check, timeout=60,
                          capture_output=not check)


@functools.lru_cache(maxsize=1)
def can_act_as_another_user() -> str | None:
    """None when tests can act as uid OTHER_UID, else why not (the skip reason)."""
    if os.getuid() != 0:
        return "acting as another user needs root (setpriv --reuid)"
    if shutil.which("setpriv") is None:
        return "setpriv is not installed"
    probe = as_other_user("import os, sys; sys.exit(os.getuid() != %d)" % OTHER_UID, check=False)
    if probe.returncode != 0:
        return f"this Python cannot run as uid {OTHER_UID}: {probe.stderr.decode(errors='replace')[-200:]}"
    return None


needs_other_user = pytest.mark.skipif(can_act_as_another_user() is not None, reason=str(can_act_as_another_user()))
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="giving files to another uid (chown) needs root")


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` (itself included) with its type, mode, owner and content."""
    out = {}
    for p in [root, *sorted(root.rglob("*"))]:
        st = os.lstat(p)
        body = p.read_bytes() if stat.S_ISREG(st.st_mode) else os.readlink(p) if stat.S_ISLNK(st.st_mode) else None
        out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, body)
    return out


@pytest.fixture
def shared_tmp(monkeypatch):
    """A world-writable sticky folder reachable by other users (like /tmp), made the system temp
    dir; the fallback cache lies in it. The main cache location is made unusable."""
    base = Path(tempfile.mkdtemp(prefix="coda-shared-tmp-", dir="/tmp"))
    os.chmod(base, 0o1777)
    blocker = base / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CODA_CUTLASS_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    monkeypatch.setattr(cache_mod, "_PRIVATE_FALLBACK", [])
    yield base
    shutil.rmtree(base, ignore_errors=True)
