"""FP8 training's state on the CPU: the weights' FP8 copies follow every way parameters change
(fused optimizers, FSDP2's re-gathers, ``.data`` edits with ``weights_changed()``); the delayed
scales survive non-finite and zero amaxes, evaluation forwards, refused calls, copies, pickles and
checkpoints of other lengths or recipes, and are reduced over data-parallel ranks with one
collective a backward (counted here; tests/test_distributed.py runs 2 ranks); autocast, a second
backward and weights edited between forward and backward are handled or refused; recipes and token
counts are checked with messages that say what to do. Tiny widths (the smallest FP8 block: 128
wide, one head of 128)."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import math
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from coda_cutlass.errors import CallError, ConfigError
from coda_cutlass.nn import LlamaBlock, LlamaModel
from coda_cutlass.nn.fp8 import RECIPES, Fp8Recipe, weights_changed
from coda_cutlass.nn.fp8.block_stats import BlockScaleStats
from coda_cutlass.nn.fp8.delayed import DelayedScales, _fold
from coda_cutlass.nn.fp8.weights import Fp8Weights
from coda_cutlass.quantization import quantize_blocks

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parent.parent


def _block(fp8, seed=0, **kw):
    torch.manual_seed(seed)
    return LlamaBlock(128, 1, 1, 128, head_dim=128, fp8=fp8, dtype=BF16, **kw)


def _model(fp8, seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("dtype", BF16)
    return LlamaModel(256, 128, 2, 1, 1, 128, head_dim=128, fp8=fp8, **kw)


def _tokens(seed=1, batch=1):
    return torch.randint(0, 256, (batch, 128), generator=torch.Generator().manual_seed(seed))


def _inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 128, 128, generator=g).to(BF16) for _ in range(n)], \
        torch.randn(1, 128, 128, generator=g).to(BF16)


def _same_copy(a, b):
    return all(torch.equal(getattr(a, f).view(torch.uint8) if getattr(a, f).dtype in (E4M3,) else getattr(a, f),
                           getattr(b, f).view(torch.uint8) if getattr(b, f).dtype in (E4M3,) else getattr(b, f))
               for f in ("w", "scale", "wt", "scale_t"))


# ---------------------------------------------------------------- the weights' FP8 copies

@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_a_fused_optimizer_step_and_weights_changed_remake_the_weight_copies(recipe):
    """Fused AdamW changes a parameter without moving its version counter; every optimizer step
    moves the copies' generation instead. ``.data`` edits show nowhere: weights_changed() says so."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(256, 128))
    cache = Fp8Weights(RECIPES[recipe])
    a = cache.get(w)
    assert cache.get(w) is a
    w.grad = torch.randn_like(w)
    torch.optim.AdamW([w], lr=0.1, fused=True).step()
    b = cache.get(w)
    assert b is not a and _same_copy(b, Fp8Weights(RECIPES[recipe]).get(w))
    # as FSDP2 gathers a parameter again: new values, the version counter kept (the storage may even
    # be the same), after an optimizer step on the shards
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(w):
        w.copy_(torch.randn_like(w))
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1).step()
    b = cache.get(w)
    assert _same_copy(b, Fp8Weights(RECIPES[recipe]).get(w))
    w.data.mul_(2.0)                    # through .data: no version counter moves
    assert cache.get(w) is b
    weights_changed()
    c = cache.get(w)
    assert c is not b and _same_copy(c, Fp8Weights(RECIPES[recipe]).get(w))


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_a_model_trained_by_fused_adamw_computes_with_its_current_weights(recipe):
    m = _model(recipe, dtype=torch.float32, compute_dtype=BF16)
    tok = _tokens()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, fused=True)
    m(tok, tok).backward()
    opt.step()
    with torch.no_grad():               # a copy makes its FP8 weights from scratch (and has the same scales)
        assert torch.equal(m(tok, tok), copy.deepcopy(m)(tok, tok))


_FSDP_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from coda_cutlass.nn import LlamaModel
    from coda_cutlass.nn.fp8 import tensorwise
    from coda_cutlass.nn.parallel import shard_model
    tensorwise.copies_blocks_per_call = int(sys.argv[3])
    dist.init_process_group("gloo", rank=0, world_size=1)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (1, 129), generator=g) for _ in range(6)]
    out = {}
    for sharded in (False, True):
        torch.manual_seed(0)
        m = LlamaModel(256, 128, 2, 1, 1, 128, head_dim=128, fp8=sys.argv[1], dtype=torch.float32,
                       compute_dtype=torch.bfloat16)
        if sharded:
            shard_model(m, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32),
                        activation_checkpointing=sys.argv[2] == "checkpointed")
        opt = torch.optim.AdamW(m.parameters(), lr=3e-2)
        losses = []
        for t in batches:
            loss = m(t[:, :-1], t[:, 1:]); loss.backward(); opt.step(); opt.zero_grad(); losses.append(loss.item())
        out[str(sharded)] = losses
    dist.destroy_process_group()
    print(json.dumps(out))
""")


@pytest.mark.parametrize("how,per_call", [("plain", 1), ("checkpointed", 1), ("plain", 2)])
def test_fsdp2_regathered_weights_are_quantised_again_after_each_optimizer_step(how, per_call):
    """FSDP2 gathers the unsharded parameters again into storage that may sit at the same address,
    keeping their version counters: the sharded model (world size 1) computes what the plain one does,
    also with activation checkpointing of its FP8 blocks (recomputed after FSDP's re-gather), and
    with the model making its blocks' copies together (copies_blocks_per_call = 2: the sharded
    blocks are left to their own forwards; their shards raised a DTensor error there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", _FSDP_SCRIPT, "tensorwise", how, str(per_call)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["True"] == out["False"], out


# ---------------------------------------------------------------- delayed scales: inf, NaN and zero amaxes

def test_one_non_finite_batch_shows_in_its_step_and_training_recovers_at_once():
    xs, dy = _inputs(6)
    bad = xs[2].clone()
    bad[0, 5, 7] = float("inf")
    b = _block("tensorwise")
    finite = []
    for i, x in enumerate(xs):
        y = b(bad if i == 2 else x)
        y.backward(dy)
        finite.append(bool(torch.isfinite(y).all()))
    assert finite == [True, True, False, True, True, True]
    assert all(math.isfinite(v["scale"]) for v in b.fp8_stats().values())


class FakeKernel:
    def __init__(self, amax):
        self.amax, self.scales = amax, []

    def __call__(self, s):
        self.scales.append(float(s))
        return {}, torch.tensor(self.amax)


def test_a_tensor_seen_only_as_zero_or_non_finite_keeps_calibrating():
    """Zero-initialised output projections give exactly zero gradients on the first step: that amax
    makes no scale (scale 1 would flush the next step's small gradients to zero); the tensor
    calibrates from its current amax until it has a finite, positive one."""
    sc = DelayedScales(RECIPES["tensorwise"], {"dz": E4M3})
    k = FakeKernel(0.0)
    launches = []
    for amax in (0.0, float("nan"), 1e-3, 1e-3):
        sc.begin_step(CPU)
        k.amax, k.scales = amax, []
        sc.quantize("dz", k, CPU)
        launches.append(k.scales)
    small = 2.0 ** -18                      # 1e-3 / 448 rounded up to a power of two
    assert launches[0] == [1.0, 1.0] and launches[1][0] == 1.0 and len(launches[1]) == 2
    assert launches[2] == [1.0, small] and launches[3] == [small]


def test_zero_initialised_output_projections_still_train_their_inputs():
    b = _block("tensorwise")
    with torch.no_grad():
        b.o.zero_()
        b.down.zero_()
    xs, dy = _inputs(2)
    b(xs[0]).backward(dy)                   # dz, dx1, ... are exactly 0
    assert b.fp8_stats()["dz"]["calibrated"] is False
    with torch.no_grad():                   # what the optimizer step does: small output projections
        b.o.normal_(0.0, 1e-3)
        b.down.normal_(0.0, 1e-3)
    b.zero_grad()
    b(xs[1]).backward(dy)
    assert b.gate_up.grad.abs().max() > 0 and b.qkv.grad.abs().max() > 0
    assert b.fp8_stats()["dz"]["scale"] < 2.0 ** -10


def test_the_compiled_fold_is_bit_for_bit_the_eager_fold():
    """The fold runs compiled by torch.compile on a GPU: inductor on the CPU builds the same graph
    from the same elementwise ops; amaxes and scales agree bit for bit, the histories too (NaN
    payloads aside), over zero, inf and NaN amaxes and both formats."""
    torch.manual_seed(0)
    n, length = 10, 16
    hist = torch.rand(n, length) * 10
    hist[0] = 0.0
    hist[1, 3], hist[2, :], hist[3, 5] = float("nan"), float("inf"), float("inf")
    amax = torch.tensor([0.0, 3.0, 2.0, 0.0, 1.0, 1.0, 0.0, 0.0, 5.0, 1e-30])
    slot = torch.eye(length, dtype=torch.bool)[4]
    fmax = torch.tensor([448.0] * 5 + [57344.0] * 5)
    parts = [torch.tensor([1.0, float("nan")]), torch.rand(3, 2), torch.tensor(0.0), torch.tensor(float("inf")),
             torch.rand(7)]
    owners = (1, 2, 0, 4, 4)
    want = _fold(hist, amax, slot, fmax, parts, owners)
    try:
        got = torch.compile(_fold, fullgraph=True, dynamic=True)(hist, amax, slot, fmax, parts, owners)
    except Exception as e:  # noqa: BLE001 - no C++ compiler for inductor here
        pytest.skip(f"torch.compile on the CPU failed: {type(e).__name__}: {str(e)[:200]}")
    for g, w in zip(got, want):
        assert torch.equal(g.isnan(), w.isnan())
        assert torch.equal(g.nan_to_num(-1.0).view(torch.int32), w.nan_to_num(-1.0).view(torch.int32))
    assert torch.equal(want[2][:2], torch.tensor([1.0, 2.0 ** -5]))     # "a" calibrates; 9.5 / 448 -> 2^-5


# ---------------------------------------------------------------- forwards that do not train

def test_an_evaluation_forward_does_not_change_training():
    xs, dy = _inputs(5)
    x_eval = torch.randn(1, 128, 128).to(BF16)
    x_eval[0, :, 0] = 40.0                  # an outlier channel: its amax would set 16 steps' scales
    outs = {}
    for evaluate in (False, True):
        b = _block("tensorwise")
        outs[evaluate] = []
        for i, x in enumerate(xs):
            y = b(x)
            y.backward(dy)
            outs[evaluate].append(y)
            if evaluate and i == 2:
                before = b.fp8_stats()
                b.eval()
                with torch.no_grad():
                    assert torch.isfinite(b(x_eval)).all()
                b.train()
                assert b.fp8_stats() == before
    assert all(torch.equal(a, c) for a, c in zip(outs[False], outs[True]))


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("growth", [4.0, 1.3])
def test_torch_checkpoint_around_tensorwise_blocks_recomputes_on_the_first_pass_scales(use_reentrant, growth):
    """torch.utils.checkpoint (both forms) around "tensorwise" blocks gives the unwrapped blocks'
    outputs and gradients bit for bit, step after step, while the inputs grow (every step's scales
    move): the recompute, inside the backward, used to fold the step's amaxes first and so ran on
    other scales than the forward whose output the loss used (weight gradients 5-33% off); the
    reentrant form's first pass, without autograd, ran a fold behind its recompute."""
    from torch.utils.checkpoint import checkpoint
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(1, 128, 128, generator=g).to(BF16) * growth ** k for k in range(4)]
    dy = torch.randn(1, 128, 128, generator=g).to(BF16)
    runs = {}
    for wrapped in (False, True):
        blocks = [_block("tensorwise", seed=s) for s in (0, 1)]
        runs[wrapped] = []
        for x in xs:
            for b in blocks:
                b.zero_grad()
            xi = x.clone().requires_grad_()
            y = xi
            for b in blocks:
                y = checkpoint(b, y, use_reentrant=use_reentrant) if wrapped else b(y)
            y.backward(dy)
            runs[wrapped].append([y.detach(), xi.grad] + [p.grad.clone() for b in blocks for p in b.parameters()])
    for step, (a, b) in enumerate(zip(runs[True], runs[False])):
        assert all(torch.equal(u, v) for u, v in zip(a, b)), step


def test_a_block_that_never_trained_evaluates_without_recording():
    b = _block("tensorwise")
    with torch.no_grad():
        y = b(_inputs(1)[0][0])
    assert torch.isfinite(y).all()
    assert not any(v["calibrated"] for v in b.fp8_stats().values())


# ---------------------------------------------------------------- refused and empty calls

def test_a_refused_call_changes_no_scale_and_an_empty_batch_runs():
    xs, dy = _inputs(2)
    b = _block("tensorwise")
    b(xs[0]).backward(dy)
    before, steps = b.fp8_stats(), b.fp8_path().scales.steps
    odd = torch.randn(1, 100, 128).to(BF16)
    with pytest.raises(CallError, match="multiple of 128"):
        b(odd)
    assert b.fp8_stats() == before and b.fp8_path().scales.steps == steps
    empty = torch.zeros(1, 0, dtype=torch.long)
    losses = {r: float(_model(r)(empty, empty)) for r in ("blockwise", "tensorwise")}
    assert losses["tensorwise"] == losses["blockwise"], losses
    m = _model("tensorwise")
    tok = _tokens()
    m(tok, tok).backward()
    before = m.fp8_stats()
    m(empty, empty).backward()                        # no tokens, no amaxes: a step that records nothing
    assert m.fp8_stats() == before


def test_odd_token_counts_are_refused_with_what_to_do():
    m = _model("blockwise").eval()
    with torch.no_grad(), pytest.raises(CallError, match=r"multiple of 128, got 77(.|\n)*Pad the batch(.|\n)*fp8=None"):
        m(torch.randint(0, 256, (1, 77)))


# ---------------------------------------------------------------- autocast, autograd

@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_autocast_computes_what_compute_dtype_does(recipe):
    tok = _tokens()
    a = _model(recipe, dtype=torch.float32)
    b = _model(recipe, dtype=torch.float32, compute_dtype=BF16)
    with torch.autocast("cpu", dtype=BF16):
        la = a(tok, tok)
    lb = b(tok, tok)
    la.backward()
    lb.backward()
    assert torch.equal(la, lb)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_a_second_backward_and_a_weight_edited_before_the_backward_are_refused(recipe):
    x = _inputs(1)[0][0]
    b = _block(recipe)
    y = b(x)
    y.float().sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time(.|\n)*retain_graph=True"):
        y.float().sum().backward()
    y = b(x)
    with torch.no_grad():
        b.down.mul_(4.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation(.|\n)*weight down"):
        y.float().sum().backward()


# ---------------------------------------------------------------- copies, pickles, checkpoints

def _train(m, opt, batches):
    out = []
    for t in batches:
        loss = m(t, t)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.detach())
    return out


def test_copies_and_pickles_keep_the_scale_state_and_continue_identically():
    batches = [_tokens(seed) for seed in range(4)]
    m = _model("tensorwise", dtype=torch.float32, compute_dtype=BF16)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    _train(m, opt, batches[:2])
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    copies = [copy.deepcopy(m), torch.load(buf, weights_only=False)]
    assert all(c.fp8_stats() == m.fp8_stats() for c in copies)
    ref = _train(m, opt, batches[2:])
    for c in copies:
        got = _train(c, torch.optim.SGD(c.parameters(), lr=0.1), batches[2:])
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    bw = _model("blockwise")
    bw.track_fp8_stats()
    c = copy.deepcopy(bw)
    tok = _tokens()
    c(tok, tok).backward()
    assert set(c.fp8_stats()) == {0, 1}


def test_a_checkpoint_of_another_history_length_loads_its_most_recent_amaxes():
    m = _model("tensorwise")
    tok = _tokens()
    for _ in range(3):
        m(tok, tok).backward()
    ckpt = m.state_dict()
    ref = m.fp8_stats()
    for length in (32, 2):
        recipe = Fp8Recipe(f"tw{length}", scaling="tensor", fast_accum=True, history=length)
        other = _model(recipe, seed=5)
        other.load_state_dict(ckpt)
        assert all(torch.equal(p, ckpt[n]) for n, p in other.named_parameters())
        got = other.fp8_stats()
        for i in ref:
            for name, st in ref[i].items():
                kept = min(length, 16)
                assert got[i][name]["amax_history"][:kept] == st["amax_history"][:kept], (length, i, name)
                assert got[i][name]["last_amax"] == st["last_amax"]
        if length == 32:                     # every entry kept: the same next step
            assert torch.equal(other(tok, tok), m(tok, tok))


def test_a_checkpoint_without_scale_state_resets_the_histories():
    ckpt = _model(None, seed=1).state_dict()          # a bf16 model's
    tok = _tokens()
    used = _model("tensorwise")
    with torch.no_grad():
        used.embed.mul_(30.0)
    used(tok, tok).backward()                         # it trained on other weights first
    used.load_state_dict(ckpt)
    assert used.fp8_stats() == {}
    fresh = _model("tensorwise", seed=2)
    fresh.load_state_dict(ckpt)
    assert torch.equal(used(tok, tok), fresh(tok, tok))


# ---------------------------------------------------------------- blockwise statistics, recipes

def test_all_zero_runs_are_counted_apart_from_the_scale_bounds():
    x = torch.randn(256, 256) * 1e-3
    x[200:] = 0.0                                     # padding rows: their runs get scale 1
    q, s = quantize_blocks(x, E4M3)
    st = BlockScaleStats()
    st.record("dz", s, q)
    got = st.stats()["dz"]
    amax = float(x.abs().max())
    assert got["zero_runs"] == 56 * 2 and got["nonfinite_runs"] == 0
    assert got["amax_bound"] / 2 < amax <= got["amax_bound"] and got["max_scale"] < 1e-4
    st.record("zero", torch.ones(2, 2), torch.zeros(2, 256, dtype=E4M3))
    assert st.stats()["zero"]["max_scale"] == 0.0 and st.stats()["zero"]["min_scale"] == 0.0


def _stats_run(b, xs, dy, wrap=None):
    for x in xs:
        xi = x.clone().requires_grad_()
        (b(xi) if wrap is None else wrap(b, xi)).backward(dy)
    return b.fp8_stats()


def test_blockwise_statistics_cover_an_optimizer_steps_micro_batches_and_no_evaluation():
    """With gradient accumulation a step's statistics combine its micro-batches (largest and smallest
    scale over them, runs counted in each): an inf in the first micro-batch used to vanish when the
    second overwrote the statistics; a forward without autograd records nothing (it used to
    overwrite h's and h1's). An optimizer step (or weights_changed) starts the next step's."""
    (x, x2, x_eval), dy = _inputs(3)
    bad = x.clone()
    bad[0, 3, 5] = float("inf")
    alone = []
    for xi in (bad, x2):
        b = _block("blockwise")
        b.track_fp8_stats()
        alone.append(_stats_run(b, [xi], dy))
    b = _block("blockwise")
    b.track_fp8_stats()
    opt = torch.optim.SGD(b.parameters(), lr=0.1)
    got = _stats_run(b, [bad, x2], dy)
    assert set(got) == set(alone[0]) == set(alone[1])
    for name, st in got.items():
        a, c = alone[0][name], alone[1][name]
        assert st["micro_batches"] == 2 and a["micro_batches"] == c["micro_batches"] == 1
        assert st["nonfinite_runs"] == a["nonfinite_runs"] + c["nonfinite_runs"], name
        assert st["zero_runs"] == a["zero_runs"] + c["zero_runs"], name
        assert st["max_scale"] == max(a["max_scale"], c["max_scale"]), name
        assert st["min_scale"] == min(s for s in (a["min_scale"], c["min_scale"]) if s > 0), name
    assert got["dz"]["nonfinite_runs"] > 0
    with torch.no_grad():
        b(x_eval * 100)
    assert b.fp8_stats() == got
    opt.zero_grad()
    opt.step()                                          # (no gradients: the weights stay)
    assert b.fp8_stats() == got                         # read after the optimizer step: still its step's
    assert _stats_run(b, [x2], dy) == alone[1]          # the next step starts afresh
    weights_changed()
    assert _stats_run(b, [bad], dy) == alone[0]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_blockwise_statistics_under_torch_checkpoint_count_each_micro_batch_once(use_reentrant):
    from torch.utils.checkpoint import checkpoint
    (x, x2), dy = _inputs(2)
    x = x.clone()
    x[0, 7, 9] = float("nan")

    def wrap(b, xi):
        return checkpoint(b, xi, use_reentrant=use_reentrant)

    runs = []
    for w in (None, wrap):
        b = _block("blockwise")
        b.track_fp8_stats()
        runs.append(_stats_run(b, [x, x2], dy, w))
    assert runs[0] == runs[1] and runs[0]["h"]["nonfinite_runs"] == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(history=16), "history applies to delayed per-tensor scaling"),
    (dict(history=1000, margin=8), "history and margin apply"),
    (dict(margin=1), "margin applies"),
    (dict(scaling="tensor", history=10 ** 7), r"history must be an int in 1\.\.1024"),
    (dict(scaling="tensor", pow2="no"), "pow2 must be True or False"),
    (dict(scaling="tensor", fast_accum=1), "fast_accum must be True or False"),
    (dict(scaling="tensor", reduce_amax=1), "reduce_amax must be True or False"),
    (dict(reduce_amax="no"), "reduce_amax must be True or False"),
])
def test_recipe_options_that_would_be_ignored_or_misread_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Fp8Recipe("mine", **kwargs)
    assert Fp8Recipe("mine", scaling="tensor").history == 16 and RECIPES["tensorwise"].margin == 0
    # the amaxes are reduced over ranks unless asked otherwise; blockwise scales have none delayed
    assert all(r.reduce_amax for r in RECIPES.values()) and not Fp8Recipe("mine", reduce_amax=False).reduce_amax


def test_a_recipe_named_like_another_takes_none_of_its_tuned_plans():
    """The name keys the FP8 sites' tuned plans (LlamaBlock.context, "...:fp8-NAME"): a recipe of
    one's own named like a built-in one but with other settings (another scaling: plans of other
    kernels) took the built-in's shipped plans. A built-in recipe, or one equal to it, keeps its
    name; any other recipe's key adds a digest of its settings. A name that is not a plain string
    is refused (Fp8Recipe(5) was accepted)."""
    def ctx(recipe):
        return LlamaBlock(256, 2, 1, 256, head_dim=128, fp8=recipe).context()
    assert ctx("tensorwise").endswith(":fp8-tensorwise") and ctx("blockwise_g16").endswith(":fp8-blockwise_g16")
    assert ctx(Fp8Recipe("tensorwise", scaling="tensor", fast_accum=True)) == ctx("tensorwise")
    mine = ctx(Fp8Recipe("tensorwise"))                             # blockwise scaling under that name
    assert mine != ctx("tensorwise") and mine != ctx("blockwise") and ":fp8-tensorwise-" in mine
    assert mine == ctx(Fp8Recipe("tensorwise"))                    # the same settings, the same key
    # the delayed scales' history, margin and amax reduction pick no kernel: the built-in's plans still fit
    assert ctx(Fp8Recipe("tensorwise", scaling="tensor", fast_accum=True, history=32, margin=1,
                         reduce_amax=False)) == ctx("tensorwise")
    assert ctx(Fp8Recipe("hybrid", scaling="tensor", gradient=torch.float8_e5m2)) != \
        ctx(Fp8Recipe("hybrid", scaling="tensor"))
    for bad in (5, "", "a:b", "a|b", None):
        with pytest.raises(ConfigError, match="FP8 recipe name must be a non-empty str"):
            Fp8Recipe(bad, scaling="tensor")


def test_blockwise_recipes_ignore_reduce_amax_and_still_hand_operands_over():
    """reduce_amax concerns the delayed scales only: blockwise blocks that differ in it alone hand
    their neighbour its operand in FP8 (nn.fp8.support.hands_fp8), as equal recipes do."""
    from coda_cutlass.nn.fp8.support import hands_fp8
    bw = RECIPES["blockwise"]
    mine = dataclasses.replace(bw, reduce_amax=False)
    assert hands_fp8(bw, mine) is mine and hands_fp8(mine, bw) is bw
    assert hands_fp8(RECIPES["tensorwise"], dataclasses.replace(RECIPES["tensorwise"], reduce_amax=False))


class _AllReduceCounter:
    """torch.distributed.all_reduce of a world of one rank (MAX: the tensor itself), counted, where
    the scales are told the ranks reduce (nn/fp8/amax_reduce.py)."""

    def __init__(self, monkeypatch):
        from coda_cutlass.nn.fp8 import delayed
        self.calls = []
        monkeypatch.setattr(delayed, "ranks_reduce", lambda reduce_amax: reduce_amax)
        monkeypatch.setattr(torch.distributed, "all_reduce",
                            lambda t, op=None, group=None: self.calls.append((tuple(t.shape), op)))


@pytest.mark.parametrize("how", ["own folds", "folds_together", "checkpointed"])
def test_amaxes_reduced_over_ranks_take_one_collective_a_backward_and_fold_as_before(monkeypatch, how):
    """A step's amaxes are reduced once its backward ends, every block's in one all-reduce (MAX) of
    one amax a tensor; a reentrant checkpoint's recompute folds at the end of its own backward, so
    each checkpointed block reduces there, with its fold. Reduced over one rank, the histories,
    scales and losses are those of a model that does not reduce, bit for bit (the reduced amaxes
    fold as one part a tensor). A training forward without a backward (which may run on one rank
    alone) takes no collective: its amaxes join the next backward's reduction and so count into the
    next step, where one process folds them as a step of their own (a reentrant checkpoint's first
    pass records nothing)."""
    from coda_cutlass.nn.fp8 import tensorwise
    from coda_cutlass.nn.parallel import checkpoint_blocks
    monkeypatch.setattr(tensorwise, "folds_together", how == "folds_together")
    batches = [_tokens(seed) for seed in range(3)]
    runs, steps_after = {}, {}
    for reduce in (False, True):
        counter = _AllReduceCounter(monkeypatch)
        m = _model(dataclasses.replace(RECIPES["tensorwise"], reduce_amax=reduce), dtype=torch.float32,
                   compute_dtype=BF16)
        if how == "checkpointed":
            checkpoint_blocks(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses, per_step = [], []
        for t in batches:
            before = len(counter.calls)
            losses += _train(m, opt, [t])
            per_step.append(len(counter.calls) - before)
        runs[reduce] = (losses, m.fp8_stats(), [b.fp8_path().scales.state() for b in m.blocks])
        before = len(counter.calls)
        m(batches[0], batches[0])            # a training forward, no backward
        without_backward = len(counter.calls) - before
        m(batches[1], batches[1]).backward()
        begin_and_backward = len(counter.calls) - before
        steps_after[reduce] = [b.fp8_path().scales.steps for b in m.blocks]
        if not reduce:
            assert counter.calls == []
            continue
        n = len(m.blocks[0].fp8_path().scales.names) + 1     # an amax a tensor, and a flag (delayed._local_amaxes)
        assert without_backward == 0
        if how == "checkpointed":        # a block's recompute, then its reduction and fold: one each
            assert per_step == [2, 2, 2] and begin_and_backward == 2
            assert counter.calls[0] == ((n,), torch.distributed.ReduceOp.MAX)
        else:                             # every block's amaxes in one, at the backward's end
            assert per_step == [1, 1, 1] and counter.calls[0] == ((2 * n,), torch.distributed.ReduceOp.MAX)
            assert begin_and_backward == 1
    assert runs[True][0] == runs[False][0] and runs[True][1] == runs[False][1]
    for a, b in zip(runs[True][2], runs[False][2]):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
    # one process folded the forward without a backward as a step; reducing, it joined the next
    merged = 0 if how == "checkpointed" else 1
    assert [s + merged for s in steps_after[True]] == steps_after[False]


def test_a_second_backward_of_a_step_reduces_again_and_the_second_forward_folds_nothing(monkeypatch):
    """Two training forwards, then a backward each: the first backward's end reduces the step's
    amaxes, the second's reduces again what it recorded since, with them (it reduced nothing: its
    amaxes stayed this rank's own, tests/test_distributed.py). The second forward's begin takes no
    collective and folds nothing (the first forward's backward had not ended): reducing, each pair
    of forwards is one step, where one process folds at each forward."""
    steps = {}
    for reduce in (False, True):
        counter = _AllReduceCounter(monkeypatch)
        m = _model(dataclasses.replace(RECIPES["tensorwise"], reduce_amax=reduce), dtype=torch.float32,
                   compute_dtype=BF16)
        per_step, forwards = [], []
        for s in range(2):
            before = len(counter.calls)
            a, b = (m(t, t) for t in (_tokens(2 * s), _tokens(2 * s + 1)))
            forwards.append(len(counter.calls) - before)
            a.backward()
            b.backward()
            per_step.append(len(counter.calls) - before)
        steps[reduce] = [b.fp8_path().scales.steps for b in m.blocks]
        assert forwards == [0, 0] and per_step == ([0, 0] if not reduce else [2, 2])
        for b in m.blocks:               # the folds took amaxes, all finite
            h = b.fp8_path().scales.state()["history"]
            assert torch.isfinite(h).all() and (h > 0).sum() >= len(h) // 2
    assert steps == {False: [3, 3], True: [1, 1]}


def test_a_backward_that_raises_leaves_its_amaxes_to_the_next_step_and_nothing_waiting(monkeypatch):
    """A backward that raises after the blocks' backwards (here a hook on the embedding's gradient)
    never reaches its end, so its reduction does not run and its waiting entry is not taken: the next
    training step's begin drops that entry, and the amaxes join that step's reduction."""
    from coda_cutlass.nn.fp8 import amax_reduce
    counter = _AllReduceCounter(monkeypatch)
    m = _model(dataclasses.replace(RECIPES["tensorwise"], reduce_amax=True), dtype=torch.float32,
               compute_dtype=BF16)
    m(_tokens(0), _tokens(0)).backward()
    assert len(counter.calls) == 1 and not amax_reduce._WAITING

    def fail(grad):
        raise RuntimeError("a failing gradient hook")
    hook = m.embed.register_hook(fail)
    with pytest.raises(RuntimeError, match="a failing gradient hook"):
        m(_tokens(1), _tokens(1)).backward()
    hook.remove()
    assert len(counter.calls) == 1 and len(amax_reduce._WAITING) == 1
    m(_tokens(2), _tokens(2)).backward()
    assert not amax_reduce._WAITING
    # the failed step's amaxes joined this step's, reduced at its end (both blocks in one)
    assert [shape for shape, _ in counter.calls[1:]] == [(22,)]     # 10 amaxes and a flag a block (delayed._local_amaxes)


def test_a_model_outside_a_process_group_or_alone_in_one_reduces_nothing(monkeypatch):
    """reduce_amax (the default) in one process, without a process group or in a world of one
    (a gloo group of this process alone): no collective runs, the scales are as without it."""
    import torch.distributed as dist
    from coda_cutlass.nn.fp8.amax_reduce import ranks_reduce
    assert not ranks_reduce(True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert not ranks_reduce(True)
        monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("a collective in a world of one"))
        xs, dy = _inputs(2)
        b = _block("tensorwise")
        for x in xs:
            b(x).backward(dy)
        assert b.fp8_path().scales.steps == 1 and b.fp8_stats()["h"]["calibrated"]
    finally:
        dist.destroy_process_group()


def test_an_amax_group_of_a_destroyed_world_is_refused_by_name():
    """set_amax_group's group outlives destroy_process_group: in the world made next, the training
    forward refuses it by name (gloo's connections outlive the group, so the reductions went on over
    the old world's ranks, or crashed in gloo); set_amax_group(None) takes the default group again."""
    import torch.distributed as dist
    from coda_cutlass.nn.fp8 import set_amax_group
    from coda_cutlass.nn.fp8.amax_reduce import ranks_reduce
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        stale = dist.new_group([0])
        previous = set_amax_group(stale)
        dist.destroy_process_group()
        assert not ranks_reduce(True)           # no world: nothing to reduce, nothing to refuse
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        with pytest.raises(ConfigError, match="set_amax_group was destroyed since"):
            ranks_reduce(True)
        assert not ranks_reduce(False)
        with pytest.raises(ConfigError, match="this group was destroyed"):
            set_amax_group(stale)
        set_amax_group(None)
        assert not ranks_reduce(True)
    finally:
        set_amax_group(previous)
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_fresh_blocks_scale_state_has_the_structure_of_a_trained_ones():
    """A distributed checkpoint (torch.distributed.checkpoint) loads into the state dict's structure
    as it stands: a block before its first step reported {"history": None} and the load failed with
    "expected BytesStorageMetadata but found TensorStorageMetadata"."""
    fresh, trained = _block("tensorwise"), _block("tensorwise")
    xs, dy = _inputs(1)
    trained(xs[0]).backward(dy)
    a, b = (m.get_extra_state()["fp8_scales"] for m in (fresh, trained))
    assert set(a) == set(b)
    for k in ("history", "amax", "pending"):
        assert isinstance(a[k], torch.Tensor) and a[k].shape == b[k].shape, k
    fresh.set_extra_state(fresh.get_extra_state())      # still a block that calibrates on its first step
    assert not any(v["calibrated"] for v in fresh.fp8_stats().values())


def _dcp_round_trip(saved: dict, into: torch.nn.Module, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    dcp.save({"model": saved}, checkpoint_id=str(path), no_dist=True)
    state = {"model": into.state_dict()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    into.load_state_dict(state["model"])


def test_a_distributed_checkpoint_loads_whatever_step_either_side_was_at(tmp_path):
    """torch.distributed.checkpoint loads into the structure of the loading model's state dict: the
    step's not-yet-folded amaxes were a dict keyed by the tensors that had one, so a checkpoint made
    before training did not load into a model that had trained (rolling back to it: "Missing key in
    checkpoint state_dict: model.blocks.0._extra_state.fp8_scales.pending.h"), and a fresh model
    dropped a trained checkpoint's pending amaxes (its next scales differed from the saving run's)."""
    batches = [_tokens(seed) for seed in range(4)]
    m = _model("tensorwise", dtype=torch.float32, compute_dtype=BF16)
    initial = copy.deepcopy(m.state_dict())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    first = _train(m, opt, batches[:2])
    _dcp_round_trip(initial, m, tmp_path / "initial")            # roll back into the trained model
    assert not any(v["calibrated"] for s in m.fp8_stats().values() for v in s.values())
    again = _train(m, torch.optim.SGD(m.parameters(), lr=0.1), batches[:2])
    assert all(torch.equal(a, b) for a, b in zip(again, first))
    trained = copy.deepcopy(m.state_dict())
    ref = _train(m, opt, batches[2:])
    fresh = _model("tensorwise", seed=4, dtype=torch.float32, compute_dtype=BF16)
    _dcp_round_trip(trained, fresh, tmp_path / "trained")
    got = _train(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), batches[2:])
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_a_checkpoint_with_the_pending_amaxes_as_a_dict_still_loads():
    """Checkpoints written before the pending amaxes became a tensor with flags: {name: amax}."""
    trained = _block("tensorwise")
    xs, dy = _inputs(1)
    trained(xs[0]).backward(dy)
    extra = copy.deepcopy(trained.get_extra_state())
    st = extra["fp8_scales"]
    st["pending"] = {n: float(a) for n, a, on in zip(st["names"], st["pending"], st.pop("pending_set")) if on}
    assert st["pending"]
    old = _block("tensorwise", seed=1)
    old.set_extra_state(extra)
    now = trained.get_extra_state()["fp8_scales"]
    got = old.get_extra_state()["fp8_scales"]
    assert got["pending_set"] == now["pending_set"] and torch.equal(got["pending"], now["pending"])
