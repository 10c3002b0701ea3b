"""What the Llama modules accept (issue 23, item 9 and LOW): targets are refused as torch's
cross_entropy refuses them, and the CPU path refuses what the GPU kernels would (dtypes, widths,
hyper-parameters), with messages that name the argument. Runs on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coda_cutlass.nn import LlamaBlock, LlamaModel
from coda_cutlass.nn.rope import Rope

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


@pytest.mark.parametrize("bad", [-1, V, 10**12])
@pytest.mark.parametrize("with_targets", [False, True])
def test_an_out_of_vocabulary_token_is_named(bad, with_targets):
    """torch's embedding said "index out of range in self" (neither the token nor the vocabulary)."""
    model = small_model()
    tokens = torch.randint(0, V, (2, 8))
    tokens[1, 2] = bad
    targets = torch.randint(0, V, (2, 8)) if with_targets else None
    with pytest.raises(IndexError, match=rf"token id {bad} \(at flat position 10\) is out of the vocabulary.*\[0, {V}\)"):
        model(tokens, targets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.int16, torch.uint8])
def test_tokens_that_are_not_int64_or_int32_ids_are_refused(dtype):
    """A float or bool tensor raised torch's embedding error ("Expected tensor for argument #1 'indices'")."""
    model = small_model()
    with pytest.raises(TypeError, match=rf"tokens \(input_ids\) must be integer token ids \(int64 or int32\), got {dtype}"):
        model(torch.ones(2, 8, dtype=dtype))
    assert torch.equal(model(torch.ones(2, 8, dtype=torch.int32)), model(torch.ones(2, 8, dtype=torch.int64)))


@pytest.mark.parametrize("shape", [(16,), (2, 7), (2, 8, 1), (1, 8)])
def test_targets_of_another_shape_are_refused(shape):
    model = small_model()
    with pytest.raises(ValueError, match=r"targets must have the tokens' shape \(2, 8\)"):
        model(torch.randint(0, V, (2, 8)), torch.zeros(shape, dtype=torch.int64))


# ---------------------------------------------------------------- the CPU refuses what the GPU would
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_an_input_of_another_float_dtype_is_cast_as_on_the_gpu(dtype):
    """The block computes in its compute dtype (nn.precision) and casts the input to it, on the CPU
    as on the GPU: a bf16 block given fp32 / fp16 input computes what it computes for bf16 input."""
    torch.manual_seed(0)
    block = LlamaBlock(64, 4, 2, 96, dtype=torch.bfloat16)
    x = torch.randn(1, 8, 64, dtype=dtype)
    y = block(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, block(x.bfloat16()))
    with pytest.raises(ValueError, match="expects \\(batch, seq, 64\\) input, got \\(1, 8\\)"):
        block(torch.randn(1, 8))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_input_is_refused(dtype):
    """It used to be cast to the compute dtype silently."""
    import coda_cutlass as cc
    with pytest.raises(cc.CallError, match=f"x must be a floating-point tensor, got {dtype}"):
        LlamaBlock(64, 4, 2, 96, dtype=torch.float32)(torch.zeros(1, 8, 64, dtype=dtype))


@pytest.mark.parametrize("args,kw,match", [
    ((64, 0, 1, 96), {}, "n_heads must be a positive int, got 0"),
    ((64, 4, 0, 96), {}, "n_kv_heads must be a positive int, got 0"),
    ((64, 4, 3, 96), {}, "n_heads \\(4\\) must be a multiple of n_kv_heads \\(3\\)"),
    ((64, 4, 2, 96), {"head_dim": 15}, "head_dim must be a positive multiple of 8 .*RoPE.*got 15"),
    ((60, 4, 2, 96), {}, "dim must be a positive multiple of 8"),
    ((96, 8, 2, 96), {}, "head_dim must be a positive multiple of 8 .*got 12"),
    ((64, 4, 2, 100), {}, "ffn_dim must be a positive multiple of 8 .*got 100"),
    ((64, 4, 2, 96), {"eps": 0.0}, "eps must be a positive finite number, got 0.0"),
    ((64, 4, 2, 96), {"eps": -1e-5}, "eps must be a positive finite number"),
    ((64, 4, 2, 96), {"eps": float("nan")}, "eps must be a positive finite number, got nan"),
    ((64, 4, 2, 96), {"rope_theta": 0.0}, "rope_theta must be a positive finite number"),
    ((64, 4, 2, 96), {"rope_theta": float("nan")}, "rope_theta must be a positive finite number"),
    ((64, 4, 2, 96), {"rope_theta": float("inf")}, "rope_theta must be a positive finite number"),
    ((64, 4, 2, 96), {"inv_freq": torch.ones(3)}, "RoPE settings are for head_dim 6, the block.s is 16"),
    ((64, 4, 2, 96), {"inv_freq": torch.full((8,), float("nan"))}, "inv_freq must be a tensor of finite frequencies"),
    ((64, 4, 2, 96), {"inv_freq": [1.0] * 8}, "inv_freq must be a tensor of finite frequencies, got list"),
    ((64, 4, 2, 96), {"inv_freq": torch.ones(8), "rope_theta": 1e4}, "pass at most one of rope_theta, inv_freq and rope"),
    ((64, 4, 2, 96), {"rope": Rope.default(16, 1e4), "rope_theta": 1e4}, "at most one of rope_theta, inv_freq and rope"),
])
def test_hyper_parameters_the_kernels_cannot_take_are_refused_when_the_block_is_made(args, kw, match):
    with pytest.raises(ValueError, match=match):
        LlamaBlock(*args, **kw)


@pytest.mark.parametrize("kw,match", [({"vocab_size": 0}, "vocab_size must be a positive int"),
                                      ({"n_layers": -1}, "n_layers must be an int >= 0"),
                                      ({"ce_chunk_bytes": 0}, "ce_chunk_bytes must be a positive int")])
def test_model_sizes_the_kernels_cannot_take_are_refused(kw, match):
    args = {"vocab_size": V, "dim": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96, **kw}
    with pytest.raises(ValueError, match=match):
        LlamaModel(**args)


def test_a_nan_eps_no_longer_gives_nan_silently():
    with pytest.raises(ValueError):
        LlamaModel(V, 64, 1, 4, 2, 96, eps=float("nan"))


def test_a_model_without_blocks_says_so_when_called():
    model = LlamaModel(V, 64, 0, 4, 2, 96)          # as from_hf makes it before adding the blocks
    with pytest.raises(ValueError, match="the model has no blocks"):
        model(torch.randint(0, V, (1, 8)))


def test_a_vocabulary_the_kernels_cannot_take_is_refused_before_any_launch(monkeypatch):
    """A vocabulary not a multiple of 8 is refused by name on the kernels' path (the CPU runs it:
    the distributed tests shard an uneven one through the reference interpreter)."""
    from coda_cutlass.nn import KernelRunner
    from coda_cutlass.nn import block as block_module
    model = LlamaModel(250, 64, 1, 4, 2, 96)
    tokens = torch.randint(0, 250, (1, 8))
    assert model(tokens, tokens).isfinite()                     # the reference interpreter
    launches = []
    runner = KernelRunner(torch.bfloat16)
    monkeypatch.setattr(runner, "gemm", lambda *a, **k: launches.append(a))
    monkeypatch.setattr(block_module, "runner_for", lambda device, dtype: runner)
    fresh = LlamaModel(250, 64, 1, 4, 2, 96)
    with pytest.raises(ValueError, match="vocab_size 250 is not a multiple of 8"):
        fresh(tokens, tokens)
    assert launches == []


# ------------------------------------------------------------ found by a new user's pass (twenty-fourth session)
def test_models_build_under_a_meta_device_context_and_load_with_assign():
    from coda_cutlass.nn import LlamaModel
    with torch.device("meta"):
        m = LlamaModel(64, 32, 1, 2, 1, 64)
    assert m.embed.device.type == "meta" and m.blocks[0].rope_freq.device.type == "meta"
    ref = LlamaModel(64, 32, 1, 2, 1, 64)
    m.load_state_dict(ref.state_dict(), assign=True)
    tokens = torch.randint(0, 64, (1, 8))
    assert m.blocks[0].rope_freq.device.type == "cpu"
    torch.testing.assert_close(m(tokens, tokens), ref(tokens, tokens))


def test_dim_not_divisible_by_heads_says_so():
    from coda_cutlass.nn import LlamaBlock
    with pytest.raises(ValueError, match=r"dim \(32\) is not a multiple of n_heads \(3\)"):
        LlamaBlock(32, 3, 1, 64)


def test_position_ids_of_another_length_are_refused_by_name():
    from coda_cutlass.nn import LlamaModel
    m = LlamaModel(64, 32, 1, 2, 1, 64)
    with pytest.raises(ValueError, match=r"position_ids must be \(batch, seq\)"):
        m(torch.randint(0, 64, (1, 8)), position_ids=torch.arange(5)[None])


def test_float64_parameters_are_refused_by_name():
    from coda_cutlass.nn import LlamaModel
    m = LlamaModel(64, 32, 1, 2, 1, 64, dtype=torch.float64)
    with pytest.raises(ValueError, match="parameters in torch.float64 are not supported"):
        m(torch.randint(0, 64, (1, 8)))
