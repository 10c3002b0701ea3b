"""What the Llama modules accept (issue 23, item 9 and LOW): targets are refused as torch's
cross_entropy refuses them, and the CPU path refuses what the GPU kernels would (dtypes, widths,
hyper-parameters), with messages that name the argument. Runs on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coda_cutlass.nn import LlamaBlock, LlamaModel

V = 32


def small_model(**kw) -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(V, 64, 1, 4, 2, 96, dtype=torch.float32, **kw)


@pytest.mark.parametrize("bad", [-1, V, 10**12, -101])
def test_an_out_of_range_target_raises_like_torch_cross_entropy(bad):
    model = small_model()
    tokens = torch.randint(0, V, (2, 8))
    targets = torch.randint(0, V, (2, 8))
    targets[1, 3] = bad
    with pytest.raises(IndexError):           # torch's own behaviour on the CPU
        F.cross_entropy(torch.randn(16, V), targets.reshape(-1))
    with pytest.raises(IndexError, match=rf"target {bad} \(at flat position 11\) is out of bounds.*\[0, {V}\)"):
        model(tokens, targets)


def test_ignored_targets_are_skipped_for_any_ignore_index():
    model = small_model()
    tokens = torch.randint(0, V, (2, 8))
    targets = torch.randint(0, V, (2, 8))
    targets[0, :3] = 7
    logits = model(tokens).reshape(-1, V)
    for ignore in (7, -100):
        t = targets.clone()
        if ignore == -100:
            t[0, :3] = -100
        loss = model(tokens, t, ignore_index=ignore)
        ref = F.cross_entropy(logits, t.reshape(-1), ignore_index=ignore)
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)


def test_int32_targets_give_the_int64_loss():
    model = small_model()
    tokens = torch.randint(0, V, (2, 8))
    targets = torch.randint(0, V, (2, 8))
    assert torch.equal(model(tokens, targets.int()), model(tokens, targets))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.bool])
def test_non_integer_targets_are_refused(dtype):
    model = small_model()
    tokens = torch.randint(0, V, (2, 8))
    with pytest.raises(TypeError, match=f"targets must be integer class indices.*{dtype}"):
        model(tokens, torch.ones(2, 8, dtype=dtype))


@pytest.mark.parametrize("shape", [(16,), (2, 7), (2, 8, 1), (1, 8)])
def test_targets_of_another_shape_are_refused(shape):
    model = small_model()
    with pytest.raises(ValueError, match=r"targets must have the tokens' shape \(2, 8\)"):
        model(torch.randint(0, V, (2, 8)), torch.zeros(shape, dtype=torch.int64))
