"""GPU timing: median of CUDA-event-timed runs over rotating input sets (so the data is not L2-warm)."""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

import torch


def time_cuda(fn: Callable[[Any], Any], inputs: Sequence[Any], *, warmup: int = 5, reps: int = 30) -> float:
    """Median time of ``fn(inputs[i % len(inputs)])`` in microseconds."""
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        x = inputs[i % len(inputs)]
        start.record()
        fn(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


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
