"""The call order of interleaved timing (CPU: the schedule is a pure function)."""

from collections import Counter

import pytest

from coda_cutlass.timing import call_order

NAMES = ["cublas", "identity", "fused", "eager", "compile"]


def _predecessors(seq: list[str]) -> Counter:
    return Counter(zip(seq, seq[1:]))


def test_every_pass_calls_every_function_once():
    for order in ("shuffle", "rotate"):
        seq = call_order(NAMES, 40, order)
        assert len(seq) == 40 * len(NAMES)
        for p in range(40):
            assert sorted(seq[p * 5:(p + 1) * 5]) == sorted(NAMES)


def test_rotation_fixes_each_functions_neighbour():
    # the bias the shuffled order removes: cuBLAS nearly always runs right after the last name
    pred = _predecessors(call_order(NAMES, 100, "rotate"))
    after = {a: n for (a, b), n in pred.items() if b == "cublas"}
    assert after["compile"] >= 0.75 * sum(after.values())


def test_shuffle_spreads_predecessors_evenly():
    pred = _predecessors(call_order(NAMES, 400, "shuffle"))
    for b in NAMES:
        after = [pred[(a, b)] for a in NAMES if a != b]
        total = sum(after)
        assert all(0.15 * total <= n <= 0.35 * total for n in after), (b, after)


def test_shuffle_is_reproducible_and_seeded():
    assert call_order(NAMES, 10, "shuffle", seed=3) == call_order(NAMES, 10, "shuffle", seed=3)
    assert call_order(NAMES, 10, "shuffle", seed=3) != call_order(NAMES, 10, "shuffle", seed=4)


def test_unknown_order_is_rejected():
    with pytest.raises(ValueError, match="order must be one of"):
        call_order(NAMES, 1, "random")
