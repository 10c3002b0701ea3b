"""Mixed precision on the GPU (skips without an sm_90 GPU): fp32 parameters under autocast (or with
compute_dtype) run the bf16 kernels, not the interpreter, and match a bf16 copy of the model;
fp32 compute on a Hopper GPU warns that the interpreter runs."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from coda_cutlass.nn import KernelRunner, LlamaModel, ReferenceRunner
from coda_cutlass.nn import precision
from conftest import hopper_available

pytestmark = pytest.mark.skipif(not hopper_available(), reason="needs an sm_90 GPU (H100/H200)")
BF16 = torch.bfloat16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("how", ["autocast", "compute_dtype"])
def test_fp32_parameters_run_the_bf16_kernels(how):
    torch.manual_seed(0)
    V = 2048
    model = LlamaModel(V, 1024, 2, 16, 4, 2816, rope_theta=1e4, device="cuda", dtype=torch.float32)
    twin = copy.deepcopy(model).to(BF16)
    tokens = torch.randint(0, V, (2, 256), device="cuda")
    targets = torch.randint(0, V, (2, 256), device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # no interpreter fallback warning
        if how == "autocast":
            with torch.autocast("cuda", dtype=BF16):
                loss = model(tokens, targets)
        else:
            model.compute_dtype = BF16
            loss = model(tokens, targets)
        loss.backward()
    runners = list(model.blocks[0]._runners.values())
    assert len(runners) == 1 and isinstance(runners[0], KernelRunner) and runners[0].dtype == BF16
    loss2 = twin(tokens, targets)
    loss2.backward()
    assert abs(loss.item() - loss2.item()) <= 1e-3 * abs(loss2.item())
    for (name, p), p2 in zip(model.named_parameters(), twin.parameters()):
        assert p.grad.dtype == torch.float32, name
        assert rel(p.grad, p2.grad) < 2e-2, name


def test_fp32_compute_on_a_hopper_gpu_warns(monkeypatch):
    monkeypatch.setattr(precision, "_WARNED", set())
    model = LlamaModel(256, 128, 1, 2, 2, 256, device="cuda", dtype=torch.float32)
    tokens = torch.randint(0, 256, (1, 16), device="cuda")
    with pytest.warns(UserWarning, match="reference interpreter runs instead of the kernels"):
        model(tokens, tokens)
    assert isinstance(model.blocks[0].get_runner(), ReferenceRunner)
