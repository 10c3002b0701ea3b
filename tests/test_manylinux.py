"""The manylinux tag of a wheel with prebuilt kernels (issue 23, LOW), read from the shared libraries
themselves: the ELF reader agrees with binutils' readelf on real libraries, the tag is the oldest
manylinux baseline providing every symbol version they need, and a library that links something
no manylinux platform has gets none. The wheel itself: test_packaging.py and test_nvcc_build.py."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from coda_cutlass.build.manylinux import ElfNeeds, manylinux_tag, tag_for
from wheelcheck import readelf_needs, system_library


def real_libraries() -> list[Path]:
    libs = [system_library("libgcc_s.so.1"), system_library("libstdc++.so.6"),
            Path(torch.__file__).parent / "lib" / "libtorch_cpu.so", Path(sys.executable).resolve()]
    return [p for p in libs if p.is_file()]


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs binutils' readelf to compare with")
@pytest.mark.parametrize("path", real_libraries(), ids=lambda p: p.name)
def test_the_elf_reader_agrees_with_readelf(path):
    elf = ElfNeeds(path)
    needed, versions = readelf_needs(path)
    assert elf.arch == "x86_64" and elf.libraries == needed
    assert elf.versions == versions


def test_a_library_of_system_libraries_only_gets_the_tag_of_its_newest_glibc_symbol():
    lib = system_library("libgcc_s.so.1")
    _, versions = readelf_needs(lib)
    newest = max(tuple(int(x) for x in v.split("_")[1].split(".")) for v in versions["libc.so.6"])
    tag, why = manylinux_tag([lib])
    assert tag is not None and tag.endswith("_x86_64"), why
    assert tag == tag_for({"GLIBC": newest}, "x86_64")[0] and int(tag.split("_")[2]) >= newest[1]


def test_libraries_linking_what_manylinux_platforms_lack_get_no_tag(tmp_path):
    tag, why = manylinux_tag([Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"])
    assert tag is None and "libc10.so" in why
    (tmp_path / "k.so").write_bytes(b"\x7fELF stand-in")
    tag, why = manylinux_tag([tmp_path / "k.so"])
    assert tag is None and "cannot read" in why
    assert manylinux_tag([]) == (None, "no shared libraries")


@pytest.mark.parametrize("needs,tag", [
    ({"GLIBC": (2, 34), "GLIBCXX": (3, 4), "CXXABI": (1, 3), "GCC": (3, 0)}, "manylinux_2_34_x86_64"),  # a kernel
    ({"GLIBC": (2, 14)}, "manylinux_2_17_x86_64"),                  # rounded up to a baseline
    ({"GLIBC": (2, 2, 5)}, "manylinux_2_17_x86_64"),
    ({"GLIBC": (2, 17), "GLIBCXX": (3, 4, 30)}, "manylinux_2_35_x86_64"),   # libstdc++ of GCC 12
    ({"GLIBC": (2, 28), "CXXABI": (1, 3, 15)}, "manylinux_2_39_x86_64"),
    ({"GLIBC": (2, 36)}, "manylinux_2_36_x86_64"),
    ({"GLIBC": (2, 45)}, "manylinux_2_45_x86_64"),                  # newer than the table: glibc decides
    ({"GLIBC": (2, 41), "GLIBCXX": (3, 4, 40)}, None),
    ({"GLIBC": (3, 0)}, None),
])
def test_the_tag_is_the_oldest_baseline_that_provides_every_version(needs, tag):
    assert tag_for(needs, "x86_64")[0] == tag
