"""In-sequence tuning: choose each site's kernel configuration where the kernel really runs, inside the
training step's own sequence of GEMMs and attention, sustained.

Timed alone, a fused kernel's best configuration and its ratio to cuBLAS differ from what it gets
inside a block: there the GPU runs GEMMs back to back at its power limit and each kernel follows its
real neighbours (measured on an H200: cuBLAS itself is ~10% faster right after a memory-bound kernel
than after a GEMM). So the tuner runs the whole step repeatedly and changes one site's configuration
at a time (coordinate descent, largest sites first), then its raster order and swizzle. A choice is
scored by the site's own time. The choices of a site are visited a few steps each, in a shuffled
order and then its mirror, so the clock's drift while the card heats up (several percent at the
power limit) falls on all of them alike and cancels in the mean. Measured on the H200, two other
scores chose worse plans: the site's time divided by the same steps' other work (it can reward a
configuration that slows its neighbours: 128x128 ping-pong for the 70B norm backward, 1.12x cuBLAS
in the benchmark that followed, the block 5% behind torch.compile, 1% ahead with the earlier plan),
and the whole step's time (step-to-step noise of +-2% at 8B widths swamps differences of 0.1-0.4%
between a site's choices: it picked a 15%-slower out-proj kernel). A confirmation pass then times each
site's incumbent (the stored plan's choice, else the default) against the first pass's fastest few
again and keeps the incumbent unless it is clearly beaten: the first pass's minimum over ~17 noisy
readings favours lucky choices, and re-tunes that picked differently ran 0.7-3.6% slower than the
plans they replaced. The plan is stored in the tuning cache, keyed by GPU, dtype, model widths and M
bucket, and found again by later processes.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..api import compile_many
from ..build.progress import say
from ..config import KernelConfig
from ..errors import DeviceError
from ..pipeline import Options, lower_program
from ..lower.plan import default_config, segments_fit
from ..lower.smem import fits
from ..tuning.space import RUNTIME_CHOICES, candidate_configs
from ..timing import elapsed_us as _us
from ..timing import timed_call
from .kernels import forward_only_site
from .plan_store import Choice, plan_key, store_plan
from .runner import Fp8Options, KernelRunner, Recorder, fp8_parts, gemm_options


@dataclass(frozen=True)
class Site:
    """One launch point of the step: its program, weight layout, reduction mode and, for an FP8
    GEMM, its FP8 options (the runner's: operand dtype(s), scaling[, fast accumulation])."""
    name: str
    program: Any
    layout: str
    partial: bool
    fp8: Fp8Options = None


def discover_sites(runner: KernelRunner, step: Callable[[], Any]) -> list[Site]:
    """Run the step once and list the GEMM sites it launches, in launch order."""
    seen: dict[str, Site] = {}
    original = runner.gemm

    def spy(site, program, A, W, *, layout="nk", partial=False, fp8=None, **ops):
        seen.setdefault(site, Site(site, program, layout, partial, fp8))
        return original(site, program, A, W, layout=layout, partial=partial, fp8=fp8, **ops)

    runner.gemm = spy  # type: ignore[method-assign]
    try:
        step()
        _sync()
    finally:
        del runner.gemm
    return list(seen.values())


def _site_medians(runner: KernelRunner, step: Callable[[], Any], iters: int, warmup: int) -> dict[str, float]:
    """Median time (us) of every site over ``iters`` steps (for ordering the sites and the report)."""
    for _ in range(warmup):
        step()
    rec = Recorder()
    runner.recorder = rec
    try:
        for _ in range(iters):
            step()
    finally:
        runner.recorder = None
    return rec.medians_us()


@dataclass(frozen=True)
class Scored:
    """One choice of a site: the median time (us) of the whole step and of the site's own launches
    (means over visits); ``visits_us``: the site's median in each visit, in round order."""
    choice: Choice
    step_us: float
    site_us: float
    visits_us: tuple[float, ...] = ()

    def row(self) -> dict[str, Any]:
        return {"config": self.choice.config.name(), "raster": self.choice.raster, "swizzle": self.choice.swizzle,
                "step_us": round(self.step_us, 1), "us": round(self.site_us, 1)}


def _label(c: Choice) -> str:
    return f"{c.config.name()} raster={c.raster} swizzle={c.swizzle}"


def _sync() -> None:
    torch.cuda.synchronize()


def compare_choices(runner: KernelRunner, step: Callable[[], Any], site: str, choices: list[Choice], *,
                    rounds: int, iters: int, warmup: int, seed: int = 0) -> list[Scored]:
    """Time ``step`` with each choice for ``site``: ``rounds`` rounds, each visiting every choice
    once (``warmup`` untimed, then ``iters`` timed steps, all queued without synchronising). Odd
    rounds draw a fresh shuffled order, even rounds mirror the one before, so with an even number
    of rounds each choice's mean position is the same and a steady drift of the clock cancels:
    times are the mean over visits of each visit's median."""
    rng = random.Random(seed)
    visits: list[list[tuple[list[Any], Recorder]]] = [[] for _ in choices]
    order: list[int] = []
    for r in range(rounds):
        if r % 2 == 0:
            order = list(range(len(choices)))
            rng.shuffle(order)
        else:
            order.reverse()
        for i in order:
            runner.plan[site] = choices[i]
            for _ in range(warmup):
                step()
            rec = Recorder()
            runner.recorder = rec
            try:
                visits[i].append(([timed_call(step) for _ in range(iters)], rec))
            finally:
                runner.recorder = None
    _sync()
    out = []
    for i, c in enumerate(choices):
        site_visits = tuple(statistics.median(rec.times_us()[site]) for _, rec in visits[i])
        out.append(Scored(c, statistics.fmean(statistics.median(_us(p) for p in steps) for steps, _ in visits[i]),
                          statistics.fmean(site_visits), site_visits))
    return out


def best_choice(scored: list[Scored]) -> Scored:
    """The choice whose kernel is fastest in the sequence."""
    return min(scored, key=lambda s: s.site_us)


def finalists(scored: list[Scored], incumbent: Choice, top: int) -> list[Choice]:
    """The incumbent and the ``top`` fastest other choices of a first pass (distinct choices)."""
    out = [incumbent]
    for s in sorted(scored, key=lambda s: s.site_us):
        if len(out) > top:
            break
        if s.choice not in out:
            out.append(s.choice)
    return out


def clearly_faster(challenger: Scored, incumbent: Scored, margin: float) -> bool:
    """Does ``challenger`` beat ``incumbent`` by more than ``margin`` (relative) and by more than
    twice the standard error of the per-round difference? Visits of one round lie next to each other
    in time, so their difference cancels the slow drift; its spread across rounds is the noise."""
    diffs = [a - b for a, b in zip(incumbent.visits_us, challenger.visits_us)]
    gain = statistics.fmean(diffs)
    noise = 2 * statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
    return gain > max(margin * incumbent.site_us, noise)


def confirm(scored: list[Scored], margin: float) -> tuple[Scored, str]:
    """The confirmation pass's decision: ``scored[0]`` is the incumbent; the fastest challenger
    replaces it only when clearly faster (``clearly_faster``)."""
    incumbent, challengers = scored[0], scored[1:]
    if not challengers:
        return incumbent, "kept (no challenger)"
    best = best_choice(challengers)
    gain = incumbent.site_us / best.site_us - 1
    if gain > 0 and clearly_faster(best, incumbent, margin):
        return best, f"replaced the incumbent (challenger {gain:.1%} faster)"
    return incumbent, f"kept the incumbent (best challenger's gain {gain:+.1%}: not clear)"


def _site_graph(site: Site, dtype: torch.dtype) -> Any:
    fp8 = getattr(site, "fp8", None)
    options = Options.make(dtype, site.layout) if fp8 is None else gemm_options(dtype, site.layout, fp8)
    return lower_program(site.program, options).graph


def named_candidates(names: Sequence[str], dtype: torch.dtype) -> Callable[[Site], list[KernelConfig]]:
    """A ``candidates`` for ``tune_in_sequence``: each site's candidate space (tuning/space.py) cut to
    the configurations named (``KernelConfig.name()``), e.g. the ones a build machine prebuilt, so
    tuning compiles nothing; a site none of them fits keeps its default configuration."""
    wanted = set(names)

    def pick(site: Site) -> list[KernelConfig]:
        graph = _site_graph(site, dtype)
        return [c for c in candidate_configs(graph) if c.name() in wanted] or [default_config(graph)]
    return pick


def _site_candidates(site: Site, dtype: torch.dtype, candidates: Callable[[Site], list[KernelConfig]] | None,
                     extra: Sequence[KernelConfig]) -> list[KernelConfig]:
    graph = _site_graph(site, dtype)
    out = candidates(site) if candidates else candidate_configs(graph)
    names = {c.name() for c in out}
    return out + [c for c in extra if c.name() not in names and fits(c, graph) and segments_fit(c, graph)]


def tune_in_sequence(runner: KernelRunner, step: Callable[[], Any], *, context: str, M: int, iters: int = 2,
                     rounds: int = 2, warmup: int = 1, runtime: bool = True,
                     candidates: Callable[[Site], list[KernelConfig]] | None = None,
                     extra: Sequence[KernelConfig] = (), confirm_top: int = 2, confirm_rounds: int = 4,
                     margin: float = 0.01, only: Callable[[str], bool] | None = None,
                     cache_dir: Any = None, jobs: int | None = None, verbose: bool | None = None,
                     store: bool = True) -> dict[str, Any]:
    """Tune every GEMM site of ``step`` (a callable running one full step through ``runner``) in
    the step's own sequence. Returns {"sites": {site: choice}, "timings": ...} and stores it.
    ``candidates(site)`` replaces the candidate space (tuning/space.py); ``extra`` configurations
    are tried besides it at every site whose program they fit. ``only(site)`` picks the sites to tune
    (default: every site the step launches); the others keep the runner's choice.

    Two passes. The first times every choice of every site (coordinate descent, largest sites
    first). Its winner is partly luck: with 17 choices inside the sequence's noise, the fastest
    reading is biased. So a confirmation pass (``confirm_rounds`` > 0) times each site's incumbent
    (the choice the runner had before tuning: a stored or shipped plan, else the default
    configuration) against the first pass's ``confirm_top`` fastest choices again, in
    ``confirm_rounds`` fresh rounds, and keeps the incumbent unless a challenger is faster by more
    than ``margin`` and by more than twice the standard error of their per-round difference."""
    start = time.monotonic()
    sites = [s for s in discover_sites(runner, step) if only is None or only(s.name)]
    if not sites:
        raise ValueError("in-sequence tuning: the step launches no GEMM site to tune")
    incumbents = {s.name: runner.choice(s.name, s.program, s.layout, s.fp8) for s in sites}
    usable = _build_candidates(runner, sites, {s.name: _site_candidates(s, runner.dtype, candidates, extra)
                                               for s in sites}, cache_dir, jobs, verbose)
    base = _site_medians(runner, step, iters + 2, warmup + 1)
    order = sorted(sites, key=lambda s: -base.get(s.name, 0.0))
    timing = dict(rounds=rounds, iters=iters, warmup=warmup)
    first = _first_pass(runner, step, order, usable, base, runtime, timing, verbose)
    confirmed: dict[str, dict[str, Any]] = {}
    if confirm_rounds > 0:
        say(f"confirming: each site's incumbent against the {confirm_top} fastest choices, "
            f"{confirm_rounds} rounds", verbose)
        confirmed = _confirm_pass(runner, step, order, first, incumbents, confirm_top, margin,
                                  {**timing, "rounds": confirm_rounds}, verbose)
    final = _site_medians(runner, step, iters + 2, warmup)
    rec = {"sites": {s: c.to_json() for s, c in runner.plan.items()}, "before_us": base,
           "after_us": final, "timings": {name: [x.row() for x in scored] for name, scored in first.items()},
           "confirm": confirmed, "seconds": round(time.monotonic() - start, 1)}
    if store:
        store_plan(context, runner.dtype, M, rec, cache_dir)
    runner.adopt(context, M, plan_key(context, runner.dtype, M), runner.plan)
    return rec


def _build_candidates(runner: KernelRunner, sites: list[Site], cands: dict[str, list[KernelConfig]],
                      cache_dir: Any, jobs: int | None, verbose: bool | None) -> dict[str, list[KernelConfig]]:
    """Build every site's candidate kernels in parallel and hand them to the runner; returns the
    configurations that built, per site."""
    # sites that share a program, layout and reduction mode (the two norm backwards) share kernels
    key = KernelRunner._kernel_key
    kernels = {key(s.program, s.layout, s.partial, c, s.fp8): (s, c) for s in sites for c in cands[s.name]}
    items = [(s.program, {"weight_layout": s.layout, "config": c, "partial_reductions": s.partial,
                          "cache_dir": cache_dir, **_fp8_compile_options(s.fp8)}) for s, c in kernels.values()]
    say(f"in-sequence tuning of {len(sites)} sites: building {len(items)} candidate kernels", verbose)
    built = dict(zip(kernels, compile_many(items, runner.dtype, jobs=jobs, verbose=verbose, skip_failed=True)))
    usable: dict[str, list[KernelConfig]] = {s.name: [] for s in sites}
    for s in sites:
        for c in cands[s.name]:
            k = built[key(s.program, s.layout, s.partial, c, s.fp8)]
            if k is not None:
                runner.add_kernel(s.program, s.layout, s.partial, c, k, s.fp8)
                usable[s.name].append(c)
    return usable


def _fp8_compile_options(fp8: Fp8Options) -> dict[str, Any]:
    """compile_epilogue's options for an FP8 site (none for a 16-bit one: the runner's dtype)."""
    if fp8 is None:
        return {}
    dtype, scaling, fast = fp8_parts(fp8)
    return {"dtype": dtype, "scaling": scaling, "fast_accum": fast}


def _first_pass(runner: KernelRunner, step: Callable[[], Any], order: list[Site], usable: dict[str, list[KernelConfig]],
                base: dict[str, float], runtime: bool, timing: dict[str, int],
                verbose: bool | None) -> dict[str, list[Scored]]:
    """Coordinate descent over the sites in ``order``: every configuration, then the best one's raster
    order and swizzle choices; each site keeps its fastest choice before the next site is tuned."""
    first: dict[str, list[Scored]] = {}
    for n, s in enumerate(order):
        scored = compare_choices(runner, step, s.name, [Choice(c) for c in usable[s.name]], seed=2 * n, **timing)
        best = best_choice(scored)
        if runtime:
            rt = compare_choices(runner, step, s.name,
                                 [best.choice] + [Choice(best.choice.config, r, w) for r, w in RUNTIME_CHOICES],
                                 seed=2 * n + 1, **timing)
            scored += rt
            best = best_choice(rt)   # the best configuration timed again beside its raster choices
        first[s.name] = scored
        runner.plan[s.name] = best.choice
        say(f"  {s.name}: {_label(best.choice)} site {best.site_us:.0f} us, step {best.step_us / 1000:.2f} ms "
            f"(untuned site {base.get(s.name, float('nan')):.0f} us)", verbose)
    return first


def _confirm_pass(runner: KernelRunner, step: Callable[[], Any], order: list[Site], first: dict[str, list[Scored]],
                  incumbents: dict[str, Choice], top: int, margin: float, timing: dict[str, int],
                  verbose: bool | None) -> dict[str, dict[str, Any]]:
    """Each site's incumbent against the first pass's ``top`` fastest choices, timed afresh; the
    runner's plan gets the verdict (``confirm``)."""
    confirmed: dict[str, dict[str, Any]] = {}
    for n, s in enumerate(order):
        scored = compare_choices(runner, step, s.name, finalists(first[s.name], incumbents[s.name], top),
                                 seed=1000 + n, **timing)
        chosen, verdict = confirm(scored, margin)
        runner.plan[s.name] = chosen.choice
        confirmed[s.name] = {"incumbent": scored[0].row(), "finalists": [x.row() for x in scored[1:]],
                             "verdict": verdict}
        say(f"  {s.name}: {_label(chosen.choice)} {verdict}", verbose)
    return confirmed


def tune_module(module: Any, runner: Any, forward: Callable[[], torch.Tensor], grad: torch.Tensor | None, *,
                context: str, M: int, forward_only: bool = False, **options: Any) -> dict[str, Any]:
    """In-sequence tuning of a module's training step: ``forward()``, then its backward from
    ``grad`` (None: a scalar loss), with the parameters' gradients cleared around every step (the
    gradients of the tuning steps are dropped, and the ones accumulated before tuning are given
    back afterwards, also when tuning fails). With ``forward_only``, the step is ``forward()``
    without autograd (inference, evaluation) and only its own sites (``*.infer``, nn/kernels.py) are
    tuned; the training step's choices stay."""
    if not isinstance(runner, KernelRunner):
        raise DeviceError("in-sequence tuning times compiled kernels: it needs the module on a Hopper GPU (sm_90) "
                          "in bf16 or fp16")

    def one() -> None:
        module.zero_grad(set_to_none=True)
        if forward_only:
            with torch.no_grad():
                forward()
        else:
            forward().backward(grad)

    if forward_only:
        options["only"] = forward_only_site
    accumulated = [(p, p.grad) for p in module.parameters()]
    try:
        return tune_in_sequence(runner, one, context=context, M=M, **options)
    finally:
        for p, g in accumulated:
            p.grad = g
