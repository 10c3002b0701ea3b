"""The back half of the compiler: generated sources -> built, callable ``CompiledEpilogue`` kernels,
one or many in parallel. The api and the autotuner are both built on it.
"""

from __future__ import annotations

import numbers
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from .build.builder import build
from .build.progress import say
from .dtypes import DType
from .errors import BuildError, ConfigError
from .fp8.gemm import Fp8Gemm
from .fp8.scales import check_fp8_shapes, check_scales, split_scales
from .frontend.trace import REFERENCE_KEYWORDS
from .interpret import check_mode, interpret
from .ir.nodes import Program
from .pipeline import Generated, check_fp8_layout
from .runtime.arguments import CallSpec, flatten_batch
from .runtime.kernel import Kernel

def checked_reference(ir: Program, spec: CallSpec, A: Any, W: Any, operands: dict[str, Any], *, dtype: DType,
                      weight_layout: str, precision: str, partial_tile: tuple[int, int] | None = None,
                      out: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The interpreter behind a call checked as the kernel checks it (``runtime/arguments.py``; at
    ``precision="fp32"`` float32 tensors are accepted for every tensor argument), with leading batch
    dimensions flattened and restored as the kernel does. Accumulated outputs are updated in place,
    and tile outputs given in ``out`` are written into those tensors and returned as given.
    An FP8 program (``ir.meta["fp8"]``) takes A and W in its FP8 dtypes and scale_a / scale_b,
    checked as the kernel checks them (fp8/scales.py)."""
    check_mode(precision, weight_layout)
    fp8 = Fp8Gemm.from_meta(ir.meta.get("fp8"))
    operands = dict(operands)
    scales = split_scales(operands, fp8, ir.name)
    if fp8 is not None:
        check_fp8_layout(weight_layout)
    spec.check_out(out)
    batch = None
    if isinstance(A, torch.Tensor) and A.dim() > 2:
        given = {o.name: operands[o.name] for o in spec.operands if o.inout and o.name in operands}
        given.update(out or {})      # returned as passed, with their leading dimensions
        A, operands, out, batch = flatten_batch(spec, A, W, operands, weight_layout, out)
    fp32_ok = precision == "fp32"
    keywords = REFERENCE_KEYWORDS | {"out"}       # the call's options, for misspelt operands
    if fp8 is None:
        spec.check_reference(A, W, operands, dtype, weight_layout, fp32_ok=fp32_ok, keywords=keywords, out=out)
    else:
        M, N, K = spec.check_reference(A, W, operands, fp8.a, weight_layout, fp32_ok=fp32_ok,
                                       keywords=keywords, w_dtype=fp8.w, out=out)
        check_fp8_shapes(fp8, M, N, K, ir.name)
        check_scales(fp8, scales, M, N, K, A.device, tma=False)
        operands.update(scales)
    res = interpret(ir, A, W, operands, weight_layout=weight_layout, precision=precision, partial_tile=partial_tile)
    for name, t in (out or {}).items():       # as the kernel: written into the tensor given
        res[name] = t.copy_(res[name])
    return batch.restore(spec, res, given, partial_tile is not None) if batch else res


class CompiledEpilogue(Kernel):
    """A fused GEMM + epilogue kernel built from an epilogue program (see ``runtime.kernel.Kernel``),
    with the program's reference interpreter beside it."""

    def reference(self, A: torch.Tensor, W: torch.Tensor, /, *, precision: str = "kernel",
                  out: Mapping[str, torch.Tensor] | None = None, **operands: Any) -> dict[str, torch.Tensor]:
        """The torch interpreter's result for the same call (the same output dict), after the kernel
        call's checks. As the kernel, it updates accumulated outputs in place (pass copies to keep
        the originals) and writes tile outputs into the ``out`` tensors given. ``precision="fp32"``
        also takes float32 copies of every tensor."""
        tile = self.config.tile if self.partial_reductions else None
        return checked_reference(self.ir, self.spec, A, W, operands, dtype=self.dtype,
                                 weight_layout=self.weight_layout, precision=precision, partial_tile=tile, out=out)


def compile_generated(gen: Generated, *, partial_reductions: bool = False, cache_dir: str | Path | None = None,
                      verbose: bool | None = None, force_rebuild: bool = False,
                      build_timeout: float | None = None) -> CompiledEpilogue:
    """Build one generated kernel (or fetch it from the prebuilt kernels or the cache)."""
    result = build(gen.source, gen.program.name, cache_dir=cache_dir, verbose=verbose, force=force_rebuild,
                   timeout=build_timeout, dtype=gen.options.dtype.torch)
    return CompiledEpilogue(gen, result, partial_reductions=partial_reductions)


def default_jobs() -> int:
    """Parallel nvcc jobs: one per core, but at most one per 2 GiB of memory (cicc peaks near that)."""
    cores = os.cpu_count() or 2
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return cores
    return max(1, min(cores, int(mem_gib // 2)))


def parallel_jobs(jobs: Any) -> int:
    """The number of parallel nvcc jobs asked for: a positive int, or None for ``default_jobs()``."""
    if jobs is None:
        return default_jobs()
    if isinstance(jobs, bool) or not isinstance(jobs, numbers.Integral) or jobs < 1:
        raise ConfigError(f"jobs must be a positive number of parallel nvcc jobs, or None for one per core "
                          f"(memory permitting), got {jobs!r}")
    return int(jobs)


def _spill_note(k: CompiledEpilogue) -> str:
    """What a single build's note says of a kernel that spills (the builds run quiet here)."""
    res = k.resources
    return (f"; spills registers to local memory ({res.describe()}), Kernel.resources"
            if res is not None and res.spills else "")


def compile_parallel(items: Sequence[tuple[Generated, dict[str, Any]]], *, jobs: int | None = None,
                     verbose: bool | None = None, skip_failed: bool = False) -> list[CompiledEpilogue | None]:
    """Build (generated kernel, build options) pairs with up to ``jobs`` nvcc processes at once;
    results in input order. Build options: partial_reductions, cache_dir, force_rebuild, build_timeout. A failed
    build raises ``BuildError`` once all builds finish, unless ``skip_failed`` (then its entry is None)."""
    jobs = parallel_jobs(jobs)
    total = len(items)
    start = time.monotonic()
    done = [0]

    def one(i: int) -> CompiledEpilogue | BuildError:
        gen, rest = items[i]
        try:
            k = compile_generated(gen, verbose=False, **rest)
        except BuildError as e:
            done[0] += 1
            say(f"[{done[0]}/{total}] {gen.program.name}: FAILED (log: {e.log_path})", verbose)
            return e
        done[0] += 1
        say(f"[{done[0]}/{total}] {gen.program.name}: {k.origin}"
            + (f" in {k.build_seconds:.0f} s{_spill_note(k)}" if k.origin == "built" else ""), verbose)
        return k

    say(f"building {total} kernels with up to {jobs} parallel nvcc jobs", verbose)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        out = list(pool.map(one, range(total)))
    failed = [(items[i][0].program.name, r) for i, r in enumerate(out) if isinstance(r, BuildError)]
    say(f"{total - len(failed)} of {total} kernels ready in {time.monotonic() - start:.0f} s", verbose)
    if failed and skip_failed:
        return [None if isinstance(r, BuildError) else r for r in out]
    if failed:
        names = "\n".join(f"  {name}: {e.source_path} (log {e.log_path})" for name, e in failed)
        rest = " (the others are cached)" if len(failed) < total else ""     # (said so when none were)
        raise BuildError(f"{len(failed)} of {total} kernels failed to build{rest}:\n{names}")
    return out  # type: ignore[return-value]
