"""The Llama modules as torch modules (issue 23, item 8), on the CPU: copies, pickles, torch.save and
AveragedModel (EMA) work before and after kernels were built (runners drop their caches: compiled
kernels hold ctypes handles, traced programs are not picklable); the default runner follows the
module's device and dtype; a second backward under retain_graph gives the same gradients, and
after a plain backward the saved tensors are freed as before. GPU halves: tests/gpu/test_nn_modules_gpu.py."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch.optim.swa_utils import AveragedModel

import coda_cutlass as cc
from coda_cutlass import epilogues as E
from coda_cutlass.config import KernelConfig
from coda_cutlass.nn import KernelRunner, LlamaBlock, LlamaModel, ReferenceRunner
from coda_cutlass.nn import block as block_module
from coda_cutlass.nn.plan_store import Choice

V = 32


def small_model(dtype=torch.float32) -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(V, 64, 2, 4, 2, 96, dtype=dtype)


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (2, 8), generator=g), torch.randint(0, V, (2, 8), generator=g)


def used_kernel_runner(fake_nvcc) -> KernelRunner:
    """A KernelRunner as after GPU use: a plan, and built kernels (real Kernel objects, ctypes types
    inside; built by the fake nvcc, so no GPU is needed to hold them)."""
    runner = KernelRunner(torch.bfloat16, plan={"o": Choice(KernelConfig(), "m", 2)})
    runner.kernel(E.residual_norm_stats, "nk", True, KernelConfig())
    runner.kernel(E.rope, "nk", False, KernelConfig())
    with pytest.raises(Exception):
        pickle.dumps(runner._gemms)         # what used to break every copy of a module after GPU use
    return runner


def round_trips(module):
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return {"deepcopy": copy.deepcopy(module), "pickle": pickle.loads(pickle.dumps(module)),
            "torch.save": torch.load(buf, weights_only=False)}


def test_a_block_with_a_used_kernel_runner_copies_pickles_and_saves(fake_nvcc):
    block = LlamaBlock(64, 4, 2, 96, dtype=torch.bfloat16)
    block.runner = used_kernel_runner(fake_nvcc)
    for how, copied in round_trips(block).items():
        r = copied.runner
        assert isinstance(r, KernelRunner) and r is not block.runner, how
        assert r.plan == block.runner.plan and r._gemms == {} and r.dtype == torch.bfloat16, how
        for a, b in zip(copied.parameters(), block.parameters()):
            assert torch.equal(a, b), how
    assert len(block.runner._gemms) == 2          # the original keeps its kernels


def test_a_model_after_kernel_use_copies_pickles_saves_and_averages(fake_nvcc, monkeypatch):
    """The default runner (here a used KernelRunner, as on a GPU) is a cache: copies make their own
    (the reference interpreter on this CPU) and compute what the original computes."""
    tokens, targets = batch()
    expected = small_model()(tokens, targets)
    model = small_model()                     # the same weights
    used = used_kernel_runner(fake_nvcc)
    real_default = block_module.runner_for
    monkeypatch.setattr(block_module, "runner_for", lambda device, dtype: used)
    assert model.blocks[0].get_runner() is used
    monkeypatch.setattr(block_module, "runner_for", real_default)
    copies = round_trips(model)
    copies["AveragedModel"] = AveragedModel(model)
    for how, copied in copies.items():
        inner = copied.module if how == "AveragedModel" else copied
        assert isinstance(inner.blocks[0].get_runner(), ReferenceRunner), how
        torch.testing.assert_close(copied(tokens, targets), expected, rtol=0, atol=0, msg=how)
    ema = copies["AveragedModel"]
    ema.update_parameters(model)                  # the first update copies the weights p0
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    ema.update_parameters(model)                  # the mean of p0 and p0 / 2
    with torch.no_grad():
        for avg, p in zip(ema.module.parameters(), model.parameters()):
            torch.testing.assert_close(avg, p * 1.5, rtol=1e-6, atol=1e-6)
    assert ema(tokens, targets).isfinite()


def test_the_default_runner_follows_the_modules_dtype():
    """.half(), .bfloat16() and .float() after use: the runner is the one for the new dtype (was:
    the first one forever, so a CPU block moved to a GPU kept the interpreter and .half() failed)."""
    block = LlamaBlock(64, 4, 2, 96, dtype=torch.float32)
    x = torch.randn(1, 8, 64)
    y32 = block(x)
    assert block.get_runner().dtype == torch.bfloat16 and block.get_runner().precision is None
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        block.to(dtype)
        runner = block.get_runner()
        assert isinstance(runner, ReferenceRunner)
        assert runner.dtype == (dtype if dtype != torch.float32 else torch.bfloat16)
        y = block(x.to(dtype))
        assert y.dtype == dtype
        torch.testing.assert_close(y.float(), y32, rtol=0.05, atol=0.05)
    assert block.get_runner() is block.get_runner()      # made once per device and dtype


def test_a_kernel_runner_set_on_a_moved_module_is_a_clear_error(fake_nvcc):
    block = LlamaBlock(64, 4, 2, 96, dtype=torch.bfloat16)
    block.runner = KernelRunner(torch.bfloat16)
    with pytest.raises(cc.DeviceError, match="KernelRunner.*weights are on cpu"):
        block(torch.randn(1, 8, 64, dtype=torch.bfloat16))


def test_a_second_backward_under_retain_graph_gives_the_same_gradients():
    torch.manual_seed(0)
    block = LlamaBlock(64, 4, 2, 96, dtype=torch.float32)
    x = torch.randn(2, 8, 64, requires_grad=True)
    dy = torch.randn(2, 8, 64)
    y = block(x)
    y.backward(dy, retain_graph=True)
    first = {n: p.grad.clone() for n, p in block.named_parameters()} | {"x": x.grad.clone()}
    y.backward(dy)
    second = {n: p.grad for n, p in block.named_parameters()} | {"x": x.grad}
    for name in first:
        torch.testing.assert_close(second[name], 2 * first[name], rtol=1e-6, atol=1e-7, msg=name)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward(dy)      # autograd's own error once the graph was freed


def test_a_model_backs_up_twice_under_retain_graph():
    """With the LM head's backward recomputing the logits (the fused one hands its gradients out
    once, and says so on a second backward: test_nn.py)."""
    model = small_model()
    model.fused_lm_head = False
    tokens, targets = batch()
    loss = model(tokens, targets)
    loss.backward(retain_graph=True)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * first[n], rtol=1e-6, atol=1e-7, msg=n)


def test_a_plain_backward_still_frees_what_the_block_saved():
    block = LlamaBlock(64, 4, 2, 96, dtype=torch.float32)
    x = torch.randn(2, 8, 64, requires_grad=True)
    y = block(x)
    node = y.grad_fn.next_functions[0][0]       # under the (B, S, D) view
    assert type(node).__name__ == "BlockFunctionBackward"
    assert len(node.saved_tensors) > 10          # the activations go through save_for_backward
    y.sum().backward()
    with pytest.raises(RuntimeError, match="freed"):
        node.saved_tensors


def test_saved_tensor_hooks_see_the_blocks_activations():
    """save_on_cpu-style hooks apply to what the block saves (it used to keep them on the ctx)."""
    block = LlamaBlock(64, 4, 2, 96, dtype=torch.float32)
    x = torch.randn(2, 8, 64, requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):
        y = block(x)
    y.sum().backward()
    assert (16, block.dims.qkv_width) in packed and (16, 2 * block.dims.ffn_dim) in packed


def test_constant_tensors_of_new_shapes_do_not_pile_up(monkeypatch):
    """Each new (batch, seq) made position and ones vectors that were never freed; now the least
    recently used go once the cache holds CACHE_LIMIT of them, and the block stays right."""
    from coda_cutlass import partials
    monkeypatch.setattr(partials, "CACHE_LIMIT", 4)
    monkeypatch.setattr(partials, "_CACHED", partials.OrderedDict())
    block = LlamaBlock(64, 4, 2, 96, dtype=torch.float32)
    for seq in range(1, 12):
        x = torch.randn(1, seq, 64)
        y = block(x)
        assert len(partials._CACHED) <= 4
    torch.testing.assert_close(block(x), y, rtol=0, atol=0)
    pos = block_module.positions(3, 5, torch.device("cpu"))
    assert block_module.positions(3, 5, torch.device("cpu")) is pos        # still made once while in use
    assert torch.equal(pos, torch.arange(5.0).repeat(3))
    for n in range(1000):
        partials.const_vector(n, 1.0, torch.device("cpu"))
    assert len(partials._CACHED) == 4


@pytest.mark.parametrize("options", [{"qkv_bias": True}, {"qk_norm": True, "sandwich_norms": True}])
def test_reset_parameters_resets_the_optional_parameters_too(options):
    """reset_parameters puts every parameter back to its value at construction: the q/k/v bias, the
    per-head q/k norms and the sandwich norms kept their trained values."""
    block = LlamaBlock(64, 4, 2, 128, **options)
    fresh = {n: p.detach().clone() for n, p in block.named_parameters()}
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.5)
    block.reset_parameters()
    for n, p in block.named_parameters():
        if n in ("qkv", "o", "gate_up", "down"):      # drawn anew
            assert not torch.equal(p, fresh[n] + 0.5), n
        else:
            assert torch.equal(p, fresh[n]), n
