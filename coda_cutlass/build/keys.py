"""Content keys. Never a path: the same program built anywhere gets the same key.

- source key: the generated source, the coda headers it includes, the nvcc flags, the target arch,
  the generator and ABI versions. Prebuilt kernels (which may run where there is no nvcc) are found
  by this key.
- build key: the source key plus the nvcc and CUTLASS versions. The JIT cache uses this one, so a
  toolchain upgrade misses the cache.
"""

from __future__ import annotations

import hashlib
import json
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
    return tuple((str(p.relative_to(root)), p.read_text()) for p in sorted((root / "coda").glob("*.hpp")))


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
    return _digest({"source_key": source_key(source), "nvcc": tc.nvcc_version, "cutlass": tc.cutlass_version})
