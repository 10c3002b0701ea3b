"""Where a block step's wall time goes besides its kernels: host time per step, syncs, idle gaps.

    python bench/probes/step_gaps.py --widths 8b --tokens 8192 --variants coda-fp8-tensorwise cublas-fp8

For each variant of bench/block.py's workload (fwd+bwd, as its timing rounds run it):
- GPU ms per step: CUDA events around each step, steps back to back (as bench/block.py);
- host ms per step: the steps queued behind a ~0.3 s sleep kernel, so the host never waits for the
  GPU unless something in the step synchronises (then "syncs" says so: the host time holds the sleep);
- a profiler pass: per step the span from the first kernel's start to the last one's end, the busy
  time (kernels summed), the idle rest, and the largest gaps with the kernels on either side.
A step whose host time is above its GPU time is host-bound: the GPU idles between launches.
With ``--ab-fold`` the FP8 variants are also timed with each way of folding the delayed scales' amaxes
(nn/fp8/delayed.py: compiled as shipped, eager, and a two-step "foreach" fold not in the library),
alternating in one process, after checking each gives the eager fold's histories and scales bit for bit.
Writes step_gaps.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from block import Workload  # noqa: E402
from report import environment, require_hopper  # noqa: E402

SLEEP_CYCLES = 600_000_000      # ~0.3 s at the H200's 1.98 GHz


def gpu_ms(fn: Any, wl: Workload, steps: int) -> float:
    pairs = []
    for _ in range(steps):
        wl.zero_grad()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(True)
        e.record()
        pairs.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def sleep_s() -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(SLEEP_CYCLES)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def host_ms(fn: Any, wl: Workload, steps: int, sleep: float) -> tuple[float, bool]:
    """Host time per step with the GPU kept busy ahead of it (a ``sleep`` s kernel first); True when
    the host waited for the GPU inside the steps (a sync: their host time then holds the sleep)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    for _ in range(steps):
        wl.zero_grad()
        fn(True)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1000 / steps, (t1 - t0) > 0.8 * sleep


def profile_gaps(fn: Any, wl: Workload, steps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile
    for _ in range(4):
        wl.zero_grad()
        fn(True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            wl.zero_grad()
            fn(True)
        torch.cuda.synchronize()
    ev = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda t: t[0])
    if not ev:
        return {}
    busy = sum(e - s for s, e, _ in ev)
    span = ev[-1][1] - ev[0][0]
    gaps = []
    for (s0, e0, n0), (s1, e1, n1) in zip(ev, ev[1:]):
        g = s1 - max(e0, s0)
        if g > 0:
            gaps.append((g, n0[:80], n1[:80]))
    gaps.sort(reverse=True)
    small = sum(g for g, _, _ in gaps if g < 20)
    return {"span_us": span / steps, "busy_us": busy / steps, "idle_us": (span - busy) / steps,
            "idle_under_20us_per_gap": small / steps, "gaps": len(gaps) / steps, "kernels": len(ev) / steps,
            "top_gaps": [{"us": g, "before": a, "after": b} for g, a, b in gaps[:12]]}


def _foreach_on_device() -> Any:
    """A stand-in for delayed.on_device that folds in two steps: every partial's max in one
    ``torch._foreach_max`` launch, then the fold compiled with fixed shapes (0-dim maxes), instead of
    one compiled graph with a reduction per partials shape (the shipped fold). Not in the library:
    measured here first."""
    from coda_cutlass.nn.fp8 import delayed
    fixed = torch.compile(delayed._fold, fullgraph=True, dynamic=False)

    def on_device(fn: Any, t: Any, key: Any, what: str) -> Any:
        def fold(history, amax, slot, fmax, parts, owners):
            return fixed(history, amax, slot, fmax, list(torch._foreach_max([p.float() for p in parts])), owners)
        return fold
    return on_device


def fold_modes() -> dict[str, Any]:
    from coda_cutlass.nn.fp8 import delayed
    return {"compiled": delayed.on_device, "eager": lambda f, *a, **k: f, "foreach": _foreach_on_device()}


def check_fold_modes(device: torch.device) -> dict[str, bool]:
    """Each fold mode's history and scales bit for bit the eager fold's, on partials with a NaN, a
    zero tensor and a tensor reported in several parts."""
    from coda_cutlass.nn.fp8 import RECIPES, delayed
    g = torch.Generator(device=device).manual_seed(0)
    names = {n: torch.float8_e4m3fn if i % 2 else torch.float8_e5m2 for i, n in enumerate("abcde")}
    parts = {"a": [torch.rand(112, 8192, device=device, generator=g) * 40],
             "b": [torch.rand(32, 8192, device=device, generator=g), torch.rand(8, 8192, device=device, generator=g)],
             "c": [torch.zeros(48, 8192, device=device)],
             "d": [torch.rand(3, device=device, generator=g) * 1e-30]}
    parts["e"] = [parts["a"][0].clone()]
    parts["e"][0][5, 7] = float("nan")
    out, modes = {}, fold_modes()
    original = delayed.on_device
    try:
        for m, on in modes.items():
            delayed.on_device = on
            sc = delayed.DelayedScales(RECIPES["tensorwise"], names)
            for step in range(3):
                sc.begin_step(device)
                for n, ps in parts.items():
                    sc.quantize(n, lambda s, ps=ps: ({}, [p * (step + 1) for p in ps]), device)
            sc.begin_step(device)
            out[m] = (sc._history.clone(), sc._amax.clone(), sc._scales.clone())
    finally:
        delayed.on_device = original
    # NaN history entries compare as NaN whatever their bits (a compiled where may pick another NaN)
    bits = lambda t: torch.where(t.isnan(), torch.full_like(t, float("nan")), t).view(torch.int32)  # noqa: E731
    return {m: all(torch.equal(bits(a), bits(b)) for a, b in zip(v, out["eager"])) for m, v in out.items()}


def ab_fold(fn: Any, wl: Workload, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """GPU and host ms per step with each amax fold (fold_modes), alternating in bursts."""
    from coda_cutlass.nn.fp8 import delayed
    original = delayed.on_device
    modes = fold_modes()
    gpu: dict[str, list[float]] = {m: [] for m in modes}
    host: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for r in range(rounds):
            for m in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                delayed.on_device = modes[m]
                gpu_ms(fn, wl, 2)                       # the mode's first steps, untimed
                gpu[m].append(gpu_ms(fn, wl, steps))
                host[m].append(host_ms(fn, wl, 3, 1.0)[0])
    finally:
        delayed.on_device = original
    return {m: {"gpu_ms": statistics.median(gpu[m]), "host_ms": statistics.median(host[m])} for m in modes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", nargs="+", default=["8b"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[8192])
    ap.add_argument("--fp8", nargs="*", default=["tensorwise", "blockwise_g16"])
    ap.add_argument("--variants", nargs="+",
                    default=["coda-fp8-tensorwise", "coda-fp8-blockwise_g16", "cublas-fp8", "coda"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ab-fold", action="store_true", help="also compiled against eager amax fold, alternating")
    ap.add_argument("--out", type=Path, default=Path("bench/results_gaps"))
    args = ap.parse_args()
    require_hopper("bench/probes/step_gaps.py")
    args.out.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"environment": environment(), "results": []}
    if args.ab_fold:
        out["fold_modes_bit_for_bit"] = check_fold_modes(torch.device("cuda"))
        print("fold modes bit for bit the eager fold:", out["fold_modes_bit_for_bit"], flush=True)
    for width in args.widths:
        for M in args.tokens:
            wl = Workload(width, M, torch.device("cuda"), False, args.fp8)
            fns = wl.variants()
            sleep = sleep_s()
            for name in args.variants:
                fn = fns[name]
                for _ in range(3):
                    wl.zero_grad()
                    fn(True)
                torch.cuda.synchronize()
                g = gpu_ms(fn, wl, args.steps)
                h, waited = host_ms(fn, wl, 3, sleep)
                p = profile_gaps(fn, wl, 5)
                rec = {"width": width, "M": M, "variant": name, "gpu_ms": g, "host_ms": h, "host_waited": waited, **p}
                out["results"].append(rec)
                print(f"{width} M={M} {name:26s} gpu {g:7.2f} ms  host {h:6.2f} ms{' (SYNC)' if waited else ''}  "
                      f"span {p.get('span_us', 0) / 1e3:6.2f}  busy {p.get('busy_us', 0) / 1e3:6.2f}  "
                      f"idle {p.get('idle_us', 0) / 1e3:5.2f} ms over {p.get('gaps', 0):.0f} gaps "
                      f"({p.get('kernels', 0):.0f} kernels)", flush=True)
                if args.ab_fold and "fp8" in name:
                    rec["fold_ab"] = ab_fold(fn, wl, rounds=6, steps=10)
                    print("    fold " + "  ".join(f"{m}: gpu {v['gpu_ms']:.3f} ms host {v['host_ms']:.2f} ms"
                                              for m, v in rec["fold_ab"].items()), flush=True)
                for t in p.get("top_gaps", [])[:8]:
                    print(f"    gap {t['us']:7.1f} us  after {t['before'][:60]}  before {t['after'][:60]}")
                (args.out / "step_gaps.json").write_text(json.dumps(out, indent=1))
            del wl
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
