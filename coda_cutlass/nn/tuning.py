"""In-sequence tuning: choose each site's kernel configuration where the kernel really runs, inside
the training step's own sequence of GEMMs and attention, sustained.

Timed alone, a fused kernel's best configuration and its ratio to cuBLAS differ from what it gets
inside a block: there the GPU runs GEMMs back to back at its power limit and each kernel follows
its real neighbours (measured on an H200: cuBLAS itself is ~10% faster right after a memory-bound
kernel than after a GEMM). So the tuner runs the whole step repeatedly and times every site with
CUDA events around its launch, changing one site's configuration at a time (coordinate descent,
largest sites first), then its raster order and swizzle. The plan is stored in the tuning cache,
keyed by GPU, dtype, model widths and M bucket, and found again by later processes.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..api import compile_many
from ..build.progress import say
from ..config import KernelConfig
from ..errors import DeviceError
from ..pipeline import Options, lower_program
from ..tuning.space import RUNTIME_CHOICES, candidate_configs
from .plan_store import Choice, store_plan
from .runner import KernelRunner, Recorder


@dataclass(frozen=True)
class Site:
    """One launch point of the step: its program, weight layout and reduction mode."""
    name: str
    program: Any
    layout: str
    partial: bool


def discover_sites(runner: KernelRunner, step: Callable[[], Any]) -> list[Site]:
    """Run the step once and list the GEMM sites it launches, in launch order."""
    seen: dict[str, Site] = {}
    original = runner.gemm

    def spy(site, program, A, W, *, layout="nk", partial=False, **ops):
        seen.setdefault(site, Site(site, program, layout, partial))
        return original(site, program, A, W, layout=layout, partial=partial, **ops)

    runner.gemm = spy  # type: ignore[method-assign]
    try:
        step()
        torch.cuda.synchronize()
    finally:
        del runner.gemm
    return list(seen.values())


def _site_times(runner: KernelRunner, step: Callable[[], Any], iters: int, warmup: int,
                tuned: set[str] | None = None, fused: set[str] = frozenset()) -> dict[str, float]:
    """Median time per site (us) over ``iters`` steps. Sites in ``tuned`` are scored against the
    step's timed work outside the ``fused`` GEMM sites (cuBLAS GEMMs, attention) in the same
    iteration, which no tuning choice changes: the GPU's
    clock drifts by several percent while it heats up at its power limit, which would otherwise
    favour whichever candidate ran first. A tuned site's score is median(t / t_ref) * median(t_ref)."""
    for _ in range(warmup):
        step()
    rec = Recorder()
    runner.recorder = rec
    try:
        for _ in range(iters):
            step()
    finally:
        runner.recorder = None
    times = rec.times_us()
    out = {site: statistics.median(v) for site, v in times.items()}
    refs = [v for site, v in times.items() if site not in fused and len(v) == iters]
    if tuned and refs:
        ref = [sum(v[i] for v in refs) for i in range(iters)]
        ref_median = statistics.median(ref)
        for site in tuned & set(times):
            if len(times[site]) == iters:
                out[site] = statistics.median(t / r for t, r in zip(times[site], ref)) * ref_median
    return out


def tune_in_sequence(runner: KernelRunner, step: Callable[[], Any], *, context: str, M: int, iters: int = 6,
                     warmup: int = 2, runtime: bool = True, candidates: Callable[[Site], list[KernelConfig]] | None = None,
                     cache_dir: Any = None, jobs: int | None = None, verbose: bool | None = None,
                     store: bool = True) -> dict[str, Any]:
    """Tune every GEMM site of ``step`` (a callable running one full step through ``runner``) in
    the step's own sequence. Returns {"sites": {site: choice}, "timings": ...} and stores it."""
    start = time.monotonic()
    sites = discover_sites(runner, step)
    cands = {s.name: (candidates(s) if candidates else
                      candidate_configs(lower_program(s.program, Options.make(runner.dtype, s.layout)).graph))
             for s in sites}
    items = [(s.program, {"weight_layout": s.layout, "config": c, "partial_reductions": s.partial,
                          "cache_dir": cache_dir}) for s in sites for c in cands[s.name]]
    say(f"in-sequence tuning of {len(sites)} sites: building {len(items)} candidate kernels", verbose)
    built = compile_many(items, runner.dtype, jobs=jobs, verbose=verbose, skip_failed=True)
    usable: dict[str, list[KernelConfig]] = {s.name: [] for s in sites}
    i = 0
    for s in sites:
        for c in cands[s.name]:
            k = built[i]
            i += 1
            if k is not None:
                runner._gemms[(s.program.name, id(s.program), s.layout, s.partial, c.name())] = k
                usable[s.name].append(c)
    fused = {s.name for s in sites}
    base = _site_times(runner, step, iters, warmup)
    order = sorted(sites, key=lambda s: -base.get(s.name, 0.0))
    timings: dict[str, list[dict[str, Any]]] = {}
    for s in order:
        best: tuple[float, Choice] | None = None
        rows = timings.setdefault(s.name, [])
        for c in usable[s.name]:
            runner.plan[s.name] = Choice(c)
            us = _site_times(runner, step, iters, warmup, {s.name}, fused)[s.name]
            rows.append({"config": c.name(), "raster": "heuristic", "swizzle": 1, "us": round(us, 1)})
            if best is None or us < best[0]:
                best = (us, Choice(c))
        assert best is not None, f"no candidate of site {s.name} could be built"
        if runtime:
            for raster, swizzle in RUNTIME_CHOICES:
                choice = Choice(best[1].config, raster, swizzle)
                runner.plan[s.name] = choice
                us = _site_times(runner, step, iters, warmup, {s.name}, fused)[s.name]
                rows.append({"config": choice.config.name(), "raster": raster, "swizzle": swizzle, "us": round(us, 1)})
                if us < best[0]:
                    best = (us, choice)
        runner.plan[s.name] = best[1]
        say(f"  {s.name}: {best[1].config.name()} raster={best[1].raster} swizzle={best[1].swizzle} "
            f"{best[0]:.0f} us (untuned {base.get(s.name, float('nan')):.0f} us)", verbose)
    final = _site_times(runner, step, iters, warmup)
    rec = {"sites": {s: c.to_json() for s, c in runner.plan.items()}, "before_us": base, "after_us": final,
           "timings": timings, "seconds": round(time.monotonic() - start, 1)}
    if store:
        store_plan(context, runner.dtype, M, rec, cache_dir)
    return rec


def tune_module(module: Any, runner: Any, step: Callable[[], Any], *, context: str, M: int,
                **options: Any) -> dict[str, Any]:
    """In-sequence tuning of a module's training step (``step``: one forward + backward), with its
    parameters' gradients cleared around every step (the gradients of the tuning steps are dropped)."""
    if not isinstance(runner, KernelRunner):
        raise DeviceError("in-sequence tuning times compiled kernels: it needs the module on a Hopper GPU (sm_90) "
                          "in bf16 or fp16")

    def one() -> None:
        module.zero_grad(set_to_none=True)
        step()

    try:
        return tune_in_sequence(runner, one, context=context, M=M, **options)
    finally:
        module.zero_grad(set_to_none=True)
