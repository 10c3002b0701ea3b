"""The runners' caches (issue 23, item 9): a kernel or typed IR is cached per program object, so a
new program never gets the kernel of an earlier one, whether it has the same name or was
allocated at a freed program's address (a program redefined in a notebook: acc * 5.0 ran as
acc * 4.0). Runs on the CPU: KernelRunner's builds are replaced by stand-ins that remember which
program they were built for."""

from __future__ import annotations

import gc
from typing import Any

import torch

import coda_cutlass as cc
from coda_cutlass.nn import runner as runner_module
from coda_cutlass.nn.runner import KernelRunner, ReferenceRunner


def scale_program(c: float) -> Any:
    """A program named 'scale' computing acc * c (every call: a new object with the same name)."""
    def scale(acc):
        return acc * c
    scale.tag = c       # what the stand-in kernels report
    return cc.epilogue(scale)


class StandIn:
    """A built kernel that returns the constant of the program it was built for."""

    def __init__(self, program: Any):
        self.tag = program.fn.tag       # not the program: it must be free to die

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"tag": self.tag}


def test_the_reference_runner_runs_each_programs_own_math():
    runner = ReferenceRunner(torch.bfloat16)
    A, W = torch.randn(8, 16), torch.randn(24, 16)
    for c in (4.0, 5.0, -2.0):
        out = runner.gemm("s", scale_program(c), A, W)["D"]
        torch.testing.assert_close(out, (A @ W.t()) * c)


def test_the_kernel_runner_never_hands_a_new_program_an_old_kernel(monkeypatch):
    """Programs made and dropped one after another (their addresses are reused by CPython) each
    get a kernel built for them, on the GEMM and on the map path."""
    monkeypatch.setattr(runner_module, "compile_map", lambda program, dtype, **kw: StandIn(program))
    monkeypatch.setattr(runner_module, "compile_epilogue", lambda program, dtype, **kw: StandIn(program))
    runner = KernelRunner(torch.bfloat16)
    X = torch.empty(8, 16)
    for i in range(10):
        c = float(i)
        assert runner.map("m", scale_program(c), X)["tag"] == c
        assert runner.gemm("g", scale_program(c), X, X)["tag"] == c
        gc.collect()


def test_the_kernel_runner_reuses_a_programs_kernel(monkeypatch):
    builds = []
    monkeypatch.setattr(runner_module, "compile_map",
                        lambda program, dtype, **kw: builds.append(program.name) or StandIn(program))
    runner = KernelRunner(torch.bfloat16)
    p = scale_program(3.0)
    for _ in range(3):
        assert runner.map("m", p, torch.empty(8, 16))["tag"] == 3.0
    assert builds == ["scale"]
