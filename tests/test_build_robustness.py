"""The cache and export paths under damage a tester found (issue: cache robustness probes), with
the fake nvcc: shell characters in the cache path, group-writable prefix folders, a user's
tuning.json, a damaged marker, odd lock files, a full disk, relative prebuilt paths, an export
that must not delete anything, and smaller cases."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import coda_cutlass as cc
from coda_cutlass.build import cache as cache_mod
from coda_cutlass.build import prebuilt as prebuilt_mod
from coda_cutlass.build.builder import build
from coda_cutlass.build.cache import KernelCache
from coda_cutlass.build.export import export_sources
from coda_cutlass.build.files import make_dirs, write_file
from coda_cutlass.build.layout import MARKER, has_marker
from coda_cutlass.build.run import run
from coda_cutlass.cli import main
from coda_cutlass.tuning.store import TuningStore
from shared_machine import mode, snapshot

SRC = "// kernel source (robustness)\nint r;\n"
REC = {"config": {"tile_m": 128}, "raster": "n", "swizzle": 2}


def calls(fake) -> int:
    return len(fake["log"].read_text().splitlines())


# ---------------------------------------------------------------- 1: shell characters in the path
@pytest.mark.parametrize("char", ["`", "$", '"', "\\"])
def test_cache_path_nvcc_cannot_take_is_refused_for_builds(fake_nvcc, monkeypatch, tmp_path, char):
    """nvcc 13 runs its host compiler through sh -c with TMPDIR (inside the build folder) in double
    quotes: a backquote ran a command, $ expanded. Such a root is refused before anything is
    written in it, naming the character; builds go to the fallback."""
    root = tmp_path / f"cache{char}touch x{char}"
    monkeypatch.setattr(cache_mod, "fallback_root", lambda: tmp_path / "fallback")
    with pytest.warns(RuntimeWarning, match=rf"{root.name[:5]}.*contains .*nvcc") as w:
        r = build(SRC, "k", cache_dir=root)
    assert repr(char) in str(w[0].message) or char in str(w[0].message)
    assert r.origin == "built" and tmp_path / "fallback" in r.path.parents
    assert not root.exists()


def test_run_refuses_a_folder_nvcc_would_pass_through_a_shell(tmp_path):
    d = tmp_path / "b`touch INJECTED`"
    make_dirs(d)
    with pytest.raises(cc.BuildError, match=r"contains `"):
        run(["true"], d, 10)


# ---------------------------------------------------------------- 2: a group-writable prefix folder
@pytest.mark.parametrize("chmod_root", [False, True])
def test_group_writable_prefix_folder_is_repaired_not_the_entry_discarded(fake_nvcc, chmod_root):
    first = build(SRC, "k")
    prefix = first.path.parent.parent
    root = fake_nvcc["cache"]
    ino = first.path.stat().st_ino
    for d in [prefix] + ([root, root / "kernels"] if chmod_root else []):
        os.chmod(d, 0o770)
    with pytest.warns(RuntimeWarning, match=rf"{prefix} was writable by others.*made it private"):
        again = build(SRC, "k")
    assert again.origin == "cache" and again.path.stat().st_ino == ino and calls(fake_nvcc) == 1
    assert mode(prefix) == mode(root) == 0o700


def test_group_writable_entry_files_are_still_rebuilt(fake_nvcc):
    """The repair stops at the cache's folders: a kernel.so a group could rewrite (with a matching
    meta.json) cannot be told from the one built, so it is rebuilt."""
    first = build(SRC, "k")
    for p in (first.path.parent, first.path, first.path.parent / "meta.json"):
        os.chmod(p, os.stat(p).st_mode | 0o020)
    with pytest.warns(RuntimeWarning, match="discarded cache entry.*writable by its group"):
        assert build(SRC, "k").origin == "built"


# ---------------------------------------------------------------- 3: a user's tuning.json
@pytest.mark.parametrize("extra", [(), ("tmp", "kernels")])
@pytest.mark.parametrize("text", ["my own tuning notes, not JSON\n", "[1, 2]", '{"lr": 0.1}'])
def test_a_folder_with_a_users_tuning_json_is_not_adopted(fake_nvcc, tmp_path, text, extra):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "tuning.json").write_text(text)
    for name in extra:
        (proj / name).mkdir()
    before = snapshot(proj)
    with pytest.raises(cc.ConfigError, match=r"proj is not a coda-cutlass cache.*tuning\.json"):
        build(SRC, "k", cache_dir=proj)
    with pytest.warns(RuntimeWarning, match="not saved"):
        TuningStore(proj).put("k", REC)
    assert snapshot(proj) == before and (proj / "tuning.json").read_text() == text


def test_an_old_cache_with_its_tuning_json_is_still_adopted(fake_nvcc):
    build(SRC, "k")
    TuningStore().put("shape", REC)
    (fake_nvcc["cache"] / MARKER).unlink()
    assert build(SRC, "k").origin == "cache" and TuningStore().get("shape") == REC


def test_an_old_cache_whose_tuning_json_was_cut_short_is_still_adopted(fake_nvcc):
    """Beside entries only the cache makes, an unreadable tuning.json is the cache's own (a crash cut
    it short): adopted and replaced, not a refusal until the user deletes it by hand."""
    build(SRC, "k")
    (fake_nvcc["cache"] / MARKER).unlink()
    (fake_nvcc["cache"] / "tuning.json").write_text('{"H100|abc": {"config": ')
    assert build(SRC, "k").origin == "cache"


@pytest.mark.parametrize("text", ["my notes: do not delete\nline2\n", ""])
def test_a_folder_holding_only_a_users_cachedir_tag_is_not_adopted(fake_nvcc, tmp_path, text):
    """A CACHEDIR.TAG that is not ours, alone in a folder, may be a user's file of that name (or
    another tool's signature-only tag): the folder is refused and the file left as it was."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / MARKER).write_text(text)
    with pytest.raises(cc.ConfigError, match=r"proj is not a coda-cutlass cache.*CACHEDIR\.TAG"):
        build(SRC, "k", cache_dir=proj)
    assert (proj / MARKER).read_text() == text and sorted(os.listdir(proj)) == [MARKER]


def test_tuning_put_says_when_it_replaces_a_file_it_cannot_read(fake_nvcc):
    root = fake_nvcc["cache"]
    assert KernelCache(root).claim() is None
    (root / "tuning.json").write_text("garbage")
    with pytest.warns(RuntimeWarning, match=r"replacing .*tuning\.json: it is not a JSON object"):
        TuningStore(root).put("k", REC)
    assert TuningStore(root).get("k") == REC


# ---------------------------------------------------------------- 4: a damaged marker
@pytest.mark.parametrize("damage", [b"", b"\x00\xff garbled", b"Signature: 8a477f"])
def test_a_damaged_marker_is_rewritten(fake_nvcc, damage):
    first = build(SRC, "k")
    root = fake_nvcc["cache"]
    (root / MARKER).write_bytes(damage)
    with pytest.warns(RuntimeWarning, match=f"{MARKER} was damaged.*rewrote it"):
        again = build(SRC, "k")
    assert again.origin == "cache" and again.path == first.path and has_marker(root)


def test_a_damaged_marker_beside_other_files_is_named_as_damaged(fake_nvcc):
    build(SRC, "k")
    root = fake_nvcc["cache"]
    (root / MARKER).write_bytes(b"")
    (root / "notes.txt").write_text("mine")
    with pytest.raises(cc.ConfigError) as e:
        build(SRC, "k")
    assert "notes.txt" in str(e.value) and "CACHEDIR.TAG (damaged" in str(e.value)
    assert "holds CACHEDIR.TAG and no" not in str(e.value)


# ---------------------------------------------------------------- 5: odd lock files
@pytest.mark.parametrize("kind", ["dir", "symlink"])
def test_a_lock_that_is_not_a_file_is_a_clear_error(fake_nvcc, tmp_path, kind):
    first = build(SRC, "k")
    lock = fake_nvcc["cache"] / "locks" / f"{first.key}.lock"
    lock.unlink()
    target = tmp_path / "target.txt"
    target.write_text("canary")
    if kind == "dir":
        lock.mkdir()
    else:
        lock.symlink_to(target)
    first.path.unlink()
    with pytest.warns(RuntimeWarning, match="discarded"), pytest.raises(cc.BuildError) as e:
        build(SRC, "k")
    assert str(lock) in str(e.value) and "remove it" in str(e.value)
    assert target.read_text() == "canary"


def test_a_short_lock_timeout_is_printed_with_its_digits(fake_nvcc, monkeypatch, capsys):
    first = build(SRC, "k")
    first.path.unlink()
    monkeypatch.setenv("CODA_CUTLASS_LOCK_TIMEOUT", "0.001")
    with KernelCache().lock(first.key):                 # another builder holds it
        with pytest.warns(RuntimeWarning, match="discarded"), \
                pytest.raises(cc.BuildError, match=r"gave up after 0\.\d+ s waiting"):
            build(SRC, "k", verbose=True)
    assert "for at most 0.001 s" in capsys.readouterr().err


# ---------------------------------------------------------------- 6: a full disk
def under_file_size_limit(code: str, limit: int = 4096) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a child Python whose RLIMIT_FSIZE stands in for a full disk (Python ignores
    SIGXFSZ: writes fail with EFBIG). A child, because the limit covers every file the process
    writes: in this process it also failed pytest's own output when that is redirected to a log
    file longer than the limit (CI's), which stopped the whole run. The child imports this
    checkout's coda_cutlass and sets the limit itself (its output goes to pipes, which it spares)."""
    root = Path(__file__).resolve().parent.parent
    head = ("import resource\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", head + code], capture_output=True, text=True, env=env,
                          cwd=root, timeout=120)


def test_a_failed_write_names_the_file_and_leaves_nothing(tmp_path):
    path = tmp_path / "big.bin"
    child = under_file_size_limit(
        "from pathlib import Path\n"
        "from coda_cutlass.build.files import write_file\n"
        "try:\n"
        f"    write_file(Path({str(path)!r}), b'x' * 100_000)\n"
        "except OSError as e:\n"
        "    print('OSError:', e)\n")
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith("OSError:") and str(path) in child.stdout
    assert not path.exists()


def test_export_to_a_full_disk_leaves_no_temp_file(fake_nvcc, tmp_path):
    build(SRC + "//" + "x" * 100_000 + "\n", "k")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    child = under_file_size_limit(
        "import sys\n"
        "from coda_cutlass.cli import main\n"
        f"sys.exit(main(['cache', '--export', {str(out)!r}]))\n")
    assert child.returncode == 2, child.stderr
    assert "File too large" in child.stderr, child.stderr                 # the disk, not the arguments
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------- 7: a relative prebuilt path
def test_relative_prebuilt_path_is_made_absolute_once(fake_nvcc, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CODA_CUTLASS_PREBUILT_PATH", f"good{os.pathsep}/abs")
    with pytest.warns(RuntimeWarning, match="no such folder"):      # neither exists
        first = prebuilt_mod.search_dirs()
    monkeypatch.chdir("/")
    assert prebuilt_mod.search_dirs() == first
    assert first[:2] == [tmp_path / "good", Path("/abs")]


def test_prebuilt_path_entry_that_is_no_folder_is_named_once(fake_nvcc, monkeypatch, tmp_path):
    # a misspelt folder or the .so itself was skipped silently: every kernel then built by JIT
    so = tmp_path / "k.so"
    so.write_bytes(b"")
    (tmp_path / "pre").mkdir()
    monkeypatch.setenv("CODA_CUTLASS_PREBUILT_PATH", os.pathsep.join([str(so), str(tmp_path / "pre"),
                                                                     str(tmp_path / "prebuit")]))
    with pytest.warns(RuntimeWarning) as record:
        prebuilt_mod.search_dirs()
    said = [str(w.message) for w in record]
    assert len(said) == 2, said
    assert f"{so}: a file, not a folder" in said[0] and f"{tmp_path / 'prebuit'}: no such folder" in said[1], said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prebuilt_mod.search_dirs()                  # once per value of the variable, not every lookup


# ---------------------------------------------------------------- 8: export reads, never deletes
def test_export_skips_a_damaged_entry_and_leaves_it(fake_nvcc, tmp_path, capsys):
    first = build(SRC, "k")
    first.path.write_bytes(first.path.read_bytes()[:5])
    before = snapshot(first.path.parent)
    with pytest.warns(RuntimeWarning, match=rf"not exporting cache entry {first.path.parent}.*left in place"):
        assert main(["cache", "--export", str(tmp_path / "out")]) == 0
    assert snapshot(first.path.parent) == before
    assert "exported 0" in capsys.readouterr().out


# ---------------------------------------------------------------- 9: smaller cases
def test_export_to_a_file_says_not_a_folder(fake_nvcc, tmp_path, capsys):
    build(SRC, "k")
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for target in (afile, afile / "sub"):
        assert main(["cache", "--export", str(target)]) == 2
        err = capsys.readouterr().err
        assert "not a folder" in err and "FileExistsError" not in err, err
    assert afile.read_text() == "mine"


@pytest.mark.parametrize("blank", [" ", "\t\n"])
def test_a_blank_cache_dir_counts_as_unset(fake_nvcc, monkeypatch, tmp_path, blank):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CODA_CUTLASS_CACHE_DIR", blank)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_mod.default_root() == tmp_path / "xdg" / "coda-cutlass"
    with pytest.raises(cc.ConfigError, match="empty"):
        KernelCache(blank)
    assert not os.path.lexists(tmp_path / blank)


def test_an_entry_that_is_a_file_is_removed_not_left_in_tmp(fake_nvcc):
    first = build(SRC, "k")
    entry = first.path.parent
    shutil.rmtree(entry)
    entry.write_text("x")
    with pytest.warns(RuntimeWarning, match="discarded"):
        assert build(SRC, "k").origin == "built"
    assert [p.name for p in (fake_nvcc["cache"] / "tmp").iterdir() if p.name.startswith("trash-")] == []


def test_sweep_removes_trash_that_is_a_file(fake_nvcc):
    first = build(SRC, "k")
    trash = fake_nvcc["cache"] / "tmp" / f"trash-{first.key}-0123abcd"
    trash.write_text("x")
    KernelCache().sweep_tmp()
    assert not trash.exists()


def test_prebuilt_recording_another_source_key_is_skipped(fake_nvcc, monkeypatch, tmp_path):
    """An export copied under another kernel's name: its own meta says whose it is."""
    from coda_cutlass.build.files import sha256_file
    from coda_cutlass.build.keys import source_key
    pre = tmp_path / "pre"
    pre.mkdir()
    skey = source_key(SRC)
    (pre / f"{skey}.so").write_text("prebuilt")
    (pre / f"{skey}.json").write_text(json.dumps({"source_key": "0" * 64,
                                                  "so_sha256": sha256_file(pre / f"{skey}.so")}))
    monkeypatch.setenv("CODA_CUTLASS_PREBUILT_PATH", str(pre))
    with pytest.warns(RuntimeWarning, match=rf"skipping prebuilt kernel {pre / skey}\.so.*records source_key"):
        assert build(SRC, "k").origin == "built"


def test_sources_are_not_written_through_a_linked_include_folder(tmp_path):
    user = tmp_path / "src"
    (user / "coda").mkdir(parents=True)
    (user / "coda" / "functors.hpp").write_text("// my header\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "include").symlink_to(user)
    with pytest.raises(cc.ConfigError, match=rf"{out / 'include'} is a symbolic link"):
        export_sources(["// generated\n"], out)
    assert (user / "coda" / "functors.hpp").read_text() == "// my header\n"
    assert sorted(p.name for p in (user / "coda").iterdir()) == ["functors.hpp"]


def test_a_sub_second_build_timeout_is_reported_with_its_digits(fake_nvcc, monkeypatch):
    """CODA_CUTLASS_BUILD_TIMEOUT=0.3 used to read "timed out after 0 s"."""
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "30")
    with pytest.raises(cc.BuildError, match=r"timed out after 0\.3 s"):
        build(SRC, "k", timeout=0.3)
