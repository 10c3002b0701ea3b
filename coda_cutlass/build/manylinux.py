"""Which ``manylinux`` platform tag a set of shared libraries meets (PEP 600), read from the libraries
themselves: the libraries they link (``DT_NEEDED``) and the symbol versions they need from them
(``.gnu.version_r``). setup.py tags a wheel that carries prebuilt kernels with it, computed at
wheel-build time from the kernels being shipped, so an index that refuses ``linux_x86_64`` (PyPI)
takes the wheel and pip installs it only where its glibc is new enough.

Prebuilt kernels link the CUDA runtime statically; what they need of the system is glibc, libgcc_s
and libstdc++ (nvcc's host compiler). The tag's glibc is the newest ``GLIBC_2.x`` any of them needs,
rounded up to a manylinux baseline whose libstdc++ and libgcc also provide the ``GLIBCXX``,
``CXXABI`` and ``GCC`` versions they need. A library linking anything else (libcuda, a dynamic
libcudart) meets no manylinux tag. Standard library only: setup.py loads this file on its own.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Iterable

# Libraries every manylinux platform provides (PEP 600 / auditwheel's policy), and the dynamic loader.
SYSTEM_LIBRARIES = frozenset({
    "libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libutil.so.1", "libnsl.so.1",
    "libresolv.so.2", "libanl.so.1", "libgcc_s.so.1", "libstdc++.so.6", "libatomic.so.1", "libz.so.1",
    "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1",
})

# manylinux_2_<glibc minor> baselines and the newest C++ runtime symbol versions their distributions
# ship (the x86-64 and aarch64 rows of auditwheel's manylinux policy): (GLIBCXX, CXXABI, GCC).
BASELINES: tuple[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = (
    (17, (3, 4, 19), (1, 3, 7), (4, 8, 0)),
    (24, (3, 4, 22), (1, 3, 10), (4, 8, 0)),
    (26, (3, 4, 22), (1, 3, 10), (4, 8, 0)),
    (27, (3, 4, 24), (1, 3, 11), (7, 0, 0)),
    (28, (3, 4, 24), (1, 3, 11), (7, 0, 0)),
    (31, (3, 4, 28), (1, 3, 12), (7, 0, 0)),
    (34, (3, 4, 29), (1, 3, 13), (7, 0, 0)),
    (35, (3, 4, 30), (1, 3, 13), (12, 0, 0)),
    (36, (3, 4, 30), (1, 3, 13), (12, 0, 0)),
    (38, (3, 4, 30), (1, 3, 13), (12, 0, 0)),
    (39, (3, 4, 33), (1, 3, 15), (14, 0, 0)),
    (40, (3, 4, 33), (1, 3, 15), (14, 0, 0)),
    (41, (3, 4, 33), (1, 3, 15), (14, 0, 0)),
)

_MACHINES = {62: "x86_64", 183: "aarch64"}
_SHT_DYNAMIC, _SHT_VERNEED = 6, 0x6FFFFFFE
_DT_NEEDED = 1
_VERSION = re.compile(r"(GLIBC|GLIBCXX|CXXABI|GCC)_([0-9]+(?:\.[0-9]+)*)")


class ElfError(ValueError):
    """Not a 64-bit little-endian ELF shared library this module can read."""


class ElfNeeds:
    """What one shared library needs of the system: its machine, linked libraries, symbol versions."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        data = self.path.read_bytes()
        if data[:4] != b"\x7fELF" or len(data) < 64 or data[4] != 2 or data[5] != 1:
            raise ElfError(f"{self.path}: not a 64-bit little-endian ELF file")
        machine, = struct.unpack_from("<H", data, 18)
        if machine not in _MACHINES:
            raise ElfError(f"{self.path}: ELF machine {machine} is neither x86-64 nor aarch64")
        self.arch = _MACHINES[machine]
        shoff, = struct.unpack_from("<Q", data, 40)
        shentsize, shnum = struct.unpack_from("<HH", data, 58)
        sections = []
        for i in range(shnum):
            start = shoff + i * shentsize
            if start + 64 > len(data):
                raise ElfError(f"{self.path}: truncated section headers")
            _, kind, _, _, offset, size, link, _, _, _ = struct.unpack_from("<IIQQQQIIQQ", data, start)
            sections.append((kind, offset, size, link))
        self.libraries: set[str] = set()
        self.versions: dict[str, set[str]] = {}      # library -> version names needed from it
        for kind, offset, size, link in sections:
            if kind not in (_SHT_DYNAMIC, _SHT_VERNEED) or link >= len(sections):
                continue
            strtab = sections[link]
            text = lambda at: _cstring(data, strtab[1] + at, strtab[1] + strtab[2])  # noqa: E731
            if kind == _SHT_DYNAMIC:
                for at in range(offset, offset + size - 15, 16):
                    tag, value = struct.unpack_from("<qQ", data, at)
                    if tag == _DT_NEEDED:
                        self.libraries.add(text(value))
            else:
                self._read_verneed(data, offset, size, text)

    def _read_verneed(self, data: bytes, offset: int, size: int, text) -> None:
        at, end = offset, offset + size
        while at + 16 <= end:
            _, count, file, aux, nxt = struct.unpack_from("<HHIII", data, at)
            names = self.versions.setdefault(text(file), set())
            entry = at + aux
            for _ in range(count):
                if entry + 16 > len(data):
                    raise ElfError(f"{self.path}: truncated version needs")
                _, _, _, name, anext = struct.unpack_from("<IHHII", data, entry)
                names.add(text(name))
                if not anext:
                    break
                entry += anext
            if not nxt:
                break
            at += nxt

    def needed(self) -> dict[str, tuple[int, ...]]:
        """The newest GLIBC / GLIBCXX / CXXABI / GCC version needed, by family."""
        out: dict[str, tuple[int, ...]] = {}
        for names in self.versions.values():
            for name in names:
                m = _VERSION.fullmatch(name)
                if m:
                    v = tuple(int(x) for x in m.group(2).split("."))
                    out[m.group(1)] = max(out.get(m.group(1), v), v)
        return out


def _cstring(data: bytes, start: int, end: int) -> str:
    stop = data.find(b"\0", start, end)
    if start >= end or stop < 0:
        raise ElfError("a string outside its string table")
    return data[start:stop].decode("ascii", "replace")


def manylinux_tag(paths: Iterable[Path | str]) -> tuple[str | None, str]:
    """(tag, why): the manylinux platform tag every library meets, e.g. ``manylinux_2_34_x86_64``,
    or (None, the reason none fits)."""
    needs: dict[str, tuple[int, ...]] = {}
    arches = set()
    count = 0
    for path in paths:
        count += 1
        try:
            elf = ElfNeeds(path)
        except (OSError, ElfError, struct.error) as e:
            return None, f"cannot read {path}: {e}"
        extra = sorted(elf.libraries - SYSTEM_LIBRARIES)
        if extra:
            return None, f"{path} links {', '.join(extra)}, which manylinux platforms do not provide"
        arches.add(elf.arch)
        for family, version in elf.needed().items():
            needs[family] = max(needs.get(family, version), version)
    if not count:
        return None, "no shared libraries"
    if len(arches) != 1:
        return None, f"libraries for several machines: {sorted(arches)}"
    return tag_for(needs, arches.pop())


def tag_for(needs: dict[str, tuple[int, ...]], arch: str) -> tuple[str | None, str]:
    """The manylinux tag of the oldest baseline that provides these symbol versions (family ->
    newest version needed)."""
    glibc = needs.get("GLIBC", (2, 17))
    if glibc[0] != 2:
        return None, f"GLIBC_{'.'.join(map(str, glibc))} is no glibc 2 version"
    minor = glibc[1] if len(glibc) > 1 else 0
    for base, glibcxx, cxxabi, gcc in BASELINES:
        if base >= minor and needs.get("GLIBCXX", ()) <= glibcxx and needs.get("CXXABI", ()) <= cxxabi \
                and needs.get("GCC", ()) <= gcc:
            return f"manylinux_2_{base}_{arch}", f"needs {_describe(needs)}"
    if minor > BASELINES[-1][0]:      # newer than the baselines known here: glibc alone decides
        return f"manylinux_2_{minor}_{arch}", f"needs {_describe(needs)}"
    return None, f"needs {_describe(needs)}: newer C++ runtime versions than a glibc 2.{minor} baseline ships"


def _describe(needs: dict[str, tuple[int, ...]]) -> str:
    return ", ".join(f"{k}_{'.'.join(map(str, v))}" for k, v in sorted(needs.items())) or "no versioned symbols"
