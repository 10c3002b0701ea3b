"""Map kernels under torch.compile: each is a torch.library custom op (runtime/map_op.py), traced
without a graph break. On the CPU: kernels built by the fake nvcc, the op's implementation also
registered for the CPU, and ``CompiledMap.run`` standing in for the launch with the reference
interpreter's values written into the very buffers the call allocates (so the layouts are the
kernel's). A GPU runs the real kernels (tests/gpu/test_nn_modules_gpu.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import coda_cutlass as cc
from coda_cutlass import epilogues as E
from coda_cutlass.maps import map_reference
from coda_cutlass.runtime.map_kernel import CompiledMap
from coda_cutlass.runtime.map_op import op_name, schema

BF = torch.bfloat16


@cc.epilogue
def _mixed(acc, s: cc.Scalar, v: cc.PerCol, t: cc.Tile):
    x = acc * s + v - t
    return {"D": x, "half": cc.half_width(x * 2.0), "mx": cc.row_max(x), "tot": cc.total_sum(x),
            "acc_t": cc.accumulate(x * 0.5)}


PROGRAMS: dict[str, Any] = {"_mixed": _mixed, "quantize_rows_t": E.quantize_rows_t}


def reference_run(self: CompiledMap, X, operands, out=None):
    """CompiledMap.run without a GPU: the call's own checks and allocations (``_prepare``), filled with
    the reference interpreter's values, reductions finished (or returned as partials) by the kernel's code."""
    M, N, _, _, _, results, partials = self._prepare(X, operands, out)
    given = {n: v for n, v in operands.items() if n not in self.inout}
    acc = {n: operands[n].clone() for n in self.inout}
    ref = map_reference(PROGRAMS[self.name], X, dtype=self.dtype, partial_reductions=True, **given, **acc)
    for name, t in results.items():
        if name in self.inout:
            t.copy_(acc[name])
        else:
            t.copy_(ref[name].reshape(t.shape))
    for name, buf in partials:
        buf.copy_(ref[name])
        results[name] = buf if self.partial_reductions else self._finish(name, buf, M, N)
    return {n: results[n] for n in self.outputs}


@pytest.fixture
def cpu_map_ops(ops_on_cpu, monkeypatch):
    monkeypatch.setattr(CompiledMap, "run", reference_run)


def _inputs(M: int, N: int) -> tuple[torch.Tensor, dict[str, Any]]:
    g = torch.Generator().manual_seed(M * 7 + N)
    X = torch.randn(M, N, generator=g).to(BF)
    return X, {"s": 0.5, "v": torch.randn(N, generator=g).to(BF), "t": torch.randn(M, N, generator=g).to(BF),
               "acc_t": torch.randn(M, N, generator=g).to(BF)}


def test_map_op_schema_names_its_arguments_and_mutates_accumulated_outputs(fake_nvcc):
    k = cc.compile_map(_mixed, BF)
    assert schema(k) == ("(Tensor X, float s, Tensor v, Tensor t, Tensor(a0!) acc_t) -> "
                         "(Tensor, Tensor, Tensor, Tensor)")
    assert op_name(k).startswith("map_mixed_") and k._op is getattr(torch.ops.coda_cutlass, op_name(k))
    assert cc.compile_map(_mixed, BF, partial_reductions=True)._op is not k._op     # another kernel, another op


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("M,N", [(64, 256), (300, 520), (0, 64)])
def test_the_fake_gives_the_eager_calls_layouts(fake_nvcc, partial, M, N):
    """What the op says it returns (shape, strides, dtype) is what the eager call allocates, for tile,
    half-width, transposed, block-scale and reduction outputs."""
    for program in (_mixed, E.quantize_rows_t):
        k = cc.compile_map(program, BF, partial_reductions=partial)
        X, ops = _inputs(M, N)
        if program is E.quantize_rows_t:
            ops = {}
        _, _, _, _, _, results, partials = k._prepare(X, ops, None)
        for name, buf in partials:
            results[name] = buf if partial else k._finish(name, buf.nan_to_num(0.0), M, N)
        for name, t in results.items():
            if name in k.inout:
                continue
            shape, stride, dtype = k.output_layout(name, M, N)
            if name in k.scale_outputs:
                t = t.t().as_strided(shape, stride)         # the op returns the run-major buffer
                assert k.scale_view(name, t, M, N).shape == results[name].shape
            assert (tuple(t.shape), t.dtype) == (shape, dtype), (program.name, name)
            if t.numel():
                assert tuple(t.stride()) == stride, (program.name, name)


@pytest.mark.parametrize("partial", [False, True])
def test_compiled_map_call_traces_without_a_graph_break(cpu_map_ops, partial):
    k = cc.compile_map(_mixed, BF, partial_reductions=partial)
    X, ops = _inputs(300, 256)
    eager_ops = {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in ops.items()}
    want = k(X, **eager_ops)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("inductor")(gm, inputs)

    def f(X, v, t, acc_t):
        out = k(X, s=0.5, v=v, t=t, acc_t=acc_t)
        return out["D"] * 2, out["half"], out["mx"], out["tot"], out["acc_t"]
    got = torch.compile(f, backend=backend, fullgraph=True)(X, ops["v"], ops["t"], ops["acc_t"])
    assert any(op_name(k) in str(n.target) for gm in graphs for n in gm.graph.nodes)
    torch.testing.assert_close(got[0], want["D"] * 2)
    for i, name in enumerate(("half", "mx", "tot", "acc_t"), 1):
        torch.testing.assert_close(got[i], want[name], msg=name)
    torch.testing.assert_close(ops["acc_t"], eager_ops["acc_t"])        # accumulated in place, as eagerly


@pytest.mark.parametrize("M", [200, 0])
def test_compiled_block_scales_and_transposed_outputs(cpu_map_ops, M):
    """quantize_rows_t: FP8 codes, their transposed copy (a view of 16-byte rows) and block scales
    (returned as the run-major buffer, viewed after the op) as the eager call gives them; no rows too."""
    k = cc.compile_map(E.quantize_rows_t, BF)
    X = torch.randn(M, 256, generator=torch.Generator().manual_seed(3)).to(BF)
    want = k(X)
    got = torch.compile(lambda X: k(X), backend="aot_eager", fullgraph=True)(X)
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        assert got[name].stride() == want[name].stride() or not want[name].numel(), name
        assert torch.equal(got[name].view(torch.uint8) if got[name].element_size() == 1 else got[name],
                           want[name].view(torch.uint8) if want[name].element_size() == 1 else want[name]), name


def test_a_call_with_out_runs_eagerly_under_compile(cpu_map_ops):
    """out= views are written in place by the eager call (a graph break around it), not traced."""
    k = cc.compile_map(_mixed, BF)
    X, ops = _inputs(64, 128)
    D = torch.empty(64, 128, dtype=BF)

    def f(X, v, t, acc_t):
        return k(X, s=0.5, v=v, t=t, acc_t=acc_t, out={"D": D})["mx"] + 1
    got = torch.compile(f, backend="aot_eager")(X, ops["v"], ops["t"], ops["acc_t"].clone())
    want = k(X, **{**ops, "acc_t": ops["acc_t"].clone()})
    torch.testing.assert_close(D, want["D"])
    torch.testing.assert_close(got, want["mx"] + 1)
