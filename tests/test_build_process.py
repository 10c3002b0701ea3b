"""Builds that go wrong (issue 14, items 9, 10, 12, 14; issue 13's missing nvcc), with the fake
nvcc: forced rebuilds that fail or are killed, timeouts and killed builders (no orphans, no tmp
leftovers), the build lock's wait, non-UTF-8 compiler output, a non-ELF "library", boolean
environment variables, relative cache folders, and the error when nothing can build a kernel."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import coda_cutlass as cc
from coda_cutlass.build import toolchain as toolchain_mod
from coda_cutlass.build.builder import build
from coda_cutlass.build.cache import KernelCache, default_root
from coda_cutlass.build.keys import build_key, source_key
from coda_cutlass.build.prebuilt import PACKAGE_PREBUILT
from coda_cutlass.build.toolchain import toolchain
from coda_cutlass.env import env_flag
from coda_cutlass.tuning.tuner import tuning_enabled
from fake_nvcc import payload

HERE = Path(__file__).resolve().parent
SRC = "// kernel source (process)\nint z;\n"


def tmp_leftovers(cache: Path) -> list[str]:
    tmp = cache / "tmp"
    return sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else []


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_dead(pids: list[int], seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def fake_pids(path: Path, seconds: float = 20.0) -> list[int]:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if path.is_file() and path.read_text().endswith("\n"):
            return [int(x) for x in path.read_text().split()]
        time.sleep(0.05)
    raise AssertionError("the fake nvcc never started")


# ---------------------------------------------------------------- item 9: forced rebuilds
def test_failed_forced_rebuild_keeps_the_good_entry(fake_nvcc, monkeypatch):
    good = build(SRC, "k")
    before = good.path.read_bytes()
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    with pytest.raises(cc.BuildError, match="nvcc failed"):
        build(SRC, "k", force=True)
    monkeypatch.delenv("FAKE_NVCC_FAIL")
    again = build(SRC, "k")
    assert again.origin == "cache" and again.path.read_bytes() == before


def test_forced_rebuild_swaps_in_atomically(fake_nvcc, monkeypatch):
    """The entry exists at every moment of the rebuild; a process that has the old file open or
    mapped keeps reading the old bytes; the new bytes are in place afterwards."""
    old = build(SRC, "k")
    held = open(old.path, "rb")              # as a process that dlopen'ed it holds the file
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "1.0")
    monkeypatch.setenv("FAKE_NVCC_SALT", "v2")
    gaps = []
    done = threading.Event()

    def watch():
        cache = KernelCache()
        while not done.is_set():
            if not old.path.is_file() or cache.problem(old.key) is not None:
                gaps.append(time.monotonic())
            time.sleep(0.002)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        new = build(SRC, "k", force=True)
    finally:
        done.set()
        watcher.join()
    assert gaps == [] and new.path == old.path and payload(new.path).endswith("v2")
    assert payload(held.name) and held.read().endswith(SRC.encode())     # the old inode, intact
    held.close()
    assert tmp_leftovers(fake_nvcc["cache"]) == []


def test_an_entry_swapped_in_while_it_is_read_is_judged_by_its_new_files(fake_nvcc, monkeypatch):
    """A reader that opened the old folder of an entry a forced rebuild then exchanged and trashed
    fails to read it: it reads the entry again (the new one passes) instead of judging, and
    discarding, the new entry by the old one (seen once as a gap in the test above, under load)."""
    from coda_cutlass.build import cache as cache_mod
    old = build(SRC, "k")
    new_dir = old.path.parent.parent / "new-build"
    shutil.copytree(old.path.parent, new_dir)
    real_verify, calls = cache_mod.verify, []

    def verify(so, *a, **k):
        calls.append(so)
        if len(calls) == 1:                   # the rebuild lands while the first read is under way
            aside = so.parent.with_name("old-entry")
            os.rename(so.parent, aside)
            os.rename(new_dir, so.parent)
            shutil.rmtree(aside)
            raise cache_mod.Rejected("meta.json: No such file or directory (the old folder, trashed)")
        return real_verify(so, *a, **k)
    monkeypatch.setattr(cache_mod, "verify", verify)
    assert KernelCache().problem(old.key) is None and len(calls) == 2
    assert KernelCache().lookup(old.key) == old.path            # and the entry stays in place


# ---------------------------------------------------------------- item 10: timeouts, kills, locks
@pytest.mark.parametrize("how", ["argument", "environment"])
def test_timeout_kills_the_whole_compiler_process_group(fake_nvcc, monkeypatch, how):
    pids_file = fake_nvcc["tmp"] / "pids"
    monkeypatch.setenv("FAKE_NVCC_PIDS", str(pids_file))
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "60")
    kw = {"timeout": 1} if how == "argument" else {}
    if how == "environment":
        monkeypatch.setenv("CODA_CUTLASS_BUILD_TIMEOUT", "1")
    start = time.monotonic()
    with pytest.raises(cc.BuildError, match="timed out after 1 s") as e:
        build(SRC, "k", **kw)
    assert time.monotonic() - start < 15
    pids = [int(x) for x in pids_file.read_text().split()]
    assert wait_dead(pids), "nvcc or its child (cicc) outlived the timeout"
    assert "timed out" in Path(e.value.log_path).read_text() and Path(e.value.source_path).is_file()
    assert tmp_leftovers(fake_nvcc["cache"]) == []


def test_bad_timeout_setting_is_a_clear_error(fake_nvcc, monkeypatch):
    monkeypatch.setenv("CODA_CUTLASS_BUILD_TIMEOUT", "soon")
    with pytest.raises(cc.ConfigError, match="CODA_CUTLASS_BUILD_TIMEOUT='soon'"):
        build(SRC, "k")


BUILDER = """
import sys
from coda_cutlass.build.builder import build
build(sys.argv[1], "k", force=len(sys.argv) > 2)
"""


def test_killed_builder_leaves_no_orphans_and_its_tmp_is_swept(fake_nvcc, monkeypatch):
    """SIGKILL of the Python process that runs nvcc: nvcc and its children die with it, the
    forced rebuild it was doing leaves the old entry in place, and its build folder is swept by
    the next build of that kernel."""
    first = build(SRC, "k")
    pids_file = fake_nvcc["tmp"] / "pids"
    env = {**os.environ, "FAKE_NVCC_PIDS": str(pids_file), "FAKE_NVCC_SLEEP": "60"}
    proc = subprocess.Popen([sys.executable, "-c", BUILDER, SRC, "force"], env=env)
    pids = fake_pids(pids_file)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert wait_dead(pids), "nvcc or its child outlived the killed builder"
    assert [n for n in tmp_leftovers(fake_nvcc["cache"]) if n.startswith(first.key)]   # left by the kill
    again = build(SRC, "k")
    assert again.origin == "cache" and again.path.read_bytes() == first.path.read_bytes()
    build(SRC, "k", force=True)                       # sweeps under the key's lock
    assert tmp_leftovers(fake_nvcc["cache"]) == []


def test_waiting_for_the_build_lock_says_so_and_times_out(fake_nvcc, monkeypatch, capsys):
    key = build_key(SRC, toolchain())
    monkeypatch.setenv("CODA_CUTLASS_LOCK_TIMEOUT", "1")
    with KernelCache().lock(key):                     # another builder holds it
        start = time.monotonic()
        with pytest.raises(cc.BuildError, match=rf"gave up after 1 s waiting for another process \(pid {os.getpid()}\) building k"):
            build(SRC, "k", verbose=True)
        assert time.monotonic() - start < 10
    assert "waiting for another process" in capsys.readouterr().err
    assert build(SRC, "k").origin == "built"          # free again


# ---------------------------------------------------------------- item 12: bytes, non-ELF
def test_non_utf8_compiler_output_still_reports_and_keeps_the_failure(fake_nvcc, monkeypatch, tmp_path):
    nvcc = tmp_path / "nvcc-latin1.py"                # a new path: its --version is not cached yet
    shutil.copy(HERE / "fake_nvcc.py", nvcc)
    monkeypatch.setenv("CODA_CUTLASS_NVCC", str(nvcc))
    monkeypatch.setenv("FAKE_NVCC_BAD_BYTES", "1")
    assert "release 99.0" in toolchain().nvcc_version
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    with pytest.raises(cc.BuildError, match="nvcc failed") as e:
        build(SRC, "k")
    log = Path(e.value.log_path)
    assert log.parent.parent.name == "failed" and "\ufffd" in log.read_text(encoding="utf-8")
    assert tmp_leftovers(fake_nvcc["cache"]) == []


def test_exit_0_without_a_shared_library_is_a_failure(fake_nvcc, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_NOT_ELF", "1")
    with pytest.raises(cc.BuildError, match="not an ELF shared library") as e:
        build(SRC, "k")
    key = build_key(SRC, toolchain())
    assert not KernelCache().entry_dir(key).exists()
    assert Path(e.value.source_path).parent == KernelCache().failed_dir(key)
    assert tmp_leftovers(fake_nvcc["cache"]) == []


# ---------------------------------------------------------------- item 14: env flags, relative dirs
@pytest.mark.parametrize("value,expected", [("False", False), ("off", False), ("No", False), ("0", False),
                                            (" FALSE ", False), ("1", True), ("true", True), ("On", True),
                                            ("", True)])
def test_autotune_switch_accepts_every_usual_spelling(monkeypatch, value, expected):
    monkeypatch.setenv("CODA_CUTLASS_AUTOTUNE", value)
    assert tuning_enabled() is expected


@pytest.mark.parametrize("name", ["CODA_CUTLASS_AUTOTUNE", "CODA_CUTLASS_QUIET"])
def test_garbage_boolean_is_a_clear_error(monkeypatch, name):
    monkeypatch.setenv(name, "banana")
    with pytest.raises(cc.ConfigError, match=f"{name}='banana' is not a boolean"):
        env_flag(name, True)


def test_a_malformed_quiet_variable_is_refused_on_a_cache_hit_too(fake_nvcc, monkeypatch):
    """Read when a kernel is asked for, not only when a line is printed: a cache hit prints nothing."""
    prog = cc.epilogue(lambda acc, t=3.0: acc * t, name="quiet_hit")
    cc.compile_epilogue(prog, torch.bfloat16)
    monkeypatch.setenv("CODA_CUTLASS_QUIET", "maybe")
    with pytest.raises(cc.ConfigError, match="CODA_CUTLASS_QUIET='maybe' is not a boolean"):
        cc.compile_epilogue(prog, torch.bfloat16)
    assert cc.compile_epilogue(prog, torch.bfloat16, verbose=False) is not None    # an explicit verbose needs none


def test_relative_cache_dir_survives_chdir(fake_nvcc, monkeypatch, tmp_path):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(work)
    prog = cc.epilogue(lambda acc, t=5.0: acc * t, name="rel")
    k = cc.compile_epilogue(prog, torch.bfloat16, cache_dir="rel-cache")
    tuned = cc.compile_epilogue(prog, torch.bfloat16, config="tune", cache_dir="rel-cache")
    monkeypatch.setenv("CODA_CUTLASS_CACHE_DIR", "env-cache")
    env_root = default_root()
    monkeypatch.chdir(elsewhere)
    assert k.path.is_absolute() and k.path.is_file() and work / "rel-cache" in k.path.parents
    assert tuned.cache_dir == work / "rel-cache" and tuned.store.root == work / "rel-cache"
    assert default_root() == env_root == work / "env-cache"
    with pytest.raises(cc.BuildError, match="cannot load kernel library"):   # verified, then dlopen
        k.library


# ---------------------------------------------------------------- issue 13: nothing can build it
@pytest.fixture
def no_nvcc(monkeypatch, tmp_path):
    for var in ("CODA_CUTLASS_NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("CODA_CUTLASS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(toolchain_mod, "DEFAULT_NVCC", str(tmp_path / "cuda" / "bin" / "nvcc"))
    toolchain_mod._cached_toolchain.cache_clear()
    yield tmp_path
    toolchain_mod._cached_toolchain.cache_clear()


def test_missing_nvcc_names_program_dtype_key_and_where_it_looked(no_nvcc, monkeypatch):
    pre = no_nvcc / "pre"
    monkeypatch.setenv("CODA_CUTLASS_PREBUILT_PATH", str(pre))
    prog = cc.epilogue(lambda acc, t=7.0: acc * t, name="not_prebuilt")
    skey = source_key(cc.emit(prog, torch.float16))
    with pytest.raises(cc.ToolchainError) as e:
        cc.compile_epilogue(prog, torch.float16)
    msg = str(e.value)
    for part in ("'not_prebuilt'", "torch.float16", skey, f"{pre} ($CODA_CUTLASS_PREBUILT_PATH; no such folder)",
                 str(PACKAGE_PREBUILT), "$CODA_CUTLASS_NVCC: unset", "$CUDA_HOME/bin/nvcc: unset",
                 f"no nvcc in PATH={no_nvcc / 'bin'}",
                 f"the default CUDA install: {no_nvcc / 'cuda' / 'bin' / 'nvcc'}: no such executable"):
        assert part in msg, (part, msg)


def test_default_cuda_nvcc_is_used_only_saying_so(no_nvcc, fake_nvcc, monkeypatch, capsys):
    for var in ("CODA_CUTLASS_NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    nvcc = no_nvcc / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{HERE / "fake_nvcc.py"}" "$@"\n')   # PATH is empty
    nvcc.chmod(0o755)
    tc = toolchain()
    assert tc.nvcc == str(nvcc) and tc.nvcc_reason.startswith("from the default CUDA install: not on PATH")
    r = build(SRC, "k", verbose=True)
    err = capsys.readouterr().err
    assert f"nvcc: {nvcc} (from the default CUDA install" in err
    assert "default CUDA install" in (r.path.parent / "nvcc.log").read_text()


def test_interrupted_build_kills_the_compiler_and_cleans_up(fake_nvcc, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) while nvcc runs: the compiler's process group is killed, the
    build folder removed, the interrupt propagates."""
    from coda_cutlass.build import run as run_mod
    pids_file = fake_nvcc["tmp"] / "pids"
    monkeypatch.setenv("FAKE_NVCC_PIDS", str(pids_file))
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "60")

    class Interrupted(subprocess.Popen):
        def wait(self, timeout=None):
            if timeout is None or timeout > 100:       # the build's wait, not _stop's
                fake_pids(pids_file)
                raise KeyboardInterrupt
            return super().wait(timeout)
    monkeypatch.setattr(run_mod.subprocess, "Popen", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        build(SRC, "k")
    assert wait_dead([int(x) for x in pids_file.read_text().split()])
    assert tmp_leftovers(fake_nvcc["cache"]) == []


def test_forced_rebuild_without_an_atomic_exchange_still_replaces(fake_nvcc, monkeypatch):
    """Filesystems without renameat2(RENAME_EXCHANGE): move aside, move in, under the lock."""
    from coda_cutlass.build import cache as cache_mod
    old = build(SRC, "k")
    monkeypatch.setattr(cache_mod, "_swap", lambda a, b: False)
    monkeypatch.setenv("FAKE_NVCC_SALT", "v3")
    new = build(SRC, "k", force=True)
    assert new.path == old.path and payload(new.path).endswith("v3")
    assert build(SRC, "k").origin == "cache" and tmp_leftovers(fake_nvcc["cache"]) == []
