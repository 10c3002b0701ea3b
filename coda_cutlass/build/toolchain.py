"""Finding nvcc and the CUTLASS headers, and the exact flags every kernel is built with.

Flags (docs/DESIGN.md): always -DNDEBUG (device asserts make ptxas serialize wgmma), sm_90a, C++17.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import ToolchainError
from .resources import REPORT_FLAGS

ARCH = "sm_90a"

# Everything but the include paths; part of the cache key.
NVCC_FLAGS: tuple[str, ...] = (
    "-std=c++17", "-O3", "-DNDEBUG",
    "-gencode=arch=compute_90a,code=sm_90a",
    "--expt-relaxed-constexpr",
    "-shared", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
)


@dataclass(frozen=True)
class Toolchain:
    nvcc: str
    nvcc_version: str
    cutlass_include: tuple[str, ...]
    cutlass_version: str
    nvcc_reason: str = ""      # why this nvcc was chosen (printed with the build, kept in the log)

    def command(self, source: str, output: str, extra_includes: tuple[str, ...]) -> list[str]:
        includes = [f"-I{p}" for p in (*extra_includes, *self.cutlass_include)]
        # REPORT_FLAGS (ptxas's register and spill report) change only what nvcc prints: not in the key
        return [self.nvcc, *NVCC_FLAGS, *REPORT_FLAGS, *includes, "-o", output, source]


DEFAULT_NVCC = "/usr/local/cuda/bin/nvcc"


def nvcc_candidates() -> list[tuple[str, str]]:
    """(place searched, path or '') in search order: $CODA_CUTLASS_NVCC, $CUDA_HOME/bin,
    $CUDA_PATH/bin, PATH, the default CUDA install."""
    out = [("$CODA_CUTLASS_NVCC", os.environ.get("CODA_CUTLASS_NVCC", ""))]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        out.append((f"${var}/bin/nvcc", os.path.join(root, "bin", "nvcc") if root else ""))
    out.append(("PATH", shutil.which("nvcc") or ""))
    out.append(("the default CUDA install", DEFAULT_NVCC))
    return out


def nvcc_search_report() -> str:
    """Where nvcc was looked for and what was found there, one place a line (for errors)."""
    lines = []
    for place, path in nvcc_candidates():
        if place == "PATH" and not path:
            state = f"no nvcc in PATH={os.environ.get('PATH', '')}"
        elif not path:
            state = "unset"
        elif _executable(path):
            state = path
        else:
            state = f"{path}: no such executable"
        lines.append(f"{place}: {state}")
    return "\n".join(lines)


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_nvcc() -> tuple[str, str]:
    """(nvcc path, why it was chosen): the first usable place of ``nvcc_candidates``."""
    for place, path in nvcc_candidates():
        if place == "$CODA_CUTLASS_NVCC" and path and not _executable(path):
            raise ToolchainError(f"CODA_CUTLASS_NVCC={path} is not an executable file")
        if path and _executable(path):
            if place == "the default CUDA install":
                return path, f"from {place}: not on PATH, and CODA_CUTLASS_NVCC, CUDA_HOME, CUDA_PATH are unset"
            return path, f"from {place}"
    raise ToolchainError("nvcc not found: install the CUDA toolkit (12.4 or newer; 13.0 is tested), put nvcc "
                         "on PATH, or set CUDA_HOME or CODA_CUTLASS_NVCC")


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


@lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    try:
        out = _decode(subprocess.run([nvcc, "--version"], capture_output=True, timeout=60, check=True).stdout)
    except (OSError, subprocess.SubprocessError) as e:
        raise ToolchainError(f"could not run {nvcc} --version: {e}") from None
    lines = [l.strip() for l in out.splitlines() if l.strip()]
    build = next((l for l in lines if l.startswith("Build ")), None)
    release = next((l for l in lines if "release" in l), None)
    return " | ".join(x for x in (release, build) if x) or out.strip()


def find_cutlass() -> tuple[str, ...]:
    """Include directories: $CODA_CUTLASS_CUTLASS_DIR (a CUTLASS checkout) or the nvidia-cutlass wheel."""
    explicit = os.environ.get("CODA_CUTLASS_CUTLASS_DIR") or os.environ.get("CUTLASS_DIR")
    if explicit:
        root = Path(explicit)
        if not (root / "include" / "cutlass" / "cutlass.h").is_file():
            raise ToolchainError(f"CUTLASS checkout {root} has no include/cutlass/cutlass.h")
        return (str(root / "include"), str(root / "tools" / "util" / "include"))
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise ToolchainError("CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0, or set "
                             "CODA_CUTLASS_CUTLASS_DIR to a CUTLASS 4.x checkout")
    base = Path(list(spec.submodule_search_locations)[0]) / "source"
    inc = base / "include"
    if not (inc / "cutlass" / "cutlass.h").is_file():
        raise ToolchainError(f"the nvidia-cutlass package at {base.parent} has no C++ headers "
                             "(expected source/include/cutlass/cutlass.h)")
    return (str(inc), str(base / "tools" / "util" / "include"))


def cutlass_version(include: str) -> str:
    try:
        text = Path(include, "cutlass", "version.h").read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ToolchainError(f"CUTLASS headers in {include} have no readable cutlass/version.h ({e.strerror}); "
                             "point CODA_CUTLASS_CUTLASS_DIR at a complete CUTLASS 4.x checkout") from None
    parts = [re.search(rf"#define CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        return "unknown"
    return ".".join(m.group(1) for m in parts)  # type: ignore[union-attr]


@lru_cache(maxsize=1)
def _cached_toolchain(nvcc_env: str, cutlass_env: str, path_env: str) -> Toolchain:
    nvcc, reason = find_nvcc()
    includes = find_cutlass()
    return Toolchain(nvcc=nvcc, nvcc_version=nvcc_version(nvcc), cutlass_include=includes,
                     cutlass_version=cutlass_version(includes[0]), nvcc_reason=reason)


def toolchain() -> Toolchain:
    """The toolchain for the current environment (re-detected when the relevant variables change)."""
    return _cached_toolchain("|".join(os.environ.get(v, "") for v in ("CODA_CUTLASS_NVCC", "CUDA_HOME", "CUDA_PATH")),
                             os.environ.get("CODA_CUTLASS_CUTLASS_DIR", "") + os.environ.get("CUTLASS_DIR", ""),
                             os.environ.get("PATH", ""))
