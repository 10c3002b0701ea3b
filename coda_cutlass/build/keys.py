"""Content keys. Never a path: the same program built anywhere gets the same key.

- source key: the generated source, the coda headers it includes, the nvcc flags, the target arch,
  the generator and ABI versions. Prebuilt kernels (which may run where there is no nvcc) are found
  by this key.
- build key: the source key plus the nvcc version and a digest of the content of the CUTLASS
  include trees passed to nvcc (not only version.h's number: a patched or incomplete header tree
  with the same version gets its own key). The JIT cache uses this one, so a toolchain change
  misses the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from functools import lru_cache

from .. import __version__
from ..lower.evt import ABI_VERSION
from ..paths import include_dir
from .toolchain import ARCH, NVCC_FLAGS, Toolchain


_INCLUDE = re.compile(r'^\s*#\s*include\s+"(coda/[A-Za-z0-9_]+\.hpp)"', re.M)


@lru_cache(maxsize=1)
def header_files() -> tuple[tuple[str, str], ...]:
    """(relative path, text) of every coda header."""
    root = include_dir()
    return tuple((str(p.relative_to(root)), p.read_text(encoding="utf-8"))
                 for p in sorted((root / "coda").glob("*.hpp")))


def included_headers(source: str) -> dict[str, str]:
    """The coda headers a source includes, directly or through other coda headers: name -> text."""
    texts = dict(header_files())
    found: dict[str, str] = {}
    todo = _INCLUDE.findall(source)
    while todo:
        name = todo.pop()
        if name in found or name not in texts:
            continue
        found[name] = texts[name]
        todo.extend(_INCLUDE.findall(texts[name]))
    return found


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def source_key(source: str) -> str:
    headers = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in included_headers(source).items()}
    return _digest({"source": source, "headers": headers, "flags": list(NVCC_FLAGS), "arch": ARCH,
                    "generator": __version__, "abi": ABI_VERSION})


def build_key(source: str, tc: Toolchain) -> str:
    return _digest({"source_key": source_key(source), "nvcc": tc.nvcc_version, "cutlass": tc.cutlass_version,
                    "cutlass_headers": [tree_digest(d) for d in tc.cutlass_include]})


_TREE_DIGESTS: dict[tuple[str, str], str] = {}


def _tree_files(root: str) -> list[tuple[str, str]]:
    """(relative path, absolute path) of every file under ``root``, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for f in filenames:
            full = os.path.join(dirpath, f)
            found.append((os.path.relpath(full, root), full))
    found.sort()
    return found


def tree_digest(root: str) -> str:
    """SHA-256 over the relative path and content of every file under an include folder. Hashing
    the CUTLASS tree (~800 files, 26 MB) takes ~30 ms; the result is kept per folder and stat
    fingerprint (path, size, mtime of each file: a ~4 ms walk), so it is computed again only
    when a file changes."""
    files = _tree_files(root)
    stats = []
    for rel, full in files:
        try:
            st = os.stat(full)
        except OSError:
            continue
        stats.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    fingerprint = _digest(stats)
    memo = _TREE_DIGESTS.get((root, fingerprint))
    if memo is None:
        h = hashlib.sha256()
        for rel, full in files:
            try:
                with open(full, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            h.update(f"{rel}\0{len(data)}\0".encode("utf-8", "surrogateescape"))
            h.update(data)
        memo = _TREE_DIGESTS[(root, fingerprint)] = h.hexdigest()
    return memo
