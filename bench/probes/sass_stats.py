"""Probe (no GPU needed): static SASS statistics of built kernels, and their difference.

The FP8 epilogues are issue-bound (seventeenth session, docs/RESULTS.md): instructions per value
are what an epilogue costs. An epilogue's code is unrolled over its subtiles, so the static count of
an opcode in the kernel tracks how often a thread issues it per tile, except in the bounds-checked
slow paths kept for tiles at the problem's edge. This lists the opcodes of one kernel, or of two
side by side (B - A), from cuobjdump's disassembly:

    python bench/probes/sass_stats.py A.so [B.so] [--top 30] [--json OUT]

A and B are kernel libraries (a cache entry's kernel.so, a prebuilt <key>.so) or cache entry folders.
Needs cuobjdump and nvdisasm, which the CUDA toolkit here lacks: ``pip install
nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`` and put their nvidia/cu13/bin on PATH.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
LOCAL = ("STL", "LDL")


def library(path: Path) -> Path:
    return path / "kernel.so" if path.is_dir() else path


def opcodes(so: Path) -> collections.Counter[str]:
    """Opcode -> count over every function in ``so``."""
    if not shutil.which("cuobjdump") or not shutil.which("nvdisasm"):
        sys.exit("sass_stats: needs cuobjdump and nvdisasm on PATH (pip install nvidia-cuda-cuobjdump "
                 "nvidia-cuda-nvdisasm; their nvidia/cu13/bin)")
    out = subprocess.run(["cuobjdump", "-sass", str(so)], capture_output=True, text=True, check=True).stdout
    return collections.Counter(m.group(1) for line in out.splitlines() if (m := _INSTRUCTION.match(line)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path, nargs="?")
    ap.add_argument("--top", type=int, default=30, help="opcodes shown (largest counts or changes)")
    ap.add_argument("--json", type=Path, help="write the counts here too")
    args = ap.parse_args()
    a = opcodes(library(args.a))
    b = opcodes(library(args.b)) if args.b else None
    print(f"total {sum(a.values())}" + (f" -> {sum(b.values())} ({sum(b.values()) - sum(a.values()):+d})" if b else ""))
    print(f"local memory (spills) {sum(a[o] for o in LOCAL)}" + (f" -> {sum(b[o] for o in LOCAL)}" if b else ""))
    if b is None:
        for op, n in a.most_common(args.top):
            print(f"  {op:10} {n:6}")
    else:
        changed = sorted((op for op in set(a) | set(b) if a[op] != b[op]), key=lambda op: -abs(b[op] - a[op]))
        for op in changed[:args.top]:
            print(f"  {op:10} {a[op]:6} {b[op]:6} {b[op] - a[op]:+6}")
    if args.json:
        args.json.write_text(json.dumps({"a": str(args.a), "b": str(args.b) if args.b else None,
                                         "a_opcodes": dict(a), "b_opcodes": dict(b) if b else None}, indent=1))


if __name__ == "__main__":
    main()
