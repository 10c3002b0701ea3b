"""A hostile second user on a shared machine (issue 23, items 2-5), with the fake nvcc: nvcc's
intermediates in a private temp folder, a planted fallback link, a cache that only takes over a
folder it created (or an old cache it recognises), and a teammate's cache that is read-only for
you. Also the one lock implementation (the tuning cache's lock waits and times out like the build
lock) and the ``coda_cutlass`` logger.

Tests that give files to another uid need root; they skip, saying why, elsewhere."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import coda_cutlass as cc
from coda_cutlass.build import cache as cache_mod
from coda_cutlass.build.builder import build
from coda_cutlass.build.cache import KernelCache
from coda_cutlass.build.files import make_dirs, write_file
from coda_cutlass.build.keys import build_key
from coda_cutlass.build.locks import hold
from coda_cutlass.build.run import PRIVATE_TMP, run
from coda_cutlass.build.toolchain import toolchain
from coda_cutlass.cli import main
from coda_cutlass.errors import ToolchainError
from coda_cutlass.tuning.store import TuningStore
from fake_nvcc import payload
from shared_machine import (OTHER_UID, as_other_user, mode, needs_other_user, needs_root, shared_tmp,  # noqa: F401
                            snapshot)

SRC = "// kernel source (shared machine)\nint w;\n"
REC = {"config": {"tile_m": 128}, "raster": "n", "swizzle": 2}


# ---------------------------------------------------------------- item 2: nvcc's temp folder
@pytest.mark.parametrize("outcome", ["built", "failed"])
def test_nvcc_gets_a_private_tmpdir_inside_its_build_folder(fake_nvcc, monkeypatch, tmp_path, outcome):
    """nvcc names its intermediates tmpxft_<pid>_* and reads them back: in a shared /tmp another
    user can pre-create or append to them. TMPDIR, TMP and TEMP all point at a 0700 folder inside
    the build's own folder (whatever the umask), which is gone once the build is over."""
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    for var in ("TMPDIR", "TMP", "TEMP"):
        monkeypatch.setenv(var, str(shared))
    seen_file = tmp_path / "seen.json"
    monkeypatch.setenv("FAKE_NVCC_ENV", str(seen_file))
    if outcome == "failed":
        monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    old = os.umask(0)
    try:
        if outcome == "built":
            folder = build(SRC, "k").path.parent
        else:
            with pytest.raises(cc.BuildError) as e:
                build(SRC, "k")
            folder = Path(e.value.source_path).parent
    finally:
        os.umask(old)
    seen = json.loads(seen_file.read_text())
    private = Path(seen["TMPDIR"])
    assert seen["TMP"] == seen["TEMP"] == seen["gettempdir"] == str(private)
    assert private == Path(seen["cwd"]) / PRIVATE_TMP                       # inside the build folder
    assert Path(seen["cwd"]).parent == fake_nvcc["cache"] / "tmp"
    assert (seen["mode"], seen["uid"]) == (0o700, os.getuid())
    assert list(shared.iterdir()) == []                                   # nothing in the shared temp
    assert not private.exists() and not os.path.lexists(seen["intermediate"])
    assert not [p for p in folder.rglob("*") if p.name.startswith("tmpxft") or p.name == PRIVATE_TMP]


def test_build_sh_gives_nvcc_a_private_tmpdir_too(fake_nvcc, monkeypatch, tmp_path):
    """The entry's build.sh (rebuild by hand) gives nvcc a private temp folder too: mktemp -d's (0700,
    a random name, removed afterwards), in the system temp folder, so the entry's own path never
    reaches nvcc's shell."""
    monkeypatch.setenv("TMPDIR", "/tmp")
    entry = build(SRC, "k").path.parent
    seen_file = tmp_path / "seen.json"
    subprocess.run(["sh", str(entry / "build.sh")], check=True, timeout=60,
                   env={**os.environ, "FAKE_NVCC_ENV": str(seen_file)})
    seen = json.loads(seen_file.read_text())
    private = Path(seen["TMPDIR"])
    assert seen["TMP"] == seen["TEMP"] == str(private) and private.parent == Path("/tmp")
    assert (seen["mode"], seen["uid"]) == (0o700, os.getuid()) and not private.exists()


def test_real_nvcc_writes_its_intermediates_to_the_private_tmpdir(monkeypatch, tmp_path):
    """The real nvcc honours TMPDIR: its --dryrun plan names every intermediate inside the
    build's private folder, none in /tmp (no compile: well under a second)."""
    monkeypatch.delenv("CODA_CUTLASS_NVCC", raising=False)
    try:
        nvcc = toolchain().nvcc
    except ToolchainError as e:
        pytest.skip(f"no real nvcc: {e}")
    monkeypatch.setenv("TMPDIR", "/tmp")
    d = tmp_path / "build"
    make_dirs(d)
    write_file(d / "kernel.cu", "__global__ void k() {}\n")
    ran = run([nvcc, "--dryrun", "-c", "kernel.cu", "-o", "kernel.o"], d, 120)
    paths = re.findall(r"/[^\s\"',=]*tmpxft_[^\s\"',]*", ran.output)     # every absolute path of one
    assert ran.returncode == 0 and paths, ran.output[-2000:]
    assert all(p.startswith(str(d / PRIVATE_TMP) + "/") for p in paths), paths
    assert not (d / PRIVATE_TMP).exists()


# ---------------------------------------------------------------- item 3: a planted fallback link
def victim_folder(base: Path) -> Path:
    """A folder of the victim's with work under tmp/ (what the sweep used to delete)."""
    victim = base / "victim"
    (victim / "tmp" / "checkpoints").mkdir(parents=True)
    (victim / "tmp" / "checkpoints" / "step-1000.pt").write_bytes(b"weights")
    os.chmod(victim, 0o755)
    return victim


def test_fallback_that_is_a_symlink_is_refused(fake_nvcc, shared_tmp, tmp_path):
    victim = victim_folder(tmp_path)
    before = snapshot(victim)
    os.symlink(victim, cache_mod.fallback_root())
    with pytest.warns(RuntimeWarning, match="fallback is refused.*is a symbolic link"):
        r = build(SRC, "k")
    assert r.origin == "built" and payload(r.path) == SRC
    assert victim not in r.path.parents and snapshot(victim) == before      # not chmodded, nothing swept


@needs_other_user
def test_fallback_link_planted_by_another_user_is_refused(fake_nvcc, shared_tmp, tmp_path):
    """Item 3 as reported: uid 65534 links /tmp/coda-cutlass-<uid> to a folder the victim owns."""
    victim = victim_folder(tmp_path)
    before = snapshot(victim)
    link = cache_mod.fallback_root()
    as_other_user("import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(victim), str(link))
    assert os.lstat(link).st_uid == OTHER_UID
    with pytest.warns(RuntimeWarning, match=f"fallback is refused.*symbolic link.*uid {OTHER_UID}"):
        r = build(SRC, "k")
    assert victim not in r.path.parents and snapshot(victim) == before


@needs_root
def test_fallback_below_a_folder_someone_else_owns_is_not_even_created(fake_nvcc, shared_tmp, monkeypatch):
    theirs = shared_tmp / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    monkeypatch.setattr("tempfile.tempdir", str(theirs))
    with pytest.warns(RuntimeWarning, match=f"fallback is refused.*theirs is owned by uid {OTHER_UID}"):
        with pytest.raises(cc.BuildError, match="cannot build k"):     # the system temp dir is theirs
            build(SRC, "k")
    assert not os.path.lexists(cache_mod.fallback_root())


# ---------------------------------------------------------------- item 4: only its own folder
def test_cache_refuses_a_project_folder(fake_nvcc, monkeypatch, tmp_path):
    """CODA_CUTLASS_CACHE_DIR=proj, a project with proj/tmp/experiment-1/results.csv: a clear
    error naming the folder and what is in it; no chmod, nothing created or deleted."""
    proj = tmp_path / "proj"
    (proj / "tmp" / "experiment-1").mkdir(parents=True)
    (proj / "tmp" / "experiment-1" / "results.csv").write_text("step,loss\n1,2.5\n")
    (proj / "train.py").write_text("print('hi')\n")
    os.chmod(proj, 0o2775)
    before = snapshot(proj)
    monkeypatch.setenv("CODA_CUTLASS_CACHE_DIR", str(proj))
    with pytest.raises(cc.ConfigError, match=rf"{re.escape(str(proj))} is not a coda-cutlass cache.*"
                                             r"tmp/experiment-1.*train\.py"):
        build(SRC, "k")
    assert snapshot(proj) == before and mode(proj) == 0o2775


@pytest.mark.parametrize("layout", ["slash", "tmp-only"])
def test_cache_on_a_stand_in_for_slash_touches_nothing(fake_nvcc, monkeypatch, tmp_path, layout):
    """As root, the cache pointed at a stand-in for / (or at a folder whose only content is a
    tmp/ of other users' folders): refused, and other users' folders under tmp/ stay."""
    root = tmp_path / "slash"
    (root / "tmp" / "alice-job").mkdir(parents=True)
    (root / "tmp" / "alice-job" / "out.txt").write_text("alice's results\n")
    if layout == "slash":
        for d in ("bin", "etc", "home/alice"):
            (root / d).mkdir(parents=True)
        (root / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    if os.getuid() == 0:
        os.chown(root / "tmp" / "alice-job", OTHER_UID, OTHER_UID)
    before = snapshot(root)
    monkeypatch.setenv("CODA_CUTLASS_CACHE_DIR", str(root))
    with pytest.raises(cc.ConfigError, match="is not a coda-cutlass cache.*tmp/alice-job"):
        build(SRC, "k")
    assert main(["cache"]) == 2 and main(["cache", "--export", str(tmp_path / "out")]) == 2
    assert snapshot(root) == before and not (tmp_path / "out").exists()


def test_cache_export_leaves_user_folders_under_kernels_alone(fake_nvcc, tmp_path, capsys):
    good = build(SRC, "k")
    cache = fake_nvcc["cache"]
    user = cache / "kernels" / "ex" / "experiment"       # where entry_dir("experiment") points
    user.mkdir(parents=True)
    (user / "notes.txt").write_text("mine\n")
    before = snapshot(cache / "kernels")
    assert main(["cache", "--export", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "kernels: 1\n" in out and "exported 1 verified kernels" in out
    assert snapshot(cache / "kernels") == before and good.path.is_file()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [f"{good.source_key}.so", f"{good.source_key}.json"])


def test_tmp_sweep_removes_only_names_the_cache_makes(fake_nvcc, monkeypatch):
    build(SRC, "k")
    tmp = fake_nvcc["cache"] / "tmp"
    (tmp / "experiment-1").mkdir()
    (tmp / "experiment-1" / "results.csv").write_text("1,2\n")
    key = build_key(SRC + "// other\n", toolchain())
    stale = [tmp / f"{key}-12345-0badc0de", tmp / f"trash-{key}-0123abcd", tmp / f"{key}-aside-89abcdef"]
    for d in stale:
        make_dirs(d)
        write_file(d / "kernel.cu", "// left by a killed build\n")
    build(SRC + "// other\n", "k")                     # sweeps under that key's lock
    assert (tmp / "experiment-1" / "results.csv").read_text() == "1,2\n"
    assert not any(d.exists() for d in stale)


def test_empty_cache_dir_argument_is_an_error_not_the_current_folder(fake_nvcc, monkeypatch, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(cc.ConfigError, match="cache_dir='' is empty"):
        build(SRC, "k", cache_dir="")
    with pytest.raises(cc.ConfigError, match="cache_dir='' is empty"):
        TuningStore("")
    assert list(work.iterdir()) == []


def test_cache_chmods_no_folder_it_did_not_create(fake_nvcc, monkeypatch, tmp_path):
    """An empty folder of yours that your group can write: not made 0700 behind your back; the
    cache says why it is not used and builds elsewhere."""
    team = tmp_path / "team"
    team.mkdir()
    os.chmod(team, 0o2775)
    monkeypatch.setenv("CODA_CUTLASS_CACHE_DIR", str(team))
    monkeypatch.setattr(cache_mod, "fallback_root", lambda: tmp_path / "fallback")
    with pytest.warns(RuntimeWarning, match="team is writable by its group.*did not create"):
        r = build(SRC, "k")
    assert mode(team) == 0o2775 and list(team.iterdir()) == []
    assert tmp_path / "fallback" in r.path.parents


def test_a_new_or_empty_folder_becomes_a_marked_cache(fake_nvcc, tmp_path):
    for root in (tmp_path / "new" / "cache", tmp_path / "empty"):
        if root.name == "empty":
            root.mkdir()
        r = build(SRC, "k", cache_dir=root)
        assert root in r.path.parents and (root / "CACHEDIR.TAG").read_text().startswith(
            "Signature: 8a477f597d28d172789f06886806bc55")
        assert build(SRC, "k", cache_dir=root).origin == "cache"


def old_cache(fake_nvcc) -> tuple[Path, object]:
    """A cache as coda-cutlass made it before the marker: entries, a failed build, locks, tuning,
    and what killed builds leave in tmp/."""
    good = build(SRC, "k")
    with pytest.raises(cc.BuildError):
        build(SRC + "FAKE_NVCC_FAIL\n", "broken")
    TuningStore().put("shape", REC)
    root = fake_nvcc["cache"]
    make_dirs(root / "tmp" / f"trash-{good.key}-0123abcd")
    write_file(root / "tmp" / f".probe-{'0' * 32}", b"")
    (root / "CACHEDIR.TAG").unlink()
    return root, good


def test_an_old_cache_without_the_marker_is_adopted(fake_nvcc):
    root, good = old_cache(fake_nvcc)
    again = build(SRC, "k")
    assert again.origin == "cache" and again.path == good.path
    assert (root / "CACHEDIR.TAG").is_file() and TuningStore().get("shape") == REC


def test_an_old_cache_with_anything_else_in_it_is_refused(fake_nvcc):
    root, good = old_cache(fake_nvcc)
    (root / "kernels" / good.key[:2] / "notes").mkdir()
    before = snapshot(root)
    with pytest.raises(cc.ConfigError, match=rf"{re.escape(str(root))} is not a coda-cutlass cache.*"
                                             rf"kernels/{good.key[:2]}/notes"):
        build(SRC, "k")
    assert snapshot(root) == before


@needs_root
def test_an_old_cache_with_an_entry_of_another_uid_is_refused(fake_nvcc):
    root, good = old_cache(fake_nvcc)
    os.chown(good.path.parent, OTHER_UID, OTHER_UID)
    with pytest.raises(cc.ConfigError, match=rf"kernels/{good.key[:2]}/{good.key} \(owned by uid {OTHER_UID}\)"):
        build(SRC, "k")
    assert not (root / "CACHEDIR.TAG").exists() and good.path.is_file()


def test_a_link_of_yours_to_your_cache_folder_is_followed(fake_nvcc, tmp_path):
    """~/.cache/coda-cutlass -> /scratch/me/cache, say: the main cache may be a link you made."""
    real = tmp_path / "scratch" / "cache"
    real.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real)
    r = build(SRC, "k", cache_dir=link)
    assert r.origin == "built" and link in r.path.parents and (real / "CACHEDIR.TAG").is_file()


def test_a_cachedir_tag_of_another_tool_is_not_the_marker(fake_nvcc, monkeypatch, tmp_path):
    target = tmp_path / "target"             # a cargo target folder
    (target / "debug").mkdir(parents=True)
    (target / "CACHEDIR.TAG").write_text("Signature: 8a477f597d28d172789f06886806bc55\n# cargo\n")
    before = snapshot(target)
    with pytest.raises(cc.ConfigError, match="is not a coda-cutlass cache.*debug"):
        build(SRC, "k", cache_dir=target)
    assert snapshot(target) == before


# ---------------------------------------------------------------- item 5: a teammate's cache
@needs_root
def test_group_shared_cache_is_read_only_for_a_member(fake_nvcc, monkeypatch, tmp_path):
    """A teammate's cache, group-writable for the team: a member's lookup finds its entries not
    controlled by them alone, skips them and builds in their own fallback; nothing in the
    teammate's cache is moved, deleted or chmodded."""
    team = tmp_path / "team-cache"
    build(SRC, "k", cache_dir=team)
    for p in [team, *team.rglob("*")]:                # chown -R teammate; chmod -R g+w (setgid folders)
        os.lchown(p, OTHER_UID, OTHER_UID)
        os.chmod(p, 0o2775 if p.is_dir() else 0o775 if p.name == "kernel.so" else 0o664)
    before = snapshot(team)
    monkeypatch.setattr(cache_mod, "fallback_root", lambda: tmp_path / "mine")
    with pytest.warns(RuntimeWarning, match=f"team-cache is not writable.*belongs to uid {OTHER_UID}"):
        r = build(SRC, "k", cache_dir=team)
    assert r.origin == "built" and tmp_path / "mine" in r.path.parents
    TuningStore(team).put("shape", REC)               # kept in memory only: their cache is not written
    assert snapshot(team) == before


def test_lookup_in_a_cache_you_cannot_claim_moves_nothing(fake_nvcc, monkeypatch, tmp_path):
    """The same rule where no second uid is at hand: a cache whose claim is refused is read-only."""
    first = build(SRC, "k")
    first.path.write_bytes(b"corrupt")
    team = fake_nvcc["cache"]
    before = snapshot(team)
    real_claim = KernelCache.claim
    monkeypatch.setattr(KernelCache, "claim", lambda self: "it belongs to uid 4242, not to you"
                        if self.root == team else real_claim(self))
    monkeypatch.setattr(cache_mod, "fallback_root", lambda: tmp_path / "mine")
    with pytest.warns(RuntimeWarning, match="not writable.*uid 4242"):
        r = build(SRC, "k")
    assert r.origin == "built" and tmp_path / "mine" in r.path.parents
    assert snapshot(team) == before


# ---------------------------------------------------------------- one lock implementation
HOLD_TUNING = """
import sys, warnings
from coda_cutlass.tuning.store import TuningStore
warnings.simplefilter("always")
TuningStore(sys.argv[1]).put("b", {"config": {}, "raster": "n", "swizzle": 1})
"""


def test_tuning_cache_lock_says_whom_it_waits_for_and_times_out(tmp_path, monkeypatch):
    """The tuning cache waits on the build lock's implementation: a progress line naming the
    holder's pid, and CODA_CUTLASS_LOCK_TIMEOUT, after which the choice is kept in memory."""
    root = tmp_path / "c"
    TuningStore(root).put("a", REC)
    env = {**os.environ, "CODA_CUTLASS_LOCK_TIMEOUT": "1", "CODA_CUTLASS_QUIET": "0"}
    with hold(root / "tuning.lock", "tuning", None, False):
        done = subprocess.run([sys.executable, "-c", HOLD_TUNING, str(root)], env=env, capture_output=True,
                              text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"waiting for another process (pid {os.getpid()}) writing the tuning cache" in done.stderr
    assert "kept in memory" in done.stderr
    assert TuningStore(root).get("b") is None and TuningStore(root).get("a") == REC


# ---------------------------------------------------------------- the logger
def test_progress_and_warnings_reach_the_coda_cutlass_logger(fake_nvcc, caplog, capsys):
    caplog.set_level(logging.INFO, logger="coda_cutlass")
    r = build(SRC, "k")                                 # CODA_CUTLASS_QUIET=1: nothing on stderr
    assert capsys.readouterr().err == ""
    r.path.write_bytes(b"corrupt")
    with pytest.warns(RuntimeWarning, match="discarded cache entry"):
        build(SRC, "k")
    got = [(rec.name, rec.levelno, rec.getMessage()) for rec in caplog.records]
    assert any(n == "coda_cutlass" and lv == logging.INFO and m.startswith("compiling k with nvcc")
               for n, lv, m in got), got
    assert any(n == "coda_cutlass" and lv == logging.WARNING and "discarded cache entry" in m
               for n, lv, m in got), got


def test_a_marker_renamed_into_place_while_the_folder_is_read_is_not_a_stray(tmp_path, monkeypatch):
    """Parallel builds claim a new cache at once: one lists the root while another renames the
    marker's temporary file (.CACHEDIR.TAG-<hex>) to CACHEDIR.TAG. A name gone between the listing
    and its lstat is not someone's file (this refused the cache in a CI-like run of the tests)."""
    from coda_cutlass.build import layout
    root = tmp_path / "cache"
    (root / "kernels").mkdir(parents=True)
    gone = ".CACHEDIR.TAG-" + "a" * 32
    real_listdir = os.listdir
    monkeypatch.setattr(layout.os, "listdir",
                        lambda p: real_listdir(p) + ([gone] if Path(p) == root else []))
    assert layout.inspect(root).kind == "old cache"
    (root / "notes.txt").write_text("mine")
    found = layout.inspect(root)
    assert found.kind == "foreign" and "notes.txt" in found.detail and gone not in found.detail
