"""Mixed precision in coda_cutlass.nn (CPU, the reference interpreter in bf16): fp32 parameters
under torch.autocast, or with compute_dtype set, compute exactly what bf16 parameters compute, and
the gradients come back in fp32; a GPU that would run the interpreter says so."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from coda_cutlass.nn import KernelRunner, LlamaBlock, LlamaModel, ReferenceRunner
from coda_cutlass.nn import precision

BF16 = torch.bfloat16


def _block() -> LlamaBlock:
    torch.manual_seed(0)
    block = LlamaBlock(64, 4, 2, 96, rope_theta=1e4, dtype=torch.float32)
    with torch.no_grad():
        block.attn_norm.add_(torch.randn(64) * 0.2)
        block.mlp_norm.add_(torch.randn(64) * 0.2)
    return block


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("how", ["autocast", "compute_dtype"])
def test_block_with_fp32_parameters_computes_as_bf16_and_returns_fp32_grads(how):
    block = _block()
    twin = copy.deepcopy(block).to(BF16)
    x = torch.randn(2, 8, 64)
    dy = torch.randn(2, 8, 64)
    if how == "autocast":
        with torch.autocast("cpu", dtype=BF16):
            y = block(x)
    else:
        block.compute_dtype = BF16
        y = block(x)
    y.backward(dy.to(BF16))
    y2 = twin(x.to(BF16))
    y2.backward(dy.to(BF16))
    assert y.dtype == BF16 and torch.equal(y, y2)
    for name, g in _grads(block).items():
        assert g.dtype == torch.float32, name
        assert torch.equal(g, _grads(twin)[name].float()), name
    assert all(isinstance(r, ReferenceRunner) for r in block._runners.values())
    assert [k[1] for k in block._runners] == [BF16]


def test_model_under_autocast_equals_the_bf16_model():
    torch.manual_seed(1)
    model = LlamaModel(32, 64, 2, 4, 2, 96, rope_theta=1e4, dtype=torch.float32)
    twin = copy.deepcopy(model).to(BF16)
    tokens = torch.randint(0, 32, (2, 8))
    targets = torch.randint(0, 32, (2, 8))
    with torch.autocast("cpu", dtype=BF16):
        loss = model(tokens, targets)
    loss.backward()
    loss2 = twin(tokens, targets)
    loss2.backward()
    assert torch.equal(loss, loss2)
    for name, g in _grads(model).items():
        assert g.dtype == torch.float32, name
        if name == "embed":           # rows of repeated tokens sum in fp32 here, in bf16 in the twin
            assert torch.allclose(g, _grads(twin)[name].float(), rtol=1e-2, atol=1e-4)
        else:
            assert torch.equal(g, _grads(twin)[name].float()), name
    with torch.autocast("cpu", dtype=BF16):
        assert torch.equal(model(tokens), twin(tokens))


def test_fp32_without_autocast_stays_exact_fp32():
    block = _block()
    assert block.call_dtype() == torch.float32
    with torch.autocast("cpu", dtype=BF16, enabled=False):
        assert block(torch.randn(1, 4, 64)).dtype == torch.float32
    bf = copy.deepcopy(block).to(BF16)
    with torch.autocast("cpu", dtype=torch.float16):
        assert bf.call_dtype() == BF16                    # bf16 parameters: autocast does not re-cast them


def test_compute_dtype_is_checked():
    with pytest.raises(ValueError, match="compute_dtype must be"):
        LlamaBlock(64, 4, 2, 96, compute_dtype=torch.int8)


def test_a_hopper_gpu_says_when_the_interpreter_runs(monkeypatch):
    monkeypatch.setattr(precision, "hopper", lambda device: device.type == "cuda")
    monkeypatch.setattr(precision, "_WARNED", set())
    cuda = torch.device("cuda", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(precision.runner_for(cuda, BF16), KernelRunner)
    with pytest.warns(UserWarning, match=r"reference interpreter runs instead of the kernels.*torch.float32 compute"):
        assert isinstance(precision.runner_for(cuda, torch.float32), ReferenceRunner)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # once per device and dtype
        precision.runner_for(cuda, torch.float32)
    assert isinstance(precision.runner_for(torch.device("cpu"), torch.float32), ReferenceRunner)
