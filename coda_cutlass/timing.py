"""GPU timing: medians of CUDA-event-timed calls over rotating input sets (so the data is not L2-warm)."""

from __future__ import annotations

import random
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


ORDERS = ("shuffle", "rotate")


def call_order(names: Sequence[str], passes: int, order: str = "shuffle", seed: int = 0) -> list[str]:
    """The sequence in which ``interleaved`` calls the functions: ``passes`` passes, each calling every
    name once.

    ``"shuffle"`` (default): a fresh seeded permutation every pass, so every function follows every
    other about equally often. ``"rotate"``: the order shifted by one each pass; the cyclic order is
    then fixed, so a function almost always runs right after the same neighbour, and a neighbour that
    leaves the GPU cooler or its L2 full of dirty lines biases that one function (measured on an
    H200: cuBLAS about 10% faster after a memory-bound neighbour than after a GEMM, see
    docs/RESULTS.md)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    names = list(names)
    rng = random.Random(seed)
    seq: list[str] = []
    for p in range(passes):
        if order == "rotate":
            shift = p % len(names)
            seq += names[shift:] + names[:shift]
        else:
            perm = names[:]
            rng.shuffle(perm)
            seq += perm
    return seq


EventPair = tuple[torch.cuda.Event, torch.cuda.Event]


def timed_call(fn: Callable[..., Any], *args: Any) -> EventPair:
    """Queue ``fn(*args)`` between two CUDA events (no synchronisation)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*args)
    end.record()
    return start, end


def elapsed_us(pair: EventPair) -> float:
    """The time between an event pair in microseconds (both recorded and completed)."""
    start, end = pair
    return start.elapsed_time(end) * 1000.0


def medians_us(events: dict[str, list[EventPair]]) -> dict[str, float]:
    """Synchronise, then the median of each name's event pairs in microseconds."""
    torch.cuda.synchronize()
    return {k: statistics.median(elapsed_us(p) for p in v) for k, v in events.items()}


def in_bursts(names: Sequence[str], call: Callable[[str, int], EventPair | None], *, rounds: int, burst: int,
              seed: int = 0) -> dict[str, list[EventPair]]:
    """``rounds`` rounds, each visiting every name once in a fresh shuffled order and calling
    ``call(name, i)`` for i < burst back to back; keeps the event pairs the calls return."""
    events: dict[str, list[EventPair]] = {k: [] for k in names}
    for name in call_order(names, rounds, "shuffle", seed):
        for i in range(burst):
            pair = call(name, i)
            if pair is not None:
                events[name].append(pair)
    return events


def interleaved(fns: dict[str, Callable[[Any], Any]], inputs: Sequence[Any], *, rounds: int = 5,
                warmup: int = 5, reps: int = 20, order: str = "shuffle",
                before: Callable[[Any], Any] | None = None) -> dict[str, float]:
    """Times several functions against each other; returns each one's median in microseconds.

    The calls alternate one by one (``rounds * reps`` passes, each calling every function once, in the
    order ``call_order`` gives), all queued back to back with an event pair around each and no
    synchronisation in between. Every function then runs in the same clock, power and thermal state:
    timing each in its own batch lets a batch of memory-bound kernels run at higher clocks than a
    batch of back-to-back GEMMs at the power limit, which skews ratios by several percent on an H200.
    ``before``, when given, is queued untimed ahead of every timed call (a fixed predecessor)."""
    names = list(fns)
    for fn in fns.values():
        for i in range(warmup):
            fn(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    events: dict[str, list[EventPair]] = {k: [] for k in names}
    for i, name in enumerate(call_order(names, rounds * reps, order)):
        x = inputs[(i // len(names)) % len(inputs)]
        if before is not None:
            before(x)
        events[name].append(timed_call(fns[name], x))
    return medians_us(events)


def sustained(fns: dict[str, Callable[[Any], Any]], inputs: Sequence[Any], *, burst: int = 40, skip: int = 10,
              rounds: int = 3, seed: int = 0) -> dict[str, float]:
    """Times each function in the state a long run of similar kernels puts the GPU in: bursts of
    ``burst`` back-to-back calls of one function (the first ``skip`` untimed), bursts of the
    functions in a shuffled order each round; returns each one's median in microseconds.

    ``interleaved`` gives every function the same neighbours; here each is its own neighbour, as a
    GEMM is inside a block's sequence of GEMMs at the card's power limit (a kernel that moves more
    bytes or does more math per FLOP then also runs at a lower clock)."""
    def call(name: str, i: int) -> EventPair | None:
        x = inputs[i % len(inputs)]
        if i < skip:
            fns[name](x)
            return None
        return timed_call(fns[name], x)
    return medians_us(in_bursts(list(fns), call, rounds=rounds, burst=burst, seed=seed))
