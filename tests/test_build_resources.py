"""ptxas's resource report (registers, stack frame, spills): parsed from nvcc's output, kept in the
kernel's metadata, carried into exported prebuilt kernels, and said when a build spills. The real
nvcc builds record it too (test_nvcc_build.py)."""

from __future__ import annotations

import json

import pytest

from coda_cutlass.build.builder import build
from coda_cutlass.build.cache import KernelCache
from coda_cutlass.build.export import export_cache_entry
from coda_cutlass.build.keys import source_key
from coda_cutlass.build.resources import REPORT_FLAGS, Resources, parse_ptxas, read_resources
from coda_cutlass.build.toolchain import NVCC_FLAGS, toolchain

SRC = "// kernel source\nint resources;\n"

# nvcc 13.0's output for a library with a non-inlined device function and two entry functions
# (names shortened), the GEMM kernel spilling
REPORT = """\
ptxas info    : 11 bytes gmem
ptxas info    : Function properties for _Z6helperv
    48 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function '_ZN7cutlass13device_kernelI4GemmEEvNT_6ParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN7cutlass13device_kernelI4GemmEEvNT_6ParamsE
    208 bytes stack frame, 240 bytes spill stores, 280 bytes spill loads
ptxas info    : Used 168 registers, used 2 barriers, 208 bytes cumulative stack size
ptxas info    : Compile time = 541.607 ms
ptxas info    : Compiling entry function '_Z10map_kernelv' for 'sm_90a'
ptxas info    : Function properties for _Z10map_kernelv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers
"""


def test_the_worst_entry_function_is_reported():
    r = parse_ptxas(REPORT)
    assert r == Resources(registers=168, stack_bytes=208, spill_store_bytes=240, spill_load_bytes=280,
                          entry_functions=2)
    assert r.spills
    assert r.describe() == "168 registers, 208-byte stack frame, spills 240 bytes of stores and 280 of loads"


def test_an_entry_without_a_frame_line_has_no_stack():
    r = parse_ptxas("ptxas info    : Compiling entry function '_Z1kv' for 'sm_90a'\n"
                    "ptxas info    : Used 32 registers, used 0 barriers\n")
    assert r == Resources(32, 0, 0, 0) and not r.spills
    assert r.describe() == "32 registers, 0-byte stack frame, no spills"


@pytest.mark.parametrize("text", ["", "nvcc warning : something\n", "ptxas info    : 11 bytes gmem\n"])
def test_no_report_is_none(text):
    assert parse_ptxas(text) is None


@pytest.mark.parametrize("record", [None, [], "168", {"registers": 168}, {"registers": -1, "stack_bytes": 0,
                                   "spill_store_bytes": 0, "spill_load_bytes": 0},
                                   {"registers": True, "stack_bytes": 0, "spill_store_bytes": 0,
                                    "spill_load_bytes": 0}])
def test_a_malformed_record_reads_as_none(record):
    assert Resources.from_json(record) is None


def test_round_trip():
    r = parse_ptxas(REPORT)
    assert Resources.from_json(json.loads(json.dumps(r.to_json()))) == r


def test_the_report_flags_are_passed_but_not_part_of_the_key(fake_nvcc):
    # they change what nvcc prints, not the binary: kernels built before keep their cache entries
    assert not set(REPORT_FLAGS) & set(NVCC_FLAGS)
    cmd = toolchain().command("kernel.cu", "kernel.so", ("include",))
    i = cmd.index("-Xptxas")
    assert cmd[i:i + 2] == list(REPORT_FLAGS)


def test_a_build_records_its_resources(fake_nvcc):
    r = build(SRC, "k")
    meta = json.loads((r.path.parent / "meta.json").read_text())
    assert meta["resources"] == {"registers": 168, "stack_bytes": 0, "spill_store_bytes": 0,
                                 "spill_load_bytes": 0, "entry_functions": 1}
    assert read_resources(r.path) == Resources(168, 0, 0, 0)
    assert "-Xptxas -v" in (r.path.parent / "build.sh").read_text()


def test_a_spilling_build_says_so(fake_nvcc, monkeypatch, capfd):
    monkeypatch.setenv("FAKE_NVCC_SPILL", "96")
    monkeypatch.setenv("CODA_CUTLASS_QUIET", "0")
    r = build(SRC + "// spills\n", "spilly")
    err = capfd.readouterr().err
    assert "note: spilly spills registers to local memory (168 registers, 104-byte stack frame, spills 96 " \
           "bytes of stores and 96 of loads)" in err
    assert read_resources(r.path).spills


def test_compile_many_says_which_kernels_spill(fake_nvcc, monkeypatch, capfd):
    """WRITING_EPILOGUES §7: a build that spills says so, in parallel builds too (they build quietly
    and report one progress line per kernel)."""
    import torch

    import coda_cutlass as cc
    monkeypatch.setenv("FAKE_NVCC_SPILL", "96")
    monkeypatch.setenv("CODA_CUTLASS_QUIET", "0")
    progs = [cc.epilogue(lambda acc, c=float(i): acc + c, name=f"spilly{i}") for i in range(2)]
    ks = cc.compile_many(progs, torch.bfloat16, jobs=2)
    err = capfd.readouterr().err
    for k in ks:
        line = next(l for l in err.splitlines() if f"] {k.name}: built in" in l)
        assert line.endswith("; spills registers to local memory (168 registers, 104-byte stack frame, spills 96 "
                             "bytes of stores and 96 of loads), Kernel.resources")
    monkeypatch.setenv("FAKE_NVCC_SPILL", "0")
    cc.compile_many([cc.epilogue(lambda acc: acc * 3.0, name="tidy")], torch.bfloat16, jobs=1)
    assert "spills" not in capfd.readouterr().err


def test_a_quiet_build_that_spills_prints_nothing(fake_nvcc, monkeypatch, capfd):
    monkeypatch.setenv("FAKE_NVCC_SPILL", "96")
    build(SRC + "// quiet\n", "quiet")
    assert capfd.readouterr().err == ""


def test_an_entry_built_before_the_record_reads_as_none(fake_nvcc):
    r = build(SRC, "k")
    meta_path = r.path.parent / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["resources"]
    meta_path.write_text(json.dumps(meta))
    assert read_resources(r.path) is None


def test_exported_prebuilt_kernels_keep_the_record(fake_nvcc, tmp_path):
    r = build(SRC, "k")
    cache = KernelCache()
    key = json.loads((r.path.parent / "meta.json").read_text())["key"]
    assert export_cache_entry(cache, key, tmp_path / "pre")
    so = tmp_path / "pre" / f"{source_key(SRC)}.so"
    assert read_resources(so) == Resources(168, 0, 0, 0)


def test_the_cache_command_lists_spilling_kernels(fake_nvcc, monkeypatch, capsys):
    from coda_cutlass.cli import main
    build(SRC, "tidy")
    monkeypatch.setenv("FAKE_NVCC_SPILL", "16")
    build(SRC + "// spills\n", "spilly")
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "kernels: 2" in out and "spilling registers (1, ptxas's report):" in out
    assert "  spilly [" in out and "spills 16 bytes of stores and 16 of loads" in out and "tidy" not in out
