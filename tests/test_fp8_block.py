"""FP8 training of the Llama block and model on the CPU (recipe "blockwise"), through the reference
interpreter: every GEMM reads FP8 operands as the kernels would (dequantised per 1 x 128 / 128 x 128
block, fp32 products), every operand quantised where the design says (docs/FP8.md).

What these tests establish: the FP8 path runs end to end, forward and every gradient agree with the
bf16 block to within FP8's precision (a wrong scale, a transposed operand or a missing gradient is
off by far more), the weights' FP8 copies follow the parameters, the gradients' FP8 copies travel
from block to block, and what the path does not cover is refused by name."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from coda_cutlass.errors import ArgumentError, CallError, ConfigError
from coda_cutlass.nn import LlamaBlock, LlamaModel
from coda_cutlass.nn.fp8.recipe import RECIPES, Fp8Recipe, as_recipe
from coda_cutlass.nn.fp8.weights import Fp8Weights
from fp8_helpers import blocks_step, check_scale_stats, losses

BF16 = torch.bfloat16


def _block(fp8, seed=0):
    torch.manual_seed(seed)
    return LlamaBlock(256, 2, 1, 512, head_dim=128, fp8=fp8, dtype=BF16)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("recipe", ["blockwise", "blockwise_g16", "tensorwise"])
def test_fp8_block_forward_and_every_gradient_track_the_bf16_block(recipe):
    ref = _block(None)
    blk = _block(recipe)
    blk.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 128, 256, generator=g).to(BF16)
    dy = torch.randn(2, 128, 256, generator=g).to(BF16)
    outs = {}
    for name, b in (("bf16", ref), ("fp8", blk)):
        for _ in range(2):                  # tensorwise: the second step runs on delayed scales
            b.zero_grad()
            xi = x.clone().requires_grad_()
            y = b(xi)
            y.backward(dy)
        outs[name] = (y.detach(), xi.grad, {n: p.grad for n, p in b.named_parameters()})
    (y0, dx0, g0), (y1, dx1, g1) = outs["bf16"], outs["fp8"]
    # e4m3 keeps 3 mantissa bits (a rounding error of up to 2^-4 relative per operand): measured here
    # the block's branch is 7% off the bf16 block, the input gradient 5% and the weight gradients
    # 7-10%; a wrong scale, a transposed operand or a lost gradient term would be off by 50-150%
    branch = _rel(y1 - x, y0 - x)
    assert branch < 0.12, branch
    assert _rel(dx1, dx0) < 0.1, _rel(dx1, dx0)
    for n in g0:
        assert g1[n] is not None and g1[n].dtype == g0[n].dtype, n
        err = _rel(g1[n], g0[n])
        assert err < 0.16, f"{n}: relative error {err:.3f}"
    # the FP8 path differs from bf16 (it is not silently the bf16 path)
    assert not torch.equal(y1, y0) and not torch.equal(g1["qkv"], g0["qkv"])


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_fp8_model_trains_like_the_bf16_model(recipe):
    curves = {}
    for fp8 in (None, recipe):
        torch.manual_seed(3)
        m = LlamaModel(512, 256, 2, 2, 1, 512, head_dim=128, fp8=fp8, dtype=torch.float32, compute_dtype=BF16)
        opt = torch.optim.SGD(m.parameters(), lr=0.2)
        tok = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(4))
        curves[fp8] = losses(m, tok, opt, 3)
    bf, f8 = curves[None], curves[recipe]
    assert f8[-1] < f8[0]                                   # it learns
    assert all(abs(a - b) / a < 0.02 for a, b in zip(bf, f8)), (bf, f8)


def test_weight_copies_are_remade_only_when_the_weight_changes():
    w = torch.nn.Parameter(torch.randn(256, 384))
    cache = Fp8Weights(RECIPES["blockwise"])
    a = cache.get(w)
    assert cache.get(w) is a
    assert a.w.shape == (256, 384) and a.scale.shape == (2, 3) and a.wt.shape == (384, 256) and a.scale_t.shape == (3, 2)
    assert torch.equal(a.wt.view(torch.uint8), a.w.t().contiguous().view(torch.uint8))   # W^T: the same codes
    assert torch.equal(a.scale_t, a.scale.t())
    with torch.no_grad():
        w.mul_(2.0)                                        # an optimizer step bumps the version
    b = cache.get(w)
    assert b is not a and torch.equal(b.scale, a.scale * 2)


@pytest.mark.parametrize("recipe", ["blockwise", "blockwise_g16", "tensorwise"])
def test_the_saved_activations_are_their_transposed_copies_only(recipe):
    """The backward reads h, o, h1 and y only through their weight gradients, which take the
    transposed FP8 copies: the row-major codes (read by the forward GEMMs) are not kept."""
    blk = _block(recipe)
    x = torch.randn(2, 128, 256).to(BF16).requires_grad_()
    node = blk(x).grad_fn
    while type(node).__name__ != "Fp8BlockFunctionBackward":     # past the view of the output
        node = node.next_functions[0][0]
    saved = node.saved
    for i in (1, 4, 6, 9):                                        # h, o, h1, y
        assert saved[i].q is None and saved[i].qt.dtype == torch.float8_e4m3fn, i
    assert saved[9].qt.shape == (512, 256) and saved[8].shape == (256, 1024)   # y^T (f x M); z (M x 2f)


@pytest.mark.parametrize("recipe", ["blockwise", "blockwise_g16", "tensorwise"])
def test_every_gemm_of_a_two_block_step_is_fp8_and_gradients_travel_quantised(recipe):
    run = blocks_step(seed=5, fp8=recipe)  # the blocks alone (the LM head stays bf16)
    for site, *_, a_dtype, w_dtype in run.gemms:
        assert a_dtype in (torch.float8_e4m3fn, torch.float8_e5m2), f"{site}: A is {a_dtype}"
        assert w_dtype in (torch.float8_e4m3fn, torch.float8_e5m2), f"{site}: W is {w_dtype}"
    gemms = [g[0] for g in run.gemms]
    for site in ("qkv", "o", "gate_up", "down", "down.dgrad", "down.wgrad", "gate_up.dgrad", "gate_up.wgrad",
                 "o.dgrad", "o.wgrad", "qkv.dgrad", "qkv.wgrad"):
        assert gemms.count(site) >= 1, site
    # the second block's input gradient reached the first block with its FP8 copies: only the last
    # block (whose gradient came from the loss) quantised its incoming gradient itself
    assert run.sites.count("dx2.quant") == (2 if recipe == "tensorwise" else 1)   # tensorwise: calibrated


def test_what_the_fp8_path_does_not_cover_is_refused_by_name():
    with pytest.raises(ConfigError, match="qkv_bias"):
        LlamaBlock(256, 2, 1, 512, head_dim=128, qkv_bias=True, fp8="blockwise")
    with pytest.raises(ConfigError, match="multiple of 128"):
        LlamaBlock(192, 3, 1, 384, head_dim=64, fp8="blockwise")
    with pytest.raises(ConfigError, match="fp8 must be None"):
        LlamaBlock(256, 2, 1, 512, head_dim=128, fp8="tensorwise-ish")
    with pytest.raises(ConfigError, match="scaling 'row'"):
        Fp8Recipe("mine", scaling="row")
    with pytest.raises(ConfigError, match="blockwise scaling quantises activations and gradients to"):
        Fp8Recipe("mine", gradient=torch.float8_e5m2)
    with pytest.raises(ConfigError, match="power-of-two scales"):
        Fp8Recipe("mine", pow2=False)
    with pytest.raises(ConfigError, match="history"):
        Fp8Recipe("mine", scaling="tensor", history=0)
    with pytest.raises(ConfigError, match="margin"):
        Fp8Recipe("mine", scaling="tensor", margin=-1)
    with pytest.raises(ConfigError, match=r"wgrad_group must be one of \(1, 16\), got 8"):
        Fp8Recipe("mine", wgrad_group=8)
    for wrong in (16.0, True):          # 16.0 was accepted (it equals 16)
        with pytest.raises(ConfigError, match=rf"wgrad_group must be one of \(1, 16\), got {wrong!r}"):
            Fp8Recipe("mine", wgrad_group=wrong)
    # a blockwise recipe derived from "tensorwise" by dataclasses.replace carries the history and
    # margin __post_init__ filled in: the refusal says how to drop them (it blamed the user for them)
    with pytest.raises(ConfigError, match=r"dataclasses\.replace(.|\n)*history=None, margin=None"):
        dataclasses.replace(RECIPES["tensorwise"], scaling="block", fast_accum=False)
    assert dataclasses.replace(RECIPES["tensorwise"], scaling="block", fast_accum=False, history=None,
                               margin=None) == dataclasses.replace(RECIPES["blockwise"], name="tensorwise")
    with pytest.raises(ConfigError, match="wgrad_group applies to blockwise scaling"):
        Fp8Recipe("mine", scaling="tensor", wgrad_group=16)
    with pytest.raises(ConfigError, match="compute in bf16"):
        LlamaModel(512, 256, 1, 2, 1, 512, head_dim=128, fp8="tensorwise")(torch.randint(0, 512, (1, 128)))
    b = _block("blockwise")
    with pytest.raises(CallError, match="multiple of 128"):
        b(torch.randn(1, 100, 256).to(BF16))
    assert as_recipe(None) is None and as_recipe("blockwise") is RECIPES["blockwise"]


def test_an_fp8_block_copies_and_pickles():
    b = _block("blockwise")
    x = torch.randn(1, 128, 256).to(BF16)
    y = b(x)
    c = copy.deepcopy(b)
    assert torch.equal(c(x), y)


def test_a_reused_step_keeps_one_stashed_gradient():
    b = _block("blockwise")
    step = b.step(1, 128)
    x = torch.randn(128, 256).to(BF16).requires_grad_()
    from coda_cutlass.nn.fp8.support import first_norm_fp8
    with torch.no_grad():
        h, r = first_norm_fp8(step, x.detach(), b.attn_norm)
    for _ in range(3):
        x2, _, _ = b.run(step, x, h, r, b.mlp_norm.detach(), next_fp8=True)
        x2.float().sum().backward()
    assert len(step.stash) == 1


def test_a_grouped_block_takes_a_blockwise_blocks_operand_by_quantising_it_again():
    """A model mixing recipes: the 128 x 1-scaled transposed copy a "blockwise" block hands on is
    not what a "blockwise_g16" block's weight gradient reads (16 x 128 scales); it quantises again."""
    from coda_cutlass.nn.fp8.functional import Fp8Operand
    from coda_cutlass.nn.fp8.paths import BlockwisePath
    from types import SimpleNamespace
    from fp8_helpers import RecordingRunner
    h = torch.randn(128, 256).to(BF16)
    run = RecordingRunner()
    step = SimpleNamespace(runner=run, fp8=RECIPES["blockwise_g16"], dtype=BF16)
    q = BlockwisePath(None).quantize_input(step, Fp8Operand(h.to(torch.float8_e4m3fn), torch.ones(128, 2),
                                                           h.t().to(torch.float8_e4m3fn), torch.ones(256, 1)))
    assert run.sites == ["h.quant"] and q.group == 16 and q.st.shape == (16, 1)
    assert BlockwisePath(None).quantize_input(step, q) is q


def test_blockwise_blocks_report_their_operands_scales_when_asked():
    for recipe in ("blockwise", "blockwise_g16"):
        b = _block(recipe)
        x = torch.randn(1, 128, 256).to(BF16).requires_grad_()
        b(x).backward(torch.randn(1, 128, 256).to(BF16))
        assert b.fp8_stats() == {}                       # off by default
        b.track_fp8_stats()
        x.grad = None
        b(x).backward(torch.randn(1, 128, 256).to(BF16))
        check_scale_stats(b.fp8_stats(), x.grad)
        b.track_fp8_stats(False)
        assert b.fp8_stats() == {}
    with pytest.raises(ConfigError, match="runs in 16 bits"):
        _block(None).track_fp8_stats()
    with pytest.raises(ConfigError, match="every block of this model runs in 16 bits"):
        LlamaModel(512, 256, 1, 2, 1, 512, head_dim=128, dtype=BF16).track_fp8_stats()
    LlamaModel(512, 256, 1, 2, 1, 512, head_dim=128, dtype=BF16).track_fp8_stats(False)     # off: nothing to refuse
    m = LlamaModel(512, 256, 1, 2, 1, 512, head_dim=128, fp8="blockwise", dtype=BF16)
    m.track_fp8_stats()
    tok = torch.randint(0, 512, (1, 128))
    m(tok, tok).backward()
    assert set(m.fp8_stats()) == {0} and m.fp8_stats()[0]["dz"]["nonfinite_runs"] == 0


def test_the_statistics_switch_takes_true_or_false_only():
    # a truthy "off" turned the statistics on; None turned them off
    m = LlamaModel(512, 256, 1, 2, 1, 512, head_dim=128, fp8="blockwise", dtype=BF16)
    for wrong in ("off", None, 1):
        with pytest.raises(ArgumentError, match=f"on must be True or False, got {wrong!r}"):
            m.track_fp8_stats(wrong)
        with pytest.raises(ArgumentError, match="on must be True or False"):
            m.blocks[0].track_fp8_stats(wrong)
    tok = torch.randint(0, 512, (1, 128))
    m(tok, tok).backward()
    assert m.fp8_stats() == {}                      # still off


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_a_blocks_weight_copies_made_together_are_the_copies_made_one_by_one(monkeypatch, recipe):
    """Fp8Weights.get_all (a block's four weights after an optimizer step: one compiled call on a GPU
    instead of four) makes bit for bit the copies get makes, remakes only the stale ones, and a
    PinnedWeights keeps what its forward used."""
    from coda_cutlass.nn.fp8 import weights as W
    torch.manual_seed(0)
    ws = [torch.randn(384, 256, dtype=torch.bfloat16) / 7, torch.randn(256, 256, dtype=torch.bfloat16),
          torch.randn(512, 256, dtype=torch.bfloat16) * 3]
    pairs = [(ws[0], False), (ws[1], False), (ws[2], recipe == "tensorwise")]
    one = W.Fp8Weights(RECIPES[recipe])
    expected = [one.get(w, halves=h) for w, h in pairs]
    calls = []
    batch = W.tensor_copies_all if recipe == "tensorwise" else W.weight_tiles_all
    name = batch.__name__
    monkeypatch.setattr(W, name, lambda ws_, *a: calls.append(len(ws_)) or batch(ws_, *a))
    together = W.Fp8Weights(RECIPES[recipe])
    got = together.get_all(pairs)
    assert calls == [3]
    for e, g in zip(expected, got):
        for f in ("w", "scale", "wt", "scale_t"):
            a, b = getattr(e, f), getattr(g, f)
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                                      b.view(torch.uint8) if b.element_size() == 1 else b), f
    assert together.get_all(pairs)[1] is got[1] and calls == [3]          # fresh: nothing remade
    with torch.no_grad():
        ws[1].mul_(2)                                                      # one weight changed
    pinned = W.PinnedWeights(together)
    again = pinned.get_all(pairs)
    assert again[0] is got[0] and again[1] is not got[1] and calls == [3]  # one stale weight: one by one
    W.weights_changed()
    assert pinned.get_all(pairs)[0] is again[0]                            # the forward's copies stay
    assert together.get_all(pairs)[0] is not got[0] and calls == [3, 3]
