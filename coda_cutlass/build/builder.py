"""Turning a generated `.cu` into a loaded-ready `.so`: prebuilt lookup, cache lookup, or nvcc.

nvcc runs without a shell, under a supervisor that takes its whole process tree down on timeout,
interrupt or death of this process (run.py), in a private build directory that holds the source,
the coda headers and a build.sh with the exact command, so the entry can be rebuilt by hand.
Concurrent processes building the same kernel serialise on a per-key lock: one builds, the others
find its entry. A build is published only when nvcc exited 0 and left an ELF shared library; a
forced rebuild replaces the old entry in one atomic step only once the new build succeeded.

Limits: CODA_CUTLASS_BUILD_TIMEOUT (seconds, default 1800; 0: none) or ``timeout=``; waiting on
another process's build: CODA_CUTLASS_LOCK_TIMEOUT (default: the build timeout plus a minute).
"""

from __future__ import annotations

import json
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..env import env_seconds, seconds
from ..errors import BuildError, ToolchainError
from .cache import KernelCache, resolve_cache
from .files import PRIVATE_EXEC, make_dirs, sha256_file, write_file
from .keys import build_key, header_files, source_key
from .prebuilt import find_prebuilt, search_report
from .progress import Ticker, enabled, say, seconds_text
from .resources import parse_ptxas
from .run import EXIT_NOT_FOUND, run
from .toolchain import Toolchain, nvcc_search_report, toolchain

NVCC_TIMEOUT_S = 1800.0
LOCK_MARGIN_S = 60.0
# The script that rebuilds an entry by hand; nvcc gets a private temp folder there too (run.py says
# why): mktemp -d's 0700 folder with a random name in the system's temp folder, whose path nvcc can
# pass through a shell whatever characters the entry's own path holds.
BUILD_SH = """#!/bin/sh
# Rebuilds kernel.so from this directory.
set -e
cd "$(dirname "$0")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export TMPDIR="$tmp" TMP="$tmp" TEMP="$tmp"
"""


@dataclass(frozen=True)
class BuildResult:
    path: Path           # the kernel .so
    source_key: str
    key: str | None      # build key (None for a prebuilt kernel found without a toolchain)
    origin: str          # "prebuilt", "cache" or "built"
    seconds: float       # nvcc wall time when built here, else 0


def build_timeout(timeout: float | str | None = None) -> float | None:
    """The nvcc time limit: the argument, else $CODA_CUTLASS_BUILD_TIMEOUT, else 1800 s."""
    if timeout is not None:
        return seconds(timeout, "timeout")
    return env_seconds("CODA_CUTLASS_BUILD_TIMEOUT", NVCC_TIMEOUT_S)


def build(source: str, name: str, *, cache_dir: str | Path | None = None, verbose: bool | None = None,
          force: bool = False, timeout: float | str | None = None, dtype: object = None) -> BuildResult:
    """``dtype`` (the GEMM operand dtype) only names the kernel in errors."""
    limit = build_timeout(timeout)
    verbose = enabled(verbose)      # CODA_CUTLASS_QUIET read (and a bad value refused) before anything, hits too
    skey = source_key(source)
    if not force:
        pre = find_prebuilt(skey)
        if pre is not None:
            return BuildResult(pre, skey, None, "prebuilt", 0.0)
    try:
        tc = toolchain()
    except ToolchainError as e:
        raise ToolchainError(_not_buildable(name, dtype, skey, force, e)) from None
    key = build_key(source, tc)
    reader, writer = resolve_cache(cache_dir)
    if not force:
        for cache in {id(c): c for c in (reader, writer) if c is not None}.values():
            hit = cache.lookup(key)
            if hit is not None:
                return BuildResult(hit, skey, key, "cache", 0.0)
    if writer is None:
        raise BuildError(f"cannot build {name}: neither {reader.root} nor a temporary directory is writable")
    lock_limit = env_seconds("CODA_CUTLASS_LOCK_TIMEOUT", None if limit is None else limit + LOCK_MARGIN_S)
    with writer.lock(key, f"{name} [{key[:12]}]", lock_limit, verbose):
        hit = None if force else writer.lookup(key)
        if hit is not None:              # another process built it while we waited
            return BuildResult(hit, skey, key, "cache", 0.0)
        writer.sweep_tmp(held=key)
        path, secs = _compile(writer, key, skey, source, name, tc, verbose, limit, replace=force)
    return BuildResult(path, skey, key, "built", secs)


def _not_buildable(name: str, dtype: object, skey: str, force: bool, cause: ToolchainError) -> str:
    what = f"epilogue kernel '{name}'" + (f" for {dtype}" if dtype is not None else "")
    prebuilt = ("not searched (force_rebuild)" if force else "none with this key in:\n"
                + _indent(search_report()))
    return (f"cannot build {what}: {cause}\n"
            f"  source key (the name of a prebuilt kernel): {skey}\n"
            f"  prebuilt kernels ({skey}.so + .json): {prebuilt}\n"
            f"  nvcc searched:\n{_indent(nvcc_search_report())}\n"
            "  Install the CUDA toolkit and the CUTLASS headers (pip install nvidia-cutlass) to build it, or "
            "install a package whose prebuilt kernels include it (python -m coda_cutlass prebuild).")


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _compile(cache: KernelCache, key: str, skey: str, source: str, name: str, tc: Toolchain,
             verbose: bool | None, limit: float | None, replace: bool) -> tuple[Path, float]:
    d = cache.new_build_dir(key)
    kept = False
    try:
        return _compile_in(cache, d, key, skey, source, name, tc, verbose, limit, replace)
    except BuildError as e:
        kept = e.source_path is not None and Path(e.source_path).parent == d   # failed/ refused it
        raise
    finally:
        if d.exists() and not kept:      # interrupted: neither published nor kept as failed
            shutil.rmtree(d, ignore_errors=True)


def _compile_in(cache: KernelCache, d: Path, key: str, skey: str, source: str, name: str, tc: Toolchain,
                verbose: bool | None, limit: float | None, replace: bool) -> tuple[Path, float]:
    write_file(d / "kernel.cu", source)
    for rel, text in header_files():
        make_dirs((d / "include" / rel).parent)
        write_file(d / "include" / rel, text)
    cmd = tc.command("kernel.cu", "kernel.so", ("include",))
    write_file(d / "build.sh", BUILD_SH + shlex.join(cmd) + "\n", PRIVATE_EXEC)
    say(f"compiling {name} with nvcc [{key[:12]}] (about 45 s per kernel on 2 cores; cached afterwards)", verbose)
    say(f"  nvcc: {tc.nvcc} ({tc.nvcc_reason}; {tc.nvcc_version})", verbose)
    with Ticker(name, verbose) as ticker:
        ran = run(cmd, d, limit)
        secs = ticker.elapsed
    log = f"# nvcc {tc.nvcc} ({tc.nvcc_reason})\n$ {shlex.join(cmd)}\n{ran.output}"

    def fail(message: str, tail: str = "") -> BuildError:
        write_file(d / "nvcc.log", log)
        failed = cache.keep_failed(key, d)
        return BuildError(f"{message} building epilogue kernel {name}", source_path=str(failed / "kernel.cu"),
                          log_path=str(failed / "nvcc.log"), log_tail=tail)

    so = d / "kernel.so"
    if ran.timed_out:
        log += f"\ncoda-cutlass: nvcc timed out after {seconds_text(limit)} s; its process group was killed\n"
        raise fail(f"nvcc timed out after {seconds_text(limit)} s (CODA_CUTLASS_BUILD_TIMEOUT)")
    if ran.returncode == EXIT_NOT_FOUND and not Path(tc.nvcc).is_file():
        raise ToolchainError(f"nvcc disappeared: {tc.nvcc}")
    if ran.returncode != 0 or not so.is_file():
        tail = "\n".join(l for l in log.splitlines() if "error" in l.lower())[-3000:] or log[-3000:]
        raise fail(f"nvcc failed (exit {ran.returncode})", tail)
    if not _is_shared_elf(so):
        log += "\ncoda-cutlass: nvcc exited 0 but kernel.so is not an ELF shared library; not published\n"
        raise fail("nvcc exited 0 but kernel.so is not an ELF shared library")
    so.chmod(PRIVATE_EXEC)
    resources = parse_ptxas(ran.output)
    meta = {"key": key, "source_key": skey, "name": name, "so_sha256": sha256_file(so),
            "nvcc": tc.nvcc_version, "cutlass": tc.cutlass_version, "generator": __version__,
            "build_seconds": round(secs, 1), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "resources": resources.to_json() if resources else None}
    write_file(d / "nvcc.log", log)
    write_file(d / "meta.json", json.dumps(meta, indent=2))
    path = cache.publish(key, d, replace=replace)
    say(f"built {name} in {secs:.0f} s -> {path.parent}", verbose)
    if resources is not None and resources.spills:
        say(f"note: {name} spills registers to local memory ({resources.describe()}); a smaller tile "
            "or the cooperative schedule usually avoids it (Kernel.resources)", verbose)
    return path, secs


def _is_shared_elf(path: Path) -> bool:
    """ELF magic, 64-bit, and e_type ET_DYN: what nvcc -shared writes (read from the header only)."""
    with open(path, "rb") as f:
        head = f.read(18)
    if len(head) < 18 or head[:4] != b"\x7fELF" or head[4] != 2:
        return False
    order = "little" if head[5] == 1 else "big"
    return int.from_bytes(head[16:18], order) == 3
