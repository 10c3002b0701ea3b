"""What ptxas reports about a built kernel: registers per thread, stack frame and register spills.

Every build runs nvcc with ``-Xptxas -v`` (a report only: the same binary, so it is not part of
the cache key). A fused epilogue that spills reloads its values from local memory inside the
epilogue loop; on the H200 such configurations measured slower (a 128 x 256 ping-pong tile 15x,
docs/GPU.md; the FP8 down-proj dX epilogue in ping-pong keeps a 208-byte stack frame while the
cooperative schedule spills nothing, docs/RESULTS.md). The record is kept in the kernel's
metadata (``meta.json``, and the ``.json`` of an exported prebuilt kernel) and shown by
``Kernel.resources``; a build that spills says so.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from .files import read_json_object
from .verify import metadata_path

# Diagnostic nvcc flags: they change what nvcc prints, never the code it writes.
REPORT_FLAGS: tuple[str, ...] = ("-Xptxas", "-v")

_ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '([^']+)'")
_PROPERTIES = re.compile(r"ptxas info\s*: Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"ptxas info\s*: Used (\d+) registers")


@dataclass(frozen=True)
class Resources:
    """ptxas's figures for a kernel's entry function (the worst one when a library has several)."""

    registers: int            # per thread, as compiled (the launch bound; warp-specialised kernels
                              # move registers between warp groups at run time)
    stack_bytes: int          # per-thread stack frame (local memory)
    spill_store_bytes: int
    spill_load_bytes: int
    entry_functions: int = 1

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0

    def describe(self) -> str:
        spills = (f"spills {self.spill_store_bytes} bytes of stores and {self.spill_load_bytes} of loads"
                  if self.spills else "no spills")
        return f"{self.registers} registers, {self.stack_bytes}-byte stack frame, {spills}"

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> "Resources | None":
        """The record a build wrote, or None (a kernel built before the record existed, or a
        malformed one: the record is informational, never a reason to refuse a kernel)."""
        if not isinstance(d, Mapping):
            return None
        try:
            values = {f: d[f] for f in ("registers", "stack_bytes", "spill_store_bytes", "spill_load_bytes")}
            values["entry_functions"] = d.get("entry_functions", 1)
        except KeyError:
            return None
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values.values()):
            return None
        return cls(**values)


def parse_ptxas(output: str) -> Resources | None:
    """The entry functions' figures in nvcc's output (``-Xptxas -v``), or None when it has none.
    A stack frame belongs to the function named by the "Function properties for" line above it;
    the register count to the entry function being compiled."""
    frames: dict[str, tuple[int, int, int]] = {}
    registers: dict[str, int] = {}
    entries: list[str] = []
    entry = current = None
    for line in output.splitlines():
        if m := _ENTRY.search(line):
            entry = current = m.group(1)
            entries.append(entry)
        elif m := _PROPERTIES.search(line):
            current = m.group(1)
        elif (m := _FRAME.search(line)) and current is not None:
            frames[current] = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif (m := _USED.search(line)) and entry is not None:
            registers[entry] = int(m.group(1))
    found = [Resources(registers[e], *frames.get(e, (0, 0, 0)), entry_functions=len(entries))
             for e in dict.fromkeys(entries) if e in registers]
    if not found:
        return None
    return max(found, key=lambda r: (r.spill_store_bytes + r.spill_load_bytes, r.stack_bytes, r.registers))


def read_resources(so: Path) -> Resources | None:
    """The record in a built kernel's metadata (cache entry or prebuilt kernel), or None when there
    is none (built before coda-cutlass kept it, or the build printed no report)."""
    meta = read_json_object(metadata_path(so))
    return Resources.from_json(meta.get("resources")) if meta else None
