"""Turning a generated `.cu` into a loaded-ready `.so`: prebuilt lookup, cache lookup, or nvcc.

nvcc runs without a shell, in a private build directory that holds the source, the coda headers
and a build.sh with the exact command, so the entry can be rebuilt by hand. Concurrent processes
building the same kernel serialise on a per-key lock: one builds, the others find its entry.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..errors import BuildError, ToolchainError
from .cache import KernelCache, mkdirs, resolve_cache, sha256_file, write_file
from .keys import build_key, header_files, source_key
from .prebuilt import find_prebuilt
from .progress import Ticker, say
from .toolchain import toolchain

NVCC_TIMEOUT_S = 1800


@dataclass(frozen=True)
class BuildResult:
    path: Path           # the kernel .so
    source_key: str
    key: str | None      # build key (None for a prebuilt kernel found without a toolchain)
    origin: str          # "prebuilt", "cache" or "built"
    seconds: float       # nvcc wall time when built here, else 0


def build(source: str, name: str, *, cache_dir: str | Path | None = None, verbose: bool | None = None,
          force: bool = False) -> BuildResult:
    skey = source_key(source)
    if not force:
        pre = find_prebuilt(skey)
        if pre is not None:
            return BuildResult(pre, skey, None, "prebuilt", 0.0)
    tc = toolchain()
    key = build_key(source, tc)
    reader, writer = resolve_cache(cache_dir)
    if not force:
        for cache in {id(c): c for c in (reader, writer) if c is not None}.values():
            hit = cache.lookup(key)
            if hit is not None:
                return BuildResult(hit, skey, key, "cache", 0.0)
    if writer is None:
        raise BuildError(f"cannot build {name}: neither {reader.root} nor a temporary directory is writable")
    with writer.lock(key):
        hit = None if force else writer.lookup(key)
        if hit is not None:              # another process built it while we waited
            return BuildResult(hit, skey, key, "cache", 0.0)
        if force and writer.entry_dir(key).exists():
            writer.discard(key, reason="rebuild forced")
        path, seconds = _compile(writer, key, skey, source, name, tc, verbose)
    return BuildResult(path, skey, key, "built", seconds)


def _compile(cache: KernelCache, key: str, skey: str, source: str, name: str, tc, verbose: bool | None
             ) -> tuple[Path, float]:
    d = cache.new_build_dir(key)
    write_file(d / "kernel.cu", source)
    for rel, text in header_files():
        mkdirs((d / "include" / rel).parent)
        write_file(d / "include" / rel, text)
    cmd = tc.command("kernel.cu", "kernel.so", ("include",))
    write_file(d / "build.sh", "#!/bin/sh\n# Rebuilds kernel.so from this directory.\nset -e\ncd \"$(dirname \"$0\")\"\n"
               + shlex.join(cmd) + "\n")
    say(f"compiling {name} with nvcc [{key[:12]}] (about 45 s per kernel on 2 cores; cached afterwards)", verbose)
    with Ticker(name, verbose) as ticker:
        try:
            proc = subprocess.run(cmd, cwd=d, capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
        except FileNotFoundError:
            raise ToolchainError(f"nvcc disappeared: {tc.nvcc}") from None
        except subprocess.TimeoutExpired as e:
            log = f"nvcc timed out after {NVCC_TIMEOUT_S} s\n{e.stdout or ''}{e.stderr or ''}"
            write_file(d / "nvcc.log", log)
            failed = cache.keep_failed(key, d)
            raise BuildError(f"nvcc timed out building {name}", source_path=str(failed / "kernel.cu"),
                             log_path=str(failed / "nvcc.log")) from None
        seconds = ticker.elapsed
    log = f"$ {shlex.join(cmd)}\n{proc.stdout}{proc.stderr}"
    write_file(d / "nvcc.log", log)
    if proc.returncode != 0 or not (d / "kernel.so").is_file():
        failed = cache.keep_failed(key, d)
        tail = "\n".join(l for l in log.splitlines() if "error" in l.lower())[-3000:] or log[-3000:]
        raise BuildError(f"nvcc failed (exit {proc.returncode}) building epilogue kernel {name}",
                         source_path=str(failed / "kernel.cu"), log_path=str(failed / "nvcc.log"),
                         log_tail=tail)
    meta = {"key": key, "source_key": skey, "name": name, "so_sha256": sha256_file(d / "kernel.so"),
            "nvcc": tc.nvcc_version, "cutlass": tc.cutlass_version, "generator": __version__,
            "build_seconds": round(seconds, 1), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_file(d / "meta.json", json.dumps(meta, indent=2))
    path = cache.publish(key, d)
    say(f"built {name} in {seconds:.0f} s -> {path.parent}", verbose)
    return path, seconds
