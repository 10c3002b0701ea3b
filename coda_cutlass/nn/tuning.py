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


@dataclass(frozen=True)
class StepTimes:
    """Times (us) of every site over several steps: ``medians`` per site; ``per_step`` for sites
    launched once a step; ``reference`` per step: the work outside the fused GEMM sites (cuBLAS
    GEMMs, attention), which no tuning choice changes (None when there is none)."""
    medians: dict[str, float]
    per_step: dict[str, list[float]]
    reference: list[float] | None

    def score(self, site: str, scale: float | None) -> float:
        """A site's time, comparable between runs while the GPU's clock drifts (it heats up at its
        power limit by several percent during tuning, which would favour whichever candidate ran
        first): median over steps of (site time / reference time) times a fixed ``scale`` (the
        untuned run's reference). Without a reference, the plain median."""
        steps = self.per_step.get(site)
        if scale is None or steps is None or self.reference is None:
            return self.medians[site]
        return statistics.median(t / r for t, r in zip(steps, self.reference)) * scale

    @property
    def reference_median(self) -> float | None:
        return statistics.median(self.reference) if self.reference else None


def _site_times(runner: KernelRunner, step: Callable[[], Any], iters: int, warmup: int,
                fused: set[str] = frozenset()) -> StepTimes:
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
    per_step = {site: v for site, v in times.items() if len(v) == iters}
    refs = [v for site, v in per_step.items() if site not in fused]
    return StepTimes({site: statistics.median(v) for site, v in times.items()}, per_step,
                     [sum(v[i] for v in refs) for i in range(iters)] if refs else None)


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
    base = _site_times(runner, step, iters, warmup, fused)
    scale = base.reference_median
    order = sorted(sites, key=lambda s: -base.medians.get(s.name, 0.0))
    timings: dict[str, list[dict[str, Any]]] = {}
    for s in order:
        best: tuple[float, Choice] | None = None
        rows = timings.setdefault(s.name, [])
        for c in usable[s.name]:
            runner.plan[s.name] = Choice(c)
            us = _site_times(runner, step, iters, warmup, fused).score(s.name, scale)
            rows.append({"config": c.name(), "raster": "heuristic", "swizzle": 1, "us": round(us, 1)})
            if best is None or us < best[0]:
                best = (us, Choice(c))
        assert best is not None, f"no candidate of site {s.name} could be built"
        if runtime:
            for raster, swizzle in RUNTIME_CHOICES:
                choice = Choice(best[1].config, raster, swizzle)
                runner.plan[s.name] = choice
                us = _site_times(runner, step, iters, warmup, fused).score(s.name, scale)
                rows.append({"config": choice.config.name(), "raster": raster, "swizzle": swizzle, "us": round(us, 1)})
                if us < best[0]:
                    best = (us, choice)
        runner.plan[s.name] = best[1]
        say(f"  {s.name}: {best[1].config.name()} raster={best[1].raster} swizzle={best[1].swizzle} "
            f"{best[0]:.0f} us (untuned {base.medians.get(s.name, float('nan')):.0f} us)", verbose)
    final = _site_times(runner, step, iters, warmup, fused)
    rec = {"sites": {s: c.to_json() for s, c in runner.plan.items()}, "before_us": base.medians,
           "after_us": final.medians,
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
