"""Trust on a shared machine (issue 14, items 1, 2, 3, 6, 11), with the fake nvcc: who controls
the cache, private creation whatever the umask, verification right before dlopen, a build key
over the CUTLASS headers' content, and metadata that is valid JSON but not an object.

The other-user test really runs as another uid (setpriv, needs root); it skips, saying why, where
that is not possible."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import coda_cutlass as cc
from coda_cutlass.build import cache as cache_mod
from coda_cutlass.build.builder import build
from coda_cutlass.build.cache import KernelCache
from coda_cutlass.build.files import sha256_file
from coda_cutlass.build.keys import build_key, source_key
from coda_cutlass.build.toolchain import find_cutlass, toolchain
from coda_cutlass.runtime.library import load
from coda_cutlass.tuning.store import CHOICE_FIELDS, TuningStore
from fake_nvcc import ELF_HEADER, payload
from shared_machine import OTHER_UID, as_other_user, mode, needs_other_user, shared_tmp  # noqa: F401 (fixture)

SRC = "// kernel source (trust)\nint y;\n"


PLANT = r"""
import hashlib, json, os, sys
root, key = sys.argv[1], sys.argv[2]
os.umask(0)
entry = os.path.join(root, "kernels", key[:2], key)
os.makedirs(entry, 0o777)
if os.stat(root).st_uid == os.getuid():
    os.chmod(root, 0o777)
so = os.path.join(entry, "kernel.so")
with open(so, "wb") as f:
    f.write(bytes.fromhex(sys.argv[3]) + b"PLANTED")
meta = {"key": key, "so_sha256": hashlib.sha256(open(so, "rb").read()).hexdigest()}
with open(os.path.join(entry, "meta.json"), "w") as f:
    json.dump(meta, f)
"""


@needs_other_user
def test_fallback_planted_by_another_user_is_refused(fake_nvcc, shared_tmp, monkeypatch):
    """Item 1: another uid pre-creates /tmp/coda-cutlass-<uid> (0777) with a kernel.so and a
    matching meta.json; the victim must neither load it nor build into it."""
    monkeypatch.setenv("CODA_CUTLASS_CACHE_DIR", str(shared_tmp / "a_file" / "cache"))
    key = build_key(SRC, toolchain())
    planted = cache_mod.fallback_root()
    as_other_user(PLANT, str(planted), key, ELF_HEADER.hex())
    assert os.stat(planted).st_uid == OTHER_UID and mode(planted) == 0o777
    with pytest.warns(RuntimeWarning, match="fallback is refused.*belongs to uid 65534"):
        r = build(SRC, "k")
    assert r.origin == "built" and payload(r.path) == SRC
    assert planted not in r.path.parents
    assert mode(r.path.parents[3]) == 0o700                  # the per-process private cache
    # loading the planted file directly is refused as well
    with pytest.raises(cc.BuildError, match="refusing to load.*uid 65534|refusing to load.*writable"):
        load(planted / "kernels" / key[:2] / key / "kernel.so")


@needs_other_user
def test_entry_planted_in_own_open_cache_is_ignored(fake_nvcc, monkeypatch, shared_tmp):
    """Your own cache folder left world-writable: it is repaired, and what another uid put in it
    (kernels/ and an entry owned by them) is never loaded, written into, moved or deleted."""
    root = shared_tmp / "mine"
    assert KernelCache(root).claim() is None            # a cache of yours (marked) ...
    shutil.rmtree(root / "kernels")
    os.chmod(root, 0o777)                               # ... left open to everyone
    monkeypatch.setenv("CODA_CUTLASS_CACHE_DIR", str(root))
    key = build_key(SRC, toolchain())
    as_other_user(PLANT, str(root), key, ELF_HEADER.hex())
    planted = root / "kernels" / key[:2] / key / "kernel.so"
    with pytest.warns(RuntimeWarning) as warned:
        r = build(SRC, "k")
    said = "\n".join(str(w.message) for w in warned)
    assert "made it private" in said and "kernels belongs to uid 65534" in said
    assert "discarded" not in said and planted.read_bytes().endswith(b"PLANTED")   # theirs: left alone
    assert mode(root) == 0o700 and payload(r.path) == SRC
    assert root not in r.path.parents               # kernels/ is theirs: built elsewhere


def test_own_world_writable_fallback_is_repaired(fake_nvcc, shared_tmp):
    fb = cache_mod.fallback_root()
    assert KernelCache(fb).claim() is None              # made (and marked) by the cache
    os.chmod(fb, 0o777)
    with pytest.warns(RuntimeWarning) as warned:
        r = build(SRC, "k")
    assert any("made it private" in str(w.message) for w in warned)
    assert mode(fb) == 0o700 and str(r.path).startswith(str(fb)) and payload(r.path) == SRC


def test_cache_below_a_folder_others_can_write_is_not_used(fake_nvcc, shared_tmp, monkeypatch):
    """Entries under a group-writable (not sticky) folder could be swapped by the group: such a
    cache is not written (nor would its entries load); builds go to the fallback, saying why."""
    shared = shared_tmp / "team"
    shared.mkdir()
    os.chmod(shared, 0o775)
    monkeypatch.setenv("CODA_CUTLASS_CACHE_DIR", str(shared / "cache"))
    with pytest.warns(RuntimeWarning, match="team is writable by its group"):
        r = build(SRC, "k")
    assert cache_mod.fallback_root() in r.path.parents and list(shared.iterdir()) == []   # nothing made there


def test_fallback_is_created_private_under_umask_000(fake_nvcc, shared_tmp):
    old = os.umask(0)
    try:
        with pytest.warns(RuntimeWarning, match="not writable"):
            r = build(SRC, "k")
    finally:
        os.umask(old)
    fb = cache_mod.fallback_root()
    assert str(r.path).startswith(str(fb)) and mode(fb) == 0o700


def test_umask_000_keeps_everything_private(fake_nvcc, monkeypatch, tmp_path):
    """Item 2: every level created, the cache root, kernels/, include/ included, is 0700; files
    are 0600 (kernel.so and build.sh 0700)."""
    top = tmp_path / "a"
    monkeypatch.setenv("CODA_CUTLASS_CACHE_DIR", str(top / "b" / "cache"))
    old = os.umask(0)
    try:
        r = build(SRC, "k")
        with pytest.raises(cc.BuildError):
            build(SRC + "FAKE_NVCC_FAIL\n", "broken")
        TuningStore().put("shape", {"config": {}, "raster": "m", "swizzle": 1})
    finally:
        os.umask(old)
    paths = [top, *top.rglob("*")]
    assert {p.name for p in paths} >= {"a", "b", "cache", "kernels", "include", "coda", "locks", "failed",
                                        "tuning.json", "tuning.lock", "meta.json", "kernel.so"}
    for p in paths:
        want = 0o700 if p.is_dir() or p.name in ("kernel.so", "build.sh") else 0o600
        assert mode(p) == want, (p, oct(mode(p)))
    assert r.path.is_file()


def test_swapped_kernel_is_refused_right_before_dlopen(fake_nvcc):
    """Item 3: the .so is checked again at the (lazy) load, not only at compile_epilogue."""
    k = cc.compile_epilogue(cc.epilogue(lambda acc, t=3.0: acc * t, name="swapped"), torch.bfloat16)
    k.path.write_bytes(ELF_HEADER + b"something else")
    with pytest.raises(cc.BuildError, match="refusing to load.*does not match the SHA-256"):
        k.library


def test_swapped_map_kernel_is_refused_right_before_dlopen(fake_nvcc):
    k = cc.compile_map(cc.epilogue(lambda acc, t=3.0: acc * t, name="swapped_map"), torch.bfloat16)
    k.path.write_bytes(ELF_HEADER + b"something else")
    with pytest.raises(cc.BuildError, match="refusing to load.*does not match the SHA-256"):
        k.library


def test_kernel_others_can_write_is_refused_at_load(fake_nvcc):
    r = build(SRC, "k")
    os.chmod(r.path, 0o666)
    with pytest.raises(cc.BuildError, match="refusing to load.*writable by group and others"):
        load(r.path)


def test_verified_kernel_reaches_dlopen(fake_nvcc):
    r = build(SRC, "k")                  # the fake's output passes every check but is no real library
    with pytest.raises(cc.BuildError, match="cannot load kernel library"):
        load(r.path)


def test_prebuilt_folder_others_can_write_is_skipped(fake_nvcc, monkeypatch, tmp_path):
    pre = tmp_path / "pre"
    pre.mkdir()
    skey = source_key(SRC)
    (pre / f"{skey}.so").write_bytes(ELF_HEADER + b"prebuilt")
    (pre / f"{skey}.json").write_text(json.dumps({"so_sha256": sha256_file(pre / f"{skey}.so")}))
    os.chmod(pre, 0o777)
    monkeypatch.setenv("CODA_CUTLASS_PREBUILT_PATH", str(pre))
    with pytest.warns(RuntimeWarning, match="skipping prebuilt kernel.*writable"):
        assert build(SRC, "k").origin == "built"


# ---------------------------------------------------------------- item 6: CUTLASS header content
def fake_cutlass(root: Path, cutlass_h: str) -> Path:
    inc = root / "include" / "cutlass"
    inc.mkdir(parents=True)
    shutil.copy(Path(find_cutlass()[0]) / "cutlass" / "version.h", inc / "version.h")
    (inc / "cutlass.h").write_text(cutlass_h)
    return root


def test_build_key_covers_cutlass_header_content(fake_nvcc, monkeypatch, tmp_path):
    real = build_key(SRC, toolchain())
    empty = fake_cutlass(tmp_path / "empty", "")
    monkeypatch.setenv("CODA_CUTLASS_CUTLASS_DIR", str(empty))
    tc = toolchain()
    copied = build_key(SRC, tc)
    assert copied != real                      # same version.h (same version number), different tree
    h = empty / "include" / "cutlass" / "cutlass.h"
    h.write_text("#pragma once\n")
    edited = build_key(SRC, toolchain())
    assert edited != copied
    st = h.stat()
    os.utime(h, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # touched, same content
    assert build_key(SRC, toolchain()) == edited


def test_cutlass_dir_without_version_h_is_a_clear_error(monkeypatch, tmp_path):
    root = fake_cutlass(tmp_path / "c", "")
    (root / "include" / "cutlass" / "version.h").unlink()
    monkeypatch.setenv("CODA_CUTLASS_CUTLASS_DIR", str(root))
    with pytest.raises(cc.ToolchainError, match="version.h"):
        toolchain()


# ---------------------------------------------------------------- item 11: non-object JSON
@pytest.mark.parametrize("text", ["[]", "null", "1", '"x"', "{bad"])
def test_meta_json_that_is_not_an_object_is_corrupt(fake_nvcc, text):
    r1 = build(SRC, "k")
    (r1.path.parent / "meta.json").write_text(text)
    with pytest.warns(RuntimeWarning, match="discarded cache entry.*not a JSON object"):
        r2 = build(SRC, "k")
    assert r2.origin == "built" and build(SRC, "k").origin == "cache"


@pytest.mark.parametrize("text", ["[]", "null", "1", '"x"'])
def test_prebuilt_json_that_is_not_an_object_is_skipped(fake_nvcc, monkeypatch, tmp_path, text):
    pre = tmp_path / "pre"
    pre.mkdir()
    skey = source_key(SRC)
    (pre / f"{skey}.so").write_bytes(ELF_HEADER)
    (pre / f"{skey}.json").write_text(text)
    monkeypatch.setenv("CODA_CUTLASS_PREBUILT_PATH", str(pre))
    with pytest.warns(RuntimeWarning, match="skipping prebuilt.*not a JSON object"):
        assert build(SRC, "k").origin == "built"


@pytest.mark.parametrize("text", ["[]", "null", "1", '"x"'])
def test_tuning_json_that_is_not_an_object_is_rewritten(tmp_path, text):
    """The cache's own tuning.json, damaged (in a folder that is not yet a cache, such a file is a
    user's: the folder is refused, test_build_robustness.py)."""
    assert KernelCache(tmp_path).claim() is None
    (tmp_path / "tuning.json").write_text(text)
    s = TuningStore(tmp_path)
    with pytest.warns(RuntimeWarning, match="not a JSON object"):
        assert s.get("k") is None
    rec = {"config": {"tile_m": 128}, "raster": "n", "swizzle": 2}
    with pytest.warns(RuntimeWarning, match="replacing .*tuning.json: it is not a JSON object"):
        s.put("k", rec)
    assert s.get("k") == rec


@pytest.mark.parametrize("rec", [[], 1, "x", {"raster": "n"}, {"config": [], "raster": "n", "swizzle": 1}])
def test_tuning_record_without_the_fields_read_is_corrupt(tmp_path, rec):
    (tmp_path / "tuning.json").write_text(json.dumps({"k": rec}))
    with pytest.warns(RuntimeWarning, match="corrupt tuning record"):
        assert TuningStore(tmp_path).get("k", CHOICE_FIELDS) is None
