"""The Llama modules as torch modules on a Hopper GPU (issue 23, items 8 and 9; skips cleanly without
an sm_90 GPU): moving modules between devices and dtypes, copies / pickles / torch.save / EMA after
the kernels ran, torch.compile of the whole model with a backward, retain_graph, out-of-range
targets, and the runner's kernel cache for programs made one after another. The CPU halves are in
tests/test_nn_modules.py, test_nn_inputs.py and test_nn_runner.py."""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.optim.swa_utils import AveragedModel

import coda_cutlass as cc
from coda_cutlass import epilogues as E
from coda_cutlass.nn import KernelRunner, LlamaBlock, LlamaModel, ReferenceRunner
from conftest import hopper_available
from llama_reference import standard_block, standard_model_loss, standard_weights

pytestmark = pytest.mark.skipif(not hopper_available(), reason="needs an sm_90 GPU (H100/H200)")
REPO = Path(__file__).resolve().parents[2]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def within_twice_eager(name: str, ours: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor) -> None:
    e_ours, e_eager = max_err(ours, ref), max_err(eager, ref)
    bound = 2 * e_eager + 1e-3 * ref.float().abs().max().item()
    assert e_ours <= bound, f"{name}: max error {e_ours:.3e} > 2 x eager's {e_eager:.3e} (+ floor)"


def small_block(dtype=torch.bfloat16, device="cpu") -> LlamaBlock:
    torch.manual_seed(0)
    block = LlamaBlock(256, 4, 2, 512, rope_theta=10000.0, dtype=dtype, device=device)
    with torch.no_grad():
        for w in (block.qkv, block.o, block.gate_up, block.down):
            w.mul_(0.5)
    return block


def check_block_on_gpu(block: LlamaBlock, where: str) -> None:
    """The block's forward against the standard torch block (fp32 reference, eager in its dtype)."""
    x = torch.randn(2, 128, block.dims.dim, device="cuda", dtype=block.qkv.dtype)
    with torch.no_grad():
        y = block(x)
        w = standard_weights(block)
        ref32 = standard_block(x.float(), {k: v.float() for k, v in w.items()}, block.dims, block.inv_freq)
        eager = standard_block(x, w, block.dims, block.inv_freq)
    within_twice_eager(where, y, eager, ref32)


def test_a_block_used_on_the_cpu_runs_kernels_once_moved_to_the_gpu(monkeypatch):
    """It used to keep the reference interpreter after .cuda(), silently."""
    block = small_block()
    block(torch.randn(1, 8, 256, dtype=torch.bfloat16))
    assert isinstance(block.get_runner(), ReferenceRunner)
    block.cuda()
    runner = block.get_runner()
    assert isinstance(runner, KernelRunner) and runner.dtype == torch.bfloat16
    launched = []
    real = runner.gemm
    monkeypatch.setattr(runner, "gemm", lambda site, *a, **k: launched.append(site) or real(site, *a, **k))
    check_block_on_gpu(block, "after .cuda()")
    assert launched[:4] == ["qkv.infer", "o.infer", "gate_up.infer", "down.last.infer"]


def test_half_after_bf16_use_runs_fp16_kernels():
    """.half() used to raise a CallError from the bf16 kernels."""
    block = small_block(device="cuda")
    check_block_on_gpu(block, "bf16")
    block.half()
    assert block.get_runner().dtype == torch.float16
    check_block_on_gpu(block, "fp16")
    x = torch.randn(1, 128, 256, device="cuda", dtype=torch.float16, requires_grad=True)
    block(x).float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in block.parameters())


def test_copies_pickles_saves_and_ema_after_gpu_use():
    torch.manual_seed(3)
    V = 512
    model = LlamaModel(V, 256, 2, 4, 2, 512, rope_theta=10000.0, device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(0, V, (2, 128), device="cuda")
    targets = torch.randint(0, V, (2, 128), device="cuda")
    loss = model(tokens, targets)
    loss.backward()
    assert isinstance(model.blocks[0].get_runner(), KernelRunner)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copies = {"deepcopy": copy.deepcopy(model), "pickle": pickle.loads(pickle.dumps(model)),
              "torch.save": torch.load(buf, weights_only=False), "AveragedModel": AveragedModel(model)}
    with torch.no_grad():
        expected = model(tokens, targets)
        for how, m in copies.items():
            torch.testing.assert_close(m(tokens, targets), expected, rtol=1e-3, atol=1e-3, msg=how)
    ema = copies["AveragedModel"]
    ema.update_parameters(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    ema.update_parameters(model)
    for avg, p in zip(ema.module.parameters(), model.parameters()):
        torch.testing.assert_close(avg.float(), 1.5 * p.float(), rtol=1e-2, atol=1e-3)
    copies["deepcopy"](tokens, targets).backward()       # a copy trains too
    assert all(torch.isfinite(p.grad).all() for p in copies["deepcopy"].parameters())


@pytest.mark.parametrize("dim,batch,seq", [(256, 1, 64), (1024, 2, 160)])
def test_torch_compile_of_the_model_with_a_backward(dim, batch, seq):
    """Inductor checked the op's real partials against the fake's strides and refused them
    ('expected size 2==2, stride 128==64'): the row partials of fewer tokens than a tile (or not a
    multiple of it: 320 -> 384) are a view of a padded buffer (tests/test_compile_cpu.py has the
    same on the CPU)."""
    torch.manual_seed(4)
    V = 512
    model = LlamaModel(V, dim, 2, 4, 2, 2 * dim, rope_theta=10000.0, device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(0, V, (batch, seq), device="cuda")
    targets = torch.randint(0, V, (batch, seq), device="cuda")
    eager_loss = model(tokens, targets)
    eager_loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model)
    for _ in range(2):                                   # the second call runs the compiled code as is
        model.zero_grad(set_to_none=True)
        loss = compiled(tokens, targets)
        loss.backward()
    fp32 = LlamaModel(V, dim, 2, 4, 2, 2 * dim, rope_theta=10000.0, device="cuda", dtype=torch.float32)
    fp32.load_state_dict(model.state_dict())
    ref, leaves = standard_model_loss(fp32, tokens, targets)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 2 * abs(eager_loss.item() - ref.item()) + 1e-2
    for name in ("embed", "norm", "lm_head"):
        within_twice_eager(name, getattr(model, name).grad, eager[name], leaves[name].grad)


def test_partials_under_torch_compile_match_the_eager_call():
    """A partial-reductions kernel inside a compiled function, M below one tile (the padded case):
    the same values and strides as the eager call."""
    k = cc.compile_epilogue(E.residual_norm_stats, torch.bfloat16, partial_reductions=True)
    A = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    ops = {"resid": torch.randn(64, 256, device="cuda", dtype=torch.bfloat16),
           "g": torch.randn(256, device="cuda", dtype=torch.bfloat16)}

    def f(A, W, resid, g):
        out = k(A, W, resid=resid, g=g)
        return out["sumsq"], out["sumsq"].sum(0) * 2
    got = torch.compile(f, fullgraph=True)(A, W, **ops)
    want = f(A, W, **ops)
    assert got[0].stride() == want[0].stride() and torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


def test_a_map_kernel_under_torch_compile_is_its_custom_op():
    """quantize_rows_t (FP8 codes, the transposed copy, block scales) traced whole (fullgraph): the
    op's outputs are the eager call's, bit for bit, with its strides; M not a multiple of 16."""
    k = cc.compile_map(E.quantize_rows_t, torch.bfloat16)
    X = torch.randn(200, 512, device="cuda", dtype=torch.bfloat16)
    want = k(X)
    got = torch.compile(lambda X: k(X), fullgraph=True)(X)
    for name in want:
        assert got[name].shape == want[name].shape and got[name].stride() == want[name].stride(), name
        a, b = got[name], want[name]
        if a.element_size() == 1:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), name


def test_a_second_backward_under_retain_graph_on_the_gpu():
    block = small_block(device="cuda")
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    y = block(x)
    y.backward(dy, retain_graph=True)
    first = {n: p.grad.clone() for n, p in block.named_parameters()}
    y.backward(dy)
    for n, p in block.named_parameters():
        torch.testing.assert_close(p.grad.float(), 2 * first[n].float(), rtol=2e-2, atol=1e-2, msg=n)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward(dy)


def test_an_out_of_range_target_is_a_device_side_assert():
    """As torch's cross_entropy on a GPU (in a child process: a device-side assert ends its CUDA context)."""
    code = textwrap.dedent("""
        import torch
        from coda_cutlass.nn import LlamaModel
        model = LlamaModel(512, 256, 1, 4, 2, 512, device="cuda", dtype=torch.bfloat16)
        tokens = torch.randint(0, 512, (1, 128), device="cuda")
        targets = torch.randint(0, 512, (1, 128), device="cuda")
        targets[0, 5] = 512
        loss = model(tokens, targets)
        torch.cuda.synchronize()
        print("NO ERROR", loss.item())
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode != 0 and "NO ERROR" not in r.stdout
    assert "device-side assert" in r.stderr or "out of bounds" in r.stderr, r.stderr[-2000:]


def test_the_runner_builds_a_new_programs_own_map_kernel():
    """The issue's case: programs redefined one after another (acc * 4.0, then acc * 5.0, ...) each
    run their own math, not a kernel cached for an earlier program's address."""
    runner = KernelRunner(torch.bfloat16)
    X = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    for c in (4.0, 5.0, 6.0):
        program = cc.epilogue(_scaled_by(c), name="scale")
        out = runner.map("s", program, X)["D"]
        torch.testing.assert_close(out.float(), (X.float() * c).bfloat16().float(), rtol=0, atol=0)
        del program


def _scaled_by(c: float):
    def scale(acc):
        return acc * c
    return scale


def test_a_constant_read_by_a_captured_cuda_graph_is_never_dropped(monkeypatch):
    """The constant-tensor cache drops its least recently used entries, but never one a captured
    CUDA graph reads (the graph holds its address, not a reference)."""
    from coda_cutlass import partials
    monkeypatch.setattr(partials, "CACHE_LIMIT", 4)
    monkeypatch.setattr(partials, "_CACHED", partials.OrderedDict())
    monkeypatch.setattr(partials, "_PINNED", set())
    dev = torch.device("cuda")
    ones = partials.const_vector(1000, 1.0, dev)
    x = torch.randn(1000, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * partials.const_vector(1000, 1.0, dev)
    for n in range(50):
        partials.const_vector(n + 1, 2.0, dev)
    assert partials.const_vector(1000, 1.0, dev) is ones and len(partials._CACHED) <= 5
    x.copy_(torch.randn(1000, device=dev))
    graph.replay()
    torch.testing.assert_close(y, x, rtol=0, atol=0)
