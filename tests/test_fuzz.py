"""Differential fuzzing on the CPU (issue 5): random valid programs trace, validate and render, and
the interpreter agrees with a direct torch evaluation; random invalid programs are refused with an
error that names the problem."""

from __future__ import annotations

import pytest
import torch

import coda_cutlass as cc
from fuzzgen import invalid_program, random_program

N_VALID = 200
N_INVALID = 120
REF_KEYS = ("dtype", "weight_layout", "input_dtypes", "output_dtypes")


@pytest.mark.parametrize("seed", range(N_VALID))
def test_random_program_interpreter_matches_torch(seed):
    g = random_program(seed)
    src = cc.emit(g.program, **g.options)
    assert "Sm90TopologicalVisitor" in src
    M, N, K = 24, 40, 16
    A, W, ops = g.make_inputs(M, N, K, "cpu", seed)
    ops32 = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in ops.items()}
    acc = A.float() @ (W.float().t() if g.options["weight_layout"] == "nk" else W.float())
    want = g.torch_fn(acc, **ops32)
    got = cc.reference(g.program, A.float(), W.float(), precision="fp32",
                       **{k: v for k, v in g.options.items() if k in REF_KEYS}, **ops32)
    assert set(got) == set(want), g.text
    for name in want:
        torch.testing.assert_close(got[name].float(), want[name].float().expand_as(got[name]), rtol=1e-5,
                                   atol=1e-5, equal_nan=True, msg=lambda m: f"{g.text}\n{name}: {m}")


@pytest.mark.parametrize("seed", range(N_INVALID))
def test_random_invalid_program_is_refused(seed):
    desc, thunk, errors, words = invalid_program(seed)
    with pytest.raises(errors) as e:
        thunk()
    assert words in str(e.value), f"{desc}: {e.value}"
    assert f"invalid_{seed}" in str(e.value), f"{desc}: the error does not name the program: {e.value}"
