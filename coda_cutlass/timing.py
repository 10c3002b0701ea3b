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
    """Times several functions in interleaved rounds (so clock and thermal drift hit all alike);
    returns each one's median over rounds, in microseconds."""
    for fn in fns.values():
        time_cuda(fn, inputs, warmup=warmup, reps=1)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(time_cuda(fn, inputs, warmup=1, reps=reps))
    return {k: statistics.median(v) for k, v in samples.items()}
