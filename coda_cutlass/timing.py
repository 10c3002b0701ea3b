"""GPU timing: medians of CUDA-event-timed calls over rotating input sets (so the data is not L2-warm)."""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

import torch


def time_cuda(fn: Callable[[Any], Any], inputs: Sequence[Any], *, warmup: int = 5, reps: int = 30) -> float:
    """Median GPU time of ``fn(inputs[i % len(inputs)])`` in microseconds.

    Calls are queued back to back (one event pair around each, no synchronisation in between), so
    the host prepares a call while the GPU runs the previous one, as in a training step; host time
    shows up only when a call's host work outlasts the GPU work before it."""
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn(inputs[i % len(inputs)])
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends))


def interleaved(fns: dict[str, Callable[[Any], Any]], inputs: Sequence[Any], *, rounds: int = 5,
                warmup: int = 5, reps: int = 20) -> dict[str, float]:
    """Times several functions against each other; returns each one's median in microseconds.

    The calls alternate one by one (A B C A B C ..., the order rotating every pass), all queued back
    to back with an event pair around each and no synchronisation in between. Every function then
    runs in the same clock, power and thermal state: timing each in its own batch lets a batch of
    memory-bound kernels run at higher clocks than a batch of back-to-back GEMMs at the power limit,
    which skews ratios by several percent on an H200."""
    names = list(fns)
    for fn in fns.values():
        for i in range(warmup):
            fn(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {k: [] for k in names}
    for p in range(rounds * reps):
        shift = p % len(names)
        for name in names[shift:] + names[:shift]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name](inputs[p % len(inputs)])
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {k: statistics.median(s.elapsed_time(e) * 1000.0 for s, e in v) for k, v in events.items()}
