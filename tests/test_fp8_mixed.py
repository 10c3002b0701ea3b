"""FP8 recipes per block on the CPU: each block of a model runs its own recipe (a model may mix
recipes and bf16 blocks, set per layer or by assigning ``block.fp8``), a recipe changed after
construction runs as a fresh block of that recipe, and what FP8 blocks cannot compute (fp16 around
their GEMMs) is refused with what to do. Tiny widths (the smallest FP8 block: 128 wide, one head)."""

from __future__ import annotations

import copy

import pytest
import torch

from coda_cutlass.errors import ConfigError
from coda_cutlass.nn import LlamaBlock, LlamaModel
from coda_cutlass.nn.fp8 import RECIPES, Fp8Recipe
from fp8_helpers import RecordingRunner

BF16, F16 = torch.bfloat16, torch.float16
E5M2 = torch.float8_e5m2
E5_GRADS = Fp8Recipe("e5m2-grads", scaling="tensor", gradient=E5M2, history=32, margin=1)
BW_E5_WEIGHTS = Fp8Recipe("blockwise-e5m2-weights", weight=E5M2)


def _block(fp8, seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("dtype", BF16)
    return LlamaBlock(128, 1, 1, 128, head_dim=128, fp8=fp8, **kw)


def _model(fp8, seed=0, layers=2, **kw):
    torch.manual_seed(seed)
    kw.setdefault("dtype", BF16)
    return LlamaModel(256, 128, layers, 1, 1, 128, head_dim=128, fp8=fp8, **kw)


def _tokens(seed=1):
    return torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def _step(m, tok):
    m.zero_grad()
    loss = m(tok, tok)
    loss.backward()
    return loss.detach(), _grads(m)


# ---------------------------------------------------------------- fp16 is refused

@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_fp16_compute_around_fp8_gemms_is_refused_with_what_to_do(recipe):
    # the FP8 GEMMs' epilogues write bf16: an fp16 model would get bf16 activations (a block's output
    # in the wrong dtype, the LM head failing on mixed dtypes), so it is refused where it is decided
    match = r"compute in bf16(.|\n)*dtype=torch\.bfloat16(.|\n)*compute_dtype=torch\.bfloat16"
    with pytest.raises(ConfigError, match=match):
        _model(recipe, dtype=F16)
    with pytest.raises(ConfigError, match=match):
        _model(recipe, dtype=torch.float32, compute_dtype=F16)
    with pytest.raises(ConfigError, match=match):
        _block(recipe, dtype=F16)
    # what construction cannot see is refused at the call, before any state moves
    b = _block(recipe).half()
    with pytest.raises(ConfigError, match=match):
        b(torch.randn(1, 128, 128, dtype=F16))
    assert b.fp8_stats() == {}
    m = _model(recipe, dtype=torch.float32)
    tok = _tokens()
    with torch.autocast("cpu", dtype=F16), pytest.raises(ConfigError, match=match):
        m(tok, tok)
    # an fp16 block takes no FP8 recipe afterwards either; fp16 bf16-blocks still run
    b16 = _block(None, dtype=F16)
    with pytest.raises(ConfigError, match=match):
        b16.fp8 = recipe
    assert b16.fp8 is None
    assert b16(torch.randn(1, 128, 128, dtype=F16)).dtype == F16


def test_fp16_parameters_computing_in_bf16_run_in_fp8():
    m = _model("blockwise", dtype=F16, compute_dtype=BF16)
    tok = _tokens()
    loss = m(tok, tok)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad.dtype == F16 for p in m.parameters())


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_fp32_compute_dtype_with_fp8_is_refused_when_made_naming_compute_dtype(recipe):
    # an explicit compute_dtype wins over autocast, so such a block could never run; it was made and
    # refused only at its first call, by a message telling a bf16 model to use dtype=torch.bfloat16
    match = r"compute_dtype=torch\.float32 makes this block compute in fp32(.|\n)*compute_dtype=torch\.bfloat16"
    with pytest.raises(ConfigError, match=match):
        _model(recipe, compute_dtype=torch.float32)
    with pytest.raises(ConfigError, match=match):
        _block(recipe, dtype=torch.float32, compute_dtype=torch.float32)
    m = _model(None, compute_dtype=torch.float32)
    with pytest.raises(ConfigError, match=match):
        m.fp8 = recipe
    assert m.fp8 is None
    _model(recipe, dtype=torch.float32, compute_dtype=BF16)        # fp32 masters computing in bf16 run


# ---------------------------------------------------------------- mixed models

MIXES = [(None, "tensorwise"), ("tensorwise", None), ("tensorwise", "blockwise"), ("blockwise", "tensorwise"),
         (None, E5_GRADS), ("blockwise", E5_GRADS), ("tensorwise", E5_GRADS), (E5_GRADS, "tensorwise"),
         ("blockwise", "blockwise_g16"), ("blockwise_g16", "blockwise"), (None, "blockwise"),
         # blockwise recipes whose weights differ in format hand h over in bf16 (a block's down GEMM ran
         # with the next recipe's weight format: on the GPU, a kernel for e4m3 given e5m2 codes)
         ("blockwise", BW_E5_WEIGHTS), (BW_E5_WEIGHTS, "blockwise_g16")]


def _name(r):
    return getattr(r, "name", r)


def _mixed(mix, how):
    """A model whose blocks run these recipes: given per layer, or blocks of a bf16 model replaced."""
    if how == "per layer":
        return _model(list(mix))
    m = _model(None)
    for i, r in enumerate(mix):
        b = _block(r)
        b.load_state_dict(m.blocks[i].state_dict())
        m.blocks[i] = b
    return m


@pytest.mark.parametrize("how", ["per layer", "replaced"])
@pytest.mark.parametrize("mix", MIXES, ids=lambda m: "-".join(str(_name(r)) for r in m))
def test_each_block_of_a_mixed_model_runs_its_own_recipe(mix, how):
    tok = _tokens()
    bf_loss, bf = _step(_model(None), tok)
    m = _mixed(mix, how)
    assert [b.fp8 for b in m.blocks] == [None if r is None else RECIPES.get(r, r) for r in mix]
    run = RecordingRunner()
    m.set_runner(run)
    loss, g = _step(m, tok)
    # each FP8 block's GEMMs carry its own recipe's formats and scaling (under the first block's
    # recipe, a later block launched none of its own)
    fp8_gemms = [g[4] for g in run.gemms if g[4] is not None]
    # every FP8 GEMM reads operands in the formats it was launched for (on the GPU a kernel for e4m3
    # reads e5m2 codes as garbage; the interpreter dequantises by the tensors' own dtype)
    for site, _p, _l, _part, opts, a_dtype, w_dtype in run.gemms:
        if opts is not None:
            formats = opts[0] if isinstance(opts[0], tuple) else (opts[0], opts[0])
            assert (a_dtype, w_dtype) == formats, (site, opts, a_dtype, w_dtype)
    for r in mix:
        rec = None if r is None else RECIPES.get(r, r)
        if rec is not None and rec.scaling == "tensor":
            assert rec.gemm(("gradient", "weight"), "tensor") in fp8_gemms, rec.name
        elif rec is not None:
            assert rec.gemm(("gradient", "weight"), "block") in fp8_gemms, rec.name
    if any(_name(r) == "blockwise_g16" for r in mix):
        assert any(opts[1] == "block_16x128" for opts in fp8_gemms)
    # within FP8's precision of the bf16 model (measured: 8-14% on the weight gradients, as for one
    # recipe alone; a block run under another block's recipe was 99% off, e5m2 gradients read as e4m3)
    assert abs(float(loss) - float(bf_loss)) < 0.01 * float(bf_loss)
    for n in bf:
        assert torch.isfinite(g[n]).all(), n
        assert _rel(g[n], bf[n]) < 0.2, (n, _rel(g[n], bf[n]))


@pytest.mark.parametrize("first,second", [("blockwise", "blockwise_g16"), ("blockwise_g16", "blockwise")])
def test_grouped_and_plain_blockwise_blocks_mix_exactly(first, second):
    """"blockwise_g16" changes only the weight gradients' activation copies: a model [blockwise,
    blockwise_g16] computes block 0's gradients as an all-blockwise model and block 1's as an
    all-g16 model, bit for bit (each block runs its own recipe; block 0's down-proj epilogue writes
    block 1's operand in block 1's groups), and the other way round."""
    tok = _tokens()
    _, mixed = _step(_mixed((first, second), "replaced"), tok)
    runs = {r: _step(_model(r), tok)[1] for r in (first, second)}
    for n in mixed:
        want = runs[second] if n.startswith("blocks.1.") else runs[first]
        assert torch.equal(mixed[n], want[n]), n
    assert not torch.equal(runs[first]["blocks.1.down"], runs[second]["blocks.1.down"])   # the recipes differ there


def test_per_layer_recipes_are_checked_before_any_block_is_made():
    with pytest.raises(ConfigError, match="one recipe per layer: 2 layers, 3 recipes"):
        _model(["blockwise", None, "tensorwise"])
    with pytest.raises(ConfigError, match="fp8 must be None"):
        _model(["blockwise", "nonsense"])


def test_a_misspelt_recipe_name_is_refused_with_the_name_meant_and_its_layer():
    with pytest.raises(ConfigError, match=r"got 'tensorwize' \(did you mean 'tensorwise'\?\)"):
        _block("tensorwize")
    with pytest.raises(ConfigError, match=r"got 'Blockwise' \(did you mean 'blockwise'\?\)"):
        _model("Blockwise")
    with pytest.raises(ConfigError, match=r"^fp8\[1\] \(layer 1\): .*got 'blockwise-g16' \(did you mean 'blockwise_g16'\?\)"):
        _model(["blockwise", "blockwise-g16"])
    with pytest.raises(ConfigError, match=r"got 'fp8'$"):          # nothing close: no guess
        _block("fp8")


# ---------------------------------------------------------------- changing a block's recipe

def _run_block(b, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 128, 128, generator=g).to(BF16).requires_grad_()
    dy = torch.randn(1, 128, 128, generator=g).to(BF16)
    b.zero_grad()
    y = b(x)
    y.backward(dy)
    return y.detach(), x.grad, _grads(b)


def _same(a, b):
    ya, dxa, ga = a
    yb, dxb, gb = b
    return torch.equal(ya, yb) and torch.equal(dxa, dxb) and all(torch.equal(ga[n], gb[n]) for n in ga)


@pytest.mark.parametrize("start,new", [("tensorwise", "blockwise"), ("blockwise", "tensorwise"),
                                       ("tensorwise", None), (None, "tensorwise"), ("blockwise", "blockwise_g16"),
                                       ("tensorwise", E5_GRADS)], ids=str)
def test_a_recipe_set_after_steps_runs_as_a_fresh_block_of_it(start, new):
    fresh = _run_block(_block(new))
    b = _block(start)
    for s in range(2):
        _run_block(b, seed=s + 5)
    b.fp8 = new.name if isinstance(new, Fp8Recipe) and new.name in RECIPES else new
    assert b.fp8 == (None if new is None else RECIPES.get(new, new))
    assert _same(_run_block(b), fresh)


def test_a_recipe_given_by_name_is_the_recipe_and_a_bad_one_changes_nothing():
    b = _block("tensorwise")
    _run_block(b)
    before = b.fp8_stats()
    b.fp8 = "blockwise"
    assert b.fp8 is RECIPES["blockwise"] and b.context().endswith(":fp8-blockwise")
    b.fp8 = "tensorwise"
    for bad, match in (("nonsense", "fp8 must be None"), (3, "fp8 must be None")):
        with pytest.raises(ConfigError, match=match):
            b.fp8 = bad
        assert b.fp8 is RECIPES["tensorwise"]
    biased = _block(None, qkv_bias=True)
    with pytest.raises(ConfigError, match="qkv_bias"):
        biased.fp8 = "blockwise"
    assert biased.fp8 is None
    # the same recipe again keeps the block's FP8 state (its amax histories)
    b = _block("tensorwise")
    _run_block(b)
    before = b.fp8_stats()
    b.fp8 = RECIPES["tensorwise"]
    assert b.fp8_stats() == before and before


def test_a_blockwise_blocks_statistics_switch_survives_a_recipe_change():
    b = _block("blockwise")
    b.track_fp8_stats()
    b.fp8 = "blockwise_g16"
    assert b.fp8_stats() == {}                  # a new recipe's state: nothing recorded yet
    _run_block(b)
    assert set(b.fp8_stats()) >= {"h", "dz"}
    # a spell in bf16 (e.g. evaluation at token counts FP8 refuses) keeps the switch too
    b.fp8 = None
    b.fp8 = "blockwise"
    _run_block(b)
    assert set(b.fp8_stats()) >= {"h", "dz"}
    b.track_fp8_stats(False)
    b.fp8 = None
    b.fp8 = "blockwise_g16"
    _run_block(b)
    assert b.fp8_stats() == {}
    # switched off during the spell in bf16 (a model's call reaches its bf16 blocks): off when FP8 is back
    b.track_fp8_stats()
    b.fp8 = None
    b.track_fp8_stats(False)
    b.fp8 = "blockwise"
    _run_block(b)
    assert b.fp8_stats() == {}


def test_a_models_recipe_is_set_for_every_block_or_per_layer():
    tok = _tokens()
    m = _model(None)
    assert m.fp8 is None
    m.fp8 = "blockwise"
    assert m.fp8 is RECIPES["blockwise"] and all(b.fp8 is RECIPES["blockwise"] for b in m.blocks)
    _, got = _step(m, tok)
    _, want = _step(_model("blockwise"), tok)
    assert all(torch.equal(got[n], want[n]) for n in want)
    m.fp8 = [None, "tensorwise"]
    assert m.fp8 == (None, RECIPES["tensorwise"])
    with pytest.raises(ConfigError, match="one recipe per layer"):
        m.fp8 = ["blockwise"]
    with pytest.raises(ConfigError, match="fp8 must be None"):
        m.fp8 = ["blockwise", "nonsense"]
    assert m.fp8 == (None, RECIPES["tensorwise"])           # a refused assignment changes no block
    m16 = _model(None, dtype=F16)
    with pytest.raises(ConfigError, match="compute in bf16"):
        m16.fp8 = "blockwise"
    assert m16.fp8 is None


def test_an_old_pickle_with_the_recipe_in_the_instance_dict_loads():
    b = _block("tensorwise")
    _run_block(b)
    state = b.__dict__.copy()
    state["fp8"] = state.pop("_fp8")                          # as blocks pickled before fp8 was a property
    old = LlamaBlock.__new__(LlamaBlock)
    old.__setstate__(state)
    assert old.fp8 is RECIPES["tensorwise"]
    assert _same(_run_block(old, seed=3), _run_block(copy.deepcopy(b), seed=3))


# ---------------------------------------------------------------- each recipe's stored plan

def test_a_block_of_another_recipe_runs_its_own_contexts_plan(monkeypatch):
    """On the GPU one KernelRunner serves the whole model, prepared with the first block's plan
    context; a block of another recipe (its FP8 sites have their own stored plans, context
    ``...:fp8-RECIPE``) ran the first block's plan before: a bf16 plan's choices for FP8 GEMMs, or
    the default configurations. Now it gets a view of the runner with its own context's plan,
    sharing the runner's kernels."""
    import dataclasses

    from coda_cutlass.config import KernelConfig
    from coda_cutlass.nn import runner as runner_mod
    from coda_cutlass.nn.plan_store import Choice
    plans = {"bf16": Choice(KernelConfig(tile_n=64)), "fp8": Choice(KernelConfig(tile_n=256))}

    def fake_find(context, dtype, M, cache_dir=None, device=None):
        kind = "fp8" if ":fp8-" in context else "bf16"
        return f"inseq|{context}|M{M}", {"qkv": plans[kind]}
    monkeypatch.setattr(runner_mod, "find_plan", fake_find)
    m = _model([None, "tensorwise", None], layers=3)
    kr = runner_mod.KernelRunner(BF16)
    first = m.blocks[0]
    step = dataclasses.replace(first.step(1, 128, runner=runner_mod.ReferenceRunner(BF16)), runner=kr)
    kr.prepare(first.context(), 128)
    assert first.local_step(step).runner is kr and kr.plan["qkv"] == plans["bf16"]
    fp8_step = m.blocks[1].local_step(step)
    view = fp8_step.runner
    assert view is not kr and view.plan["qkv"] == plans["fp8"] and view.plan_source.endswith(":fp8-tensorwise|M128")
    assert view._gemms is kr._gemms and view._maps is kr._maps          # kernels built once, for both
    assert kr.plan["qkv"] == plans["bf16"]                               # the model's runner unchanged
    assert m.blocks[2].local_step(fp8_step).runner.plan["qkv"] == plans["bf16"]
    kr.recorder = runner_mod.Recorder()                  # set after the view was made (a benchmark's)
    assert view.recorder is kr.recorder
    import pickle
    assert pickle.loads(pickle.dumps(view)).plan["qkv"] == plans["fp8"]


def test_tuning_a_model_that_mixes_recipes_is_refused_with_what_to_do():
    m = _model([None, "tensorwise"])
    with pytest.raises(ConfigError, match=r"different kinds .*fp8-tensorwise.*Tune a model of each kind"):
        m.tune(_tokens())


# ---------------------------------------------------------------- activation checkpointing in a model

@pytest.mark.parametrize("mix", [["tensorwise", "tensorwise"], ["blockwise", "blockwise_g16"],
                                 [None, "tensorwise", None], ["tensorwise", None, "tensorwise"]],
                         ids=lambda m: "-".join(str(r) for r in m))
def test_checkpointed_fp8_blocks_in_a_model_train_as_unwrapped_ones(mix):
    """checkpoint_blocks / transformers' gradient-checkpointing switch on a model with FP8 blocks
    (refused before: "not implemented yet"): each block keeps its inputs (for an FP8 block its h as
    the FP8 operand) and recomputes its forward in the backward on the scales its first pass used;
    three training steps give the unwrapped model's losses and gradients bit for bit (the delayed
    scales fold as they do unwrapped)."""
    from coda_cutlass.nn.parallel import checkpoint_blocks
    models = [_model(list(mix), layers=len(mix)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    checkpoint_blocks(models[1])
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(3):
        tok = _tokens(10 + step)
        results = []
        for m, opt in zip(models, opts):
            loss, g = _step(m, tok)
            opt.step()
            results.append((loss, g))
        (l0, g0), (l1, g1) = results
        assert torch.equal(l0, l1), step
        for n in g0:
            assert torch.equal(g0[n], g1[n]), (step, n)
