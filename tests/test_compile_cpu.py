"""torch.compile through the kernels' custom ops, on the CPU (issue 23, item 8): kernels are built
by the fake nvcc, their registered op implementation also serves the CPU, and ``Kernel.run`` is the
reference interpreter laid out as the GPU kernel lays out its outputs (partials in a buffer padded
to the tile, returned as its view). Map kernels are stand-ins opaque to Dynamo here (their own
custom ops: tests/test_map_op.py). What a GPU adds (the real kernels) is in
tests/gpu/test_nn_modules_gpu.py."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import coda_cutlass as cc
from coda_cutlass import epilogues as E
from coda_cutlass.maps import map_reference
from coda_cutlass.nn import KernelRunner, LlamaModel
from coda_cutlass.nn import block as block_module
from coda_cutlass.nn import runner as runner_module
from coda_cutlass.runtime.kernel import Kernel


def reference_run(self: Kernel, A, W, operands, *, raster=None, swizzle=None, out=None):
    """Kernel.run on CPU tensors: the interpreter's results, partials written into the padded
    buffer the GPU kernel writes and finished (or viewed) by the kernel's own code."""
    res = self.reference(A, W, **operands)
    M, N = A.shape[0], (W.shape[0] if self.weight_layout == "nk" else W.shape[1])
    for name, (layout, _) in self._finish_plan.items():
        if self.partial_reductions:
            buf = torch.full(layout.buffer_shape(M, N, self.config.tile), float("nan"))
            buf[:, :res[name].shape[1]] = res[name]
            res[name] = self._finish(name, buf, M, N)
    for name, t in (out or {}).items():
        t.copy_(res[name])
        res[name] = t
    return res


class OpaqueMap:
    """A map kernel as Dynamo sees one (a ctypes call: a graph break), running the reference."""

    def __init__(self, program: Any, dtype: torch.dtype, partial_reductions: bool = False, **_: Any):
        self.program, self.dtype, self.partial = program, dtype, partial_reductions

    @torch._dynamo.disable
    def __call__(self, X, out=None, **ops):
        res = map_reference(self.program, X, dtype=self.dtype, partial_reductions=self.partial, **ops)
        for name, t in (out or {}).items():
            t.copy_(res[name].reshape(t.shape))
            res[name] = t
        return res


@pytest.fixture
def cpu_ops(ops_on_cpu, monkeypatch):
    monkeypatch.setattr(Kernel, "run", reference_run)


def test_inductor_takes_the_padded_partials_of_a_kernel(cpu_ops):
    """64 rows: the row partials are a (2, 64) view of a (2, 128) buffer. Inductor refused the op's
    output ('expected size 2==2, stride 128==64 at dim=0'): the fake said 64."""
    k = cc.compile_epilogue(E.residual_norm_stats, torch.bfloat16, partial_reductions=True)
    g = torch.Generator().manual_seed(0)
    A, W = torch.randn(64, 256, generator=g).bfloat16(), torch.randn(256, 256, generator=g).bfloat16()
    ops = {"resid": torch.randn(64, 256, generator=g).bfloat16(), "g": torch.randn(256, generator=g).bfloat16()}

    def f(A, W, resid, g):
        out = k(A, W, resid=resid, g=g)
        return out["D"] * 2, out["sumsq"], out["sumsq"].sum(0)
    got = torch.compile(f, fullgraph=True)(A, W, **ops)
    want = f(A, W, **ops)
    assert got[1].stride() == want[1].stride() == (128, 1)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_torch_compile_of_the_model_with_a_backward(cpu_ops, monkeypatch):
    """The whole model through Dynamo and AOT autograd (the blocks' autograd.Function traced with
    the kernels' ops inside); loss and gradients as in eager."""
    monkeypatch.setattr(runner_module, "compile_map", OpaqueMap)
    monkeypatch.setattr(block_module, "check_kernel_runner", lambda *args: None)            # CPU weights
    monkeypatch.setattr(KernelRunner, "prepare", lambda self, *a, **k: None)                # no GPU plans
    torch.manual_seed(0)
    V = 64
    model = LlamaModel(V, 128, 1, 4, 2, 128, dtype=torch.bfloat16)
    model.set_runner(KernelRunner(torch.bfloat16))
    tokens, targets = torch.randint(0, V, (1, 64)), torch.randint(0, V, (1, 64))
    loss = model(tokens, targets)
    loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)
    compiled = torch.compile(model, backend=backend)
    got = compiled(tokens, targets)
    got.backward()
    ops = {m.group(1) for gm in graphs for n in gm.graph.nodes
           if (m := re.search(r"coda_cutlass\.(\w+?)_[0-9a-f]{24}", str(n.target)))}
    assert {"rope", "residual_norm_stats", "swiglu"} <= ops and any(o.startswith("lm_head") for o in ops), ops
    torch.testing.assert_close(got, loss, rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager[n], rtol=1e-2, atol=1e-3, msg=n)
