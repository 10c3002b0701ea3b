"""Starting the backward every way users do, each in a fresh process (issue: the README's own
``y.backward(dy)`` killed the CUDA context).

Autograd runs the backward on its own device thread. c10::cuda::SetDevice() skips cudaSetDevice()
when the thread's device index already matches, so when the first CUDA work of that thread is one
of our kernels (``y.backward(dy)``: no torch op runs before down.dgrad) no CUDA context was
current and CUTLASS's TMA descriptor encode failed (CUDA_ERROR_INVALID_CONTEXT) silently under
-DNDEBUG: the kernel launched with a garbage descriptor. Each case runs in a new interpreter so
that no earlier torch op has bound a context on the thread; the gradients must equal those of
``(y * g).sum().backward()`` (which always worked): the same kernels in the same order (to 1e-3:
SDPA's backward need not be bitwise deterministic).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import hopper_available

pytestmark = pytest.mark.skipif(not hopper_available(), reason="needs an sm_90 GPU (H100/H200)")
ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, threading, torch
from coda_cutlass.nn import LlamaBlock
how = sys.argv[1]
torch.manual_seed(0)
block = LlamaBlock(256, 4, 2, 512, device="cuda", dtype=torch.bfloat16)
x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)

def run():
    y = block(x)
    if how == "backward_dy":
        y.backward(g)
    elif how == "autograd_grad":
        params = list(block.parameters())
        grads = torch.autograd.grad(y, [x, *params], g)
        for t, gt in zip([x, *params], grads):
            t.grad = gt
    elif how == "sum_backward":
        (y.float() * g.float()).sum().backward()
    elif how == "thread_backward_dy":
        t = threading.Thread(target=lambda: y.backward(g))
        t.start(); t.join()
    else:
        raise SystemExit(f"unknown case {how}")

if how == "fresh_thread":          # forward and backward both on a new Python thread
    how = "backward_dy"
    errors = []
    def body():
        try:
            run()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            errors.append(repr(e))
    t = threading.Thread(target=body); t.start(); t.join()
    if errors:
        raise SystemExit(errors[0])
else:
    run()
torch.cuda.synchronize()
grads = [x.grad] + [p.grad for p in block.parameters()]
print(json.dumps({"finite": all(bool(torch.isfinite(t).all()) for t in grads),
                  "sums": [float(t.double().abs().sum()) for t in grads]}))
"""


def _run(how: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-c", CHILD, how], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, f"{how}: exit {p.returncode}\n{p.stderr[-3000:]}"
    assert "Failed to initialize the TMA descriptor" not in p.stderr, f"{how}: {p.stderr[-2000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def expected() -> dict:
    return _run("sum_backward")


@pytest.mark.parametrize("how", ["backward_dy", "autograd_grad", "thread_backward_dy", "fresh_thread"])
def test_backward_started_any_way_gives_the_same_gradients(how, expected):
    got = _run(how)
    assert got["finite"], f"{how}: non-finite gradients"
    # (y.float() * g.float()).sum() has gradient g exactly (rounded to bf16 once: g already is)
    assert got["sums"] == pytest.approx(expected["sums"], rel=1e-3), \
        f"{how}: gradients differ from (y * g).sum().backward()"


KERNEL_CHILD = r"""
import threading, torch, coda_cutlass as cc
from coda_cutlass import epilogues as E
k = cc.compile_epilogue(E.residual_add, torch.bfloat16, verbose=False)
A = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
W = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16)
R = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
out = {}
def body():                     # the kernel is this thread's first CUDA work
    out["D"] = k(A, W, resid=R)["D"]
t = threading.Thread(target=body); t.start(); t.join()
torch.cuda.synchronize()
ref = (A.float() @ W.float().t() + R.float())
err = (out["D"].float() - ref).abs().max().item()
print("err", err)
assert err < 0.25, err
"""


def test_kernel_as_first_cuda_work_of_a_thread():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-c", KERNEL_CHILD], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Failed to initialize the TMA descriptor" not in p.stderr
