"""The FP8 recipe "tensorwise" on the CPU: delayed per-tensor scales (nn/fp8/delayed.py), the weights'
per-tensor copies; and both recipes' blocks through the interpreter against a plain-torch FP8
emulation written from the recipes' description (tests/fp8_emulation.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from coda_cutlass import epilogues as E
from coda_cutlass.errors import ConfigError
from coda_cutlass.nn import LlamaBlock, LlamaModel
from coda_cutlass.nn.fp8 import RECIPES, Fp8Recipe
from coda_cutlass.nn.fp8.delayed import DelayedScales, tensor_scales
from coda_cutlass.nn.fp8.weights import Fp8Weights
from coda_cutlass.nn.reference import coda_grads_standard, standard_block, standard_weights
from fp8_emulation import emulated_block
from fp8_helpers import RecordingRunner, draw_weights

BF16, E4M3, E5M2 = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_tensor_scales_round_up_to_powers_of_two():
    amax = torch.tensor([448.0, 449.0, 1.0, 0.0, float("inf"), float("nan"), 1e-42, 448.0 * 2 ** -3])
    fmax = torch.full_like(amax, 448.0)
    s = tensor_scales(amax, fmax, 0, True)
    assert s[0] == 1.0 and s[1] == 2.0 and s[2] == 2.0 ** -8 and s[3] == 1.0 and s[7] == 2.0 ** -3
    assert math.isnan(s[4]) and math.isnan(s[5]) and s[6] == 2.0 ** -126
    assert tensor_scales(torch.tensor([449.0]), torch.tensor([448.0]), 2, True)[0] == 8.0        # margin 2^2
    exact = tensor_scales(torch.tensor([449.0]), torch.tensor([448.0]), 0, False)
    assert exact[0] == torch.tensor(449.0) / 448.0


def test_tensor_scales_are_the_block_scales_rule():
    """At margin 0 a per-tensor scale is what quantization.scales_from_amax (the kernels' block
    scales) gives for the same amax, both roundings, e4m3 and e5m2."""
    from coda_cutlass.quantization import scales_from_amax
    g = torch.Generator().manual_seed(0)
    amax = torch.cat([torch.rand(2000, generator=g) * 10.0 ** torch.randint(-30, 30, (2000,), generator=g),
                      torch.tensor([0.0, 448.0, 57344.0, 2.0 ** -130, float("inf"), float("nan")])])
    for dtype, fmax in ((torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)):
        for pow2 in (True, False):
            got = tensor_scales(amax, torch.full_like(amax, fmax), 0, pow2)
            want = scales_from_amax(amax, dtype, pow2)[0]
            assert torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0)), (dtype, pow2)


def test_tensor_scales_without_pow2_divide_by_a_tensor_not_a_host_float():
    """pow2=False with fmax given as a float (the weights' copies): the scale is amax / fmax divided by a
    tensor of amax's shape, never by a Python float, which CUDA would turn into a multiplication by
    the fp32 reciprocal (BinaryDivTrueKernel.cu: one bit off in about half the amaxes for 1 / 448);
    the values are the kernels' rule (quantization.scales_from_amax), pinned here on the CPU."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from coda_cutlass.quantization import scales_from_amax

    class Divisions(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.divisors: list[Any] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.div:
                self.divisors.append(args[1])
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(2)
    amax = torch.cat([torch.rand(4000, generator=g) * 10.0 ** torch.randint(-20, 20, (4000,), generator=g),
                      torch.tensor([0.0, 448.0, 449.0, 57344.0, float("inf"), float("nan")])])
    for dtype, fmax in ((E4M3, 448.0), (E5M2, 57344.0)):
        with Divisions() as seen:
            got = tensor_scales(amax, fmax, 0, False)
        assert seen.divisors and all(isinstance(d, torch.Tensor) and d.shape == amax.shape for d in seen.divisors)
        want = scales_from_amax(amax, dtype, False)[0]
        assert torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0)), dtype
        # what a division by the host float computes on a GPU: not these scales
        assert not torch.equal(amax * torch.tensor(1.0 / fmax), amax / fmax)


def test_tensor_scales_are_the_exact_power_of_two_at_every_margin():
    """The division-free power of two is the smallest 2^k >= amax * 2^margin / fmax (exact rational
    arithmetic), at least 2^-126, for amaxes across fp32's range, mantissas at and around fmax's."""
    from fractions import Fraction
    g = torch.Generator().manual_seed(1)
    amax = torch.cat([torch.rand(600, generator=g) * 2.0 ** torch.randint(-140, 100, (600,), generator=g).float(),
                      torch.tensor([1.75, 1.75 * (1 + 2 ** -23), 1.75 * (1 - 2 ** -23), 1.0, 2.0 ** -149,
                                    448.0, 449.0, 57344.0])])
    for fmax in (448.0, 57344.0):
        for margin in (0, 1, 5, 8):
            got = tensor_scales(amax, torch.full_like(amax, fmax), margin, True)
            for a, s in zip(amax.tolist(), got.tolist()):
                if a == 0:
                    assert s == 1.0
                    continue
                v, k = Fraction(a) * 2 ** margin / Fraction(fmax), -126
                while Fraction(2) ** k < v:
                    k += 1
                assert s == 2.0 ** k, (a, fmax, margin, s, k)


class FakeKernel:
    """A 'kernel' whose tensor has a given amax each step; records the scales it was launched with."""

    def __init__(self) -> None:
        self.amax = 1.0
        self.scales: list[float] = []

    def __call__(self, s: torch.Tensor):
        self.scales.append(float(s))
        return {"q": s.clone()}, torch.tensor(self.amax)


def test_a_tensor_is_calibrated_on_its_first_step_then_scaled_from_its_history():
    sc = DelayedScales(Fp8Recipe("t", scaling="tensor", history=3), {"a": E4M3, "g": E5M2})
    k = FakeKernel()
    for step, amax in enumerate([10.0, 3.0, 3.0, 3.0, 3.0]):
        sc.begin_step(torch.device("cpu"))
        k.amax = amax
        k.scales.clear()
        _, s = sc.quantize("a", k, torch.device("cpu"))
        if step == 0:       # launched once for the amax, then with the scale it gives
            assert k.scales == [1.0, 2.0 ** -5] and float(s) == 2.0 ** -5
        else:               # once, with the largest amax of the last 3 steps: 10 ages out after step 3
            assert len(k.scales) == 1
            assert k.scales[0] == (2.0 ** -5 if step <= 3 else 2.0 ** -7), (step, k.scales)
    stats = sc.stats()
    assert stats["a"]["calibrated"] and stats["a"]["amax_history"][:3] == [3.0, 3.0, 3.0]
    assert not stats["g"]["calibrated"] and stats["g"]["format"] == str(E5M2)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_scales_of_amax_over_fp8_max_do_not_report_saturation(fmt):
    """pow2=False: a steady tensor's scale is amax / fp8_max itself, fp32-rounded; its amax came out
    a hair past scale * fp8_max and every step said "saturated" (the codes reach fp8_max at most by
    rounding). Past the rounding boundary it is still reported."""
    recipe = Fp8Recipe("exact", scaling="tensor", pow2=False, activation=fmt)
    for amax in (15.0, 0.3, 123.4, 7.0, 1e-3):            # 15 / 448 rounds down in fp32
        sc = DelayedScales(recipe, {"a": fmt})
        k = FakeKernel()
        k.amax = amax
        for _ in range(3):
            sc.begin_step(torch.device("cpu"))
            sc.quantize("a", k, torch.device("cpu"))
            assert sc.stats()["a"]["saturated"] is False, amax
    k.amax = 123.4 * 1.1                                 # past fp8_max + half a step
    sc.begin_step(torch.device("cpu"))
    sc.quantize("a", k, torch.device("cpu"))
    assert sc.stats()["a"]["saturated"] is True


def test_an_overflow_saturates_for_a_step_and_a_non_finite_amax_leaves_the_scale_alone():
    """As Transformer Engine's delayed scaling: a tensor that outgrows its scale saturates for that
    step and moves the next scale; an inf or NaN amax stays in the history (stats show it) but the
    scale comes from the finite, positive amaxes only, so one bad step does not poison the next."""
    sc = DelayedScales(RECIPES["tensorwise"], {"a": E4M3})
    k = FakeKernel()
    sc.begin_step(torch.device("cpu"))
    sc.quantize("a", k, torch.device("cpu"))
    assert sc.stats()["a"]["saturated"] is False
    sc.begin_step(torch.device("cpu"))
    k.amax = 1000.0                                  # outgrows the scale of amax 1 (2^-8 * 448 = 1.75)
    sc.quantize("a", k, torch.device("cpu"))
    assert sc.stats()["a"]["saturated"] is True
    for bad in (float("inf"), float("nan")):
        k.amax = bad
        sc.begin_step(torch.device("cpu"))
        sc.quantize("a", k, torch.device("cpu"))
        assert sc.stats()["a"]["saturated"] is True
        sc.begin_step(torch.device("cpu"))
        assert float(sc.scale("a")) == 4.0           # 1000 / 448 -> 2^2: from the finite amaxes
    hist = sc.stats()["a"]["amax_history"]
    assert math.isnan(hist[0]) and hist[1] == float("inf") and hist[2] == 1000.0


def test_a_launch_reports_its_amax_as_parts_the_fold_finishes():
    """A launch may report its amax as per-tile partials or as several tensors (a tensor made by
    several kernels): the step's fold takes the largest element of them all, NaN included."""
    sc = DelayedScales(RECIPES["tensorwise"], {"a": E4M3, "g": E5M2})
    cpu = torch.device("cpu")
    sc.begin_step(cpu)
    sc.quantize("a", lambda s: ({}, (torch.tensor([1.0, 3.0]), torch.tensor([[2.0], [0.5]]))), cpu)
    sc.quantize("a", lambda s: ({}, torch.tensor(5.0)), cpu)        # quantised twice in a step
    sc.quantize("g", lambda s: ({}, [torch.tensor([1.0, float("nan")])]), cpu)
    assert sc.stats()["a"]["last_amax"] == 5.0 and math.isnan(sc.stats()["g"]["last_amax"])
    sc.begin_step(cpu)
    st = sc.stats()
    assert st["a"]["amax_history"][0] == 5.0 and st["a"]["scale"] == 2.0 ** -6     # 5 / 448 -> 2^-6
    # a NaN amax is kept in the history but makes no scale: "g" has none yet (it calibrates again)
    assert math.isnan(st["g"]["amax_history"][0]) and st["g"]["scale"] == 1.0 and not st["g"]["calibrated"]


def test_the_fold_takes_every_parts_maximum_from_one_multi_tensor_call(monkeypatch):
    """begin_step hands the fold each part's maximum from one torch._foreach_max call (one launch on
    a GPU for a block's partials of every shape: its compiled graph ran ~14 reductions a block and
    step before), and the histories and scales are those of folding the parts themselves, inf, NaN,
    zero, strided partials and 0-dim amaxes included."""
    from coda_cutlass.nn.fp8 import delayed

    def step(sc):
        cpu = torch.device("cpu")
        sc.begin_step(cpu)
        padded = torch.tensor([[1.0, 2.0, 7.0], [0.5, 3.0, 9.0]])[:, :2]          # a partials view
        sc.quantize("a", lambda s: ({}, (padded, torch.tensor(2.5))), cpu)
        sc.quantize("g", lambda s: ({}, [torch.tensor([[1.0], [float("inf")]])]), cpu)
        sc.quantize("b", lambda s: ({}, torch.zeros(3, 2)), cpu)
        sc.quantize("c", lambda s: ({}, torch.tensor([float("nan"), 1.0])), cpu)
        sc.begin_step(cpu)
        return sc._history.clone(), sc._amax.clone(), sc._scales.clone()

    formats = {"a": E4M3, "g": E5M2, "b": E4M3, "c": E4M3}
    calls = []
    real = torch._foreach_max
    monkeypatch.setattr(torch, "_foreach_max", lambda ts: calls.append(len(ts)) or real(ts))
    got = step(DelayedScales(RECIPES["tensorwise"], formats))
    assert calls == [5]                                  # every part of the step, in one call
    monkeypatch.setattr(delayed, "_maxes", lambda parts: parts)
    want = step(DelayedScales(RECIPES["tensorwise"], formats))
    for g, w in zip(got, want):
        assert torch.equal(g.nan_to_num(-1.0), w.nan_to_num(-1.0)) and torch.equal(g.isnan(), w.isnan())
    assert got[0][0, 0] == 3.0 and got[0][1, 0] == float("inf") and got[0][3, 0].isnan()


def test_folding_a_steps_amaxes_makes_no_tensor_from_host_values(monkeypatch):
    """begin_step stacks the step's amaxes on the device: building a tensor from host values there
    (an index tensor) is, on a GPU, a copy that waits for the stream, once per block and step, which
    made a 16-layer "tensorwise" model host-bound. The tensor that was not quantised gets amax 0."""
    sc = DelayedScales(RECIPES["tensorwise"], {"a": E4M3, "g": E5M2, "b": E4M3})
    k = FakeKernel()
    sc.begin_step(torch.device("cpu"))
    k.amax = 5.0
    sc.quantize("b", k, torch.device("cpu"))
    def no_host_tensors(*args, **kwargs):
        raise AssertionError("torch.tensor called in begin_step")
    monkeypatch.setattr(torch, "tensor", no_host_tensors)
    sc.begin_step(torch.device("cpu"))
    monkeypatch.undo()
    hist = {n: v["amax_history"][0] for n, v in sc.stats().items()}
    assert hist == {"a": 0.0, "g": 0.0, "b": 5.0}


def test_an_evaluation_forward_asks_what_the_host_has_learnt_before_calibrating():
    """A tensor the host does not know to be calibrated runs a calibrating launch first (its kernel
    twice). On a GPU the host learns it from an amax copy a fold starts, polled later: evaluation
    forwards poll too, since only training forwards did, so no-grad forwards after a few training
    steps ran every quantising GEMM twice (8B block: 6.7 ms against 3.7 of kernels). Here the host's
    not knowing yet is set by hand (on the CPU it learns at each fold)."""
    cpu = torch.device("cpu")
    sc = DelayedScales(RECIPES["tensorwise"], {"a": E4M3, "g": E5M2})
    k = FakeKernel()
    k.amax = 3.0
    sc.begin_step(cpu)
    sc.quantize("a", k, cpu)
    assert len(k.scales) == 2                       # the first step calibrates
    sc.begin_step(cpu)
    sc._known = [False, False]                      # the fold's amax copy not polled yet
    k.scales.clear()
    _, s = sc.frozen().quantize("a", k, cpu)
    assert k.scales == [2.0 ** -7] and float(s) == 2.0 ** -7     # 3 / 448 -> 2^-7, one launch
    assert sc._known == [True, False]
    k.scales.clear()
    sc.frozen().quantize("g", k, cpu)               # never recorded: still calibrates, for this call only
    assert len(k.scales) == 2 and not sc.stats()["g"]["calibrated"]


def test_the_host_polls_the_amax_copy_on_the_amaxes_devices_stream(monkeypatch):
    """On a GPU the host learns which tensors have a delayed scale from a pinned, non-blocking copy of
    the amaxes, which runs on the current stream of the amaxes' device; the event it polls is recorded
    on that stream, not on the current device's (a block on another GPU than the current one would
    read the buffer before the copy landed, and an uninitialised value > 0 would skip a tensor's
    calibration for good). CUDA stood in for: the amaxes report cuda:1, events and streams recorded."""
    class OnGpu1(torch.Tensor):
        @property
        def device(self) -> torch.device:  # type: ignore[override]
            return torch.device("cuda", 1)

    recorded: list[Any] = []

    class Event:
        def record(self, stream: Any = None) -> None:
            recorded.append(stream)

        def query(self) -> bool:
            return True

    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    sc = DelayedScales(RECIPES["tensorwise"], {"a": E4M3, "g": E5M2})
    sc._amax = torch.tensor([3.0, 0.0]).as_subclass(OnGpu1)
    sc._filled, sc._known = [True, True], [False, False]
    sc._learn()                                 # the copy starts
    assert recorded == [("stream of", torch.device("cuda", 1))] and sc._known == [False, False]
    sc._learn()                                 # it has landed: read, and "g" polled for again
    assert sc._known == [True, False] and len(recorded) == 2
    sc._learn(start=False)                      # a launch's poll: reads a landed copy, starts none
    assert sc._known == [True, False] and sc._probe is None and len(recorded) == 2
    sc._learn(start=False)
    assert len(recorded) == 2


def test_per_tensor_weight_copies_and_the_gate_up_halves():
    w = torch.nn.Parameter(torch.randn(256, 384) * 3)
    cache = Fp8Weights(RECIPES["tensorwise"])
    a, h = cache.get(w), cache.get(w, halves=True)
    s = tensor_scales(w.detach().abs().amax(), torch.tensor(448.0), 0, True)
    assert a.scale.dim() == 0 and torch.equal(a.scale, s) and a.scale_t is a.scale
    codes = (w.detach() / s).clamp(-448, 448).to(E4M3)
    assert torch.equal(a.w.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(a.wt.view(torch.uint8), codes.t().contiguous().view(torch.uint8))
    halves = torch.cat([codes[0::2], codes[1::2]]).t().contiguous()
    assert torch.equal(h.wt.view(torch.uint8), halves.view(torch.uint8))
    assert cache.get(w) is a and cache.get(w, halves=True) is h


def test_per_tensor_weight_copies_without_pow2_run_eagerly_and_are_the_kernels_rule(monkeypatch):
    """A "tensorwise" recipe with pow2=False: W's scale is amax / fp8_max (IEEE division, as
    quantization.scales_from_amax), its codes quantize_tensor's, values pinned on the CPU; on a GPU these
    copies are not compiled (a compiled division rounds otherwise: copies.py), the pow2 ones are."""
    import dataclasses
    from coda_cutlass.nn.fp8 import copies
    from coda_cutlass.quantization import quantize_tensor, scales_from_amax
    g = torch.Generator().manual_seed(4)
    w = torch.nn.Parameter(torch.randn(256, 384, generator=g) * 3)
    for fmt in (E4M3, E5M2):
        recipe = dataclasses.replace(RECIPES["tensorwise"], weight=fmt, pow2=False)
        cache = Fp8Weights(recipe)
        a, h = cache.get(w), cache.get(w, halves=True)
        s = scales_from_amax(w.detach().abs().amax().reshape(1), fmt, False)[0].reshape(())
        assert a.scale.dim() == 0 and torch.equal(a.scale, s) and a.scale_t is a.scale, fmt
        codes = quantize_tensor(w.detach(), fmt, s)
        assert torch.equal(a.w.view(torch.uint8), codes.view(torch.uint8)), fmt
        assert torch.equal(a.wt.view(torch.uint8), codes.t().contiguous().view(torch.uint8)), fmt
        halves = torch.cat([codes[0::2], codes[1::2]]).t().contiguous()
        assert torch.equal(h.wt.view(torch.uint8), halves.view(torch.uint8)), fmt
    compiled = object()
    monkeypatch.setattr(copies, "on_device", lambda fn, t, key, what: compiled)
    for fn in (copies._tensor_copies, copies._tensor_scale):
        assert copies._on_device(fn, w, E4M3, False) is fn
        assert copies._on_device(fn, w, E4M3, True) is compiled
    assert copies._on_device(copies._tiles, w, E4M3) is compiled


@pytest.mark.parametrize("halves", [False, True])
def test_weight_copies_by_the_runners_map_kernel_equal_the_torch_copies(halves):
    """Given a runner, a bf16 weight's per-tensor copies come from its ``quantize_tensor`` map kernel
    (the gate/up halves through strided views; the alternative the block benchmark times, the blocks
    use the torch copies), bit for bit the torch copies; fp32 master weights stay in torch, quantised
    from fp32."""
    g = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter((torch.randn(256, 384, generator=g) * 3).to(BF16))
    run = RecordingRunner()
    got = Fp8Weights(RECIPES["tensorwise"]).get(w, halves=halves, runner=run)
    want = Fp8Weights(RECIPES["tensorwise"]).get(w, halves=halves)
    assert [m[:2] for m in run.maps] == [("weight.quant", E.quantize_tensor)]
    assert torch.equal(got.scale, want.scale) and got.scale_t is got.scale
    for a, b in ((got.w, want.w), (got.wt, want.wt)):
        assert a.is_contiguous() and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    w32 = torch.nn.Parameter(w.detach().float() * 1.001)
    Fp8Weights(RECIPES["tensorwise"]).get(w32, halves=halves, runner=run)
    assert len(run.maps) == 1


def test_the_map_kernel_call_takes_the_gate_up_halves_views(fake_nvcc):
    """What a GPU call checks (CompiledMap._prepare, no launch): W read as its gate rows then its up
    rows, W's codes written back through the same strided view, W^T allocated in that order."""
    import coda_cutlass as cc
    from coda_cutlass.nn.fp8.weights import _as_halves
    k = cc.compile_map(E.quantize_tensor, BF16)
    w = torch.randn(256, 384).to(BF16)
    q = torch.empty(256, 384, dtype=E4M3)
    M, N, ptrs, views, _, results, _ = k._prepare(_as_halves(w), {"s": torch.tensor(1.0)}, {"q": _as_halves(q)})
    assert (M, N) == (256, 384) and results["q"].data_ptr() == q.data_ptr()
    assert views[:5] == [384, 768, 128, 0, 384]          # (outer_m, stride_m, inner_m, outer_n, inner_n)
    assert tuple(results["qt"].shape) == (384, 256)


def _block(seed: int = 0, recipe: Any = "tensorwise") -> LlamaBlock:
    torch.manual_seed(seed)
    b = LlamaBlock(256, 2, 1, 512, head_dim=128, fp8=recipe, dtype=BF16)
    return draw_weights(b)


HYBRID = Fp8Recipe("hybrid", scaling="tensor", gradient=E5M2, fast_accum=True)     # Transformer Engine's formats


@pytest.mark.parametrize("recipe, formats, bound", [
    ("tensorwise", (E4M3, E4M3, E4M3), 0.75), ("blockwise", (E4M3, E4M3, E4M3), 0.75),
    ("blockwise_g16", (E4M3, E4M3, E4M3), 0.75),
    # e5m2 gradients (2 mantissa bits): the attention's bf16 backward moves more dq/dk/dv values across
    # a rounding boundary (measured up to 0.86 of FP8's distance, v; an operand in the wrong format or
    # scale gave 0.7-1.0 of the gradients' own size)
    (HYBRID, (E4M3, E5M2, E4M3), 0.9),
    (Fp8Recipe("e5m2", scaling="tensor", activation=E5M2, gradient=E5M2, weight=E5M2), (E5M2, E5M2, E5M2), 0.9)])
def test_each_recipe_matches_an_fp8_emulation_of_it(recipe, formats, bound):
    blk = _block(recipe=recipe)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 128, 256, generator=g).to(BF16)
    dy = torch.randn(2, 128, 256, generator=g).to(BF16)
    for _ in range(2):                   # the second step on delayed scales (same input: same scales)
        blk.zero_grad()
        xi = x.clone().requires_grad_()
        y = blk(xi)
        y.backward(dy)
    coda = (y.detach().float() - x.float(), xi.grad, coda_grads_standard(blk))
    res = {}
    kind = recipe if isinstance(recipe, str) else "tensorwise"
    for name, fn in (("emulated", lambda xx, w: emulated_block(xx, w, blk.dims, blk.inv_freq, formats, kind)),
                     ("exact", lambda xx, w: standard_block(xx, w, blk.dims, blk.inv_freq))):
        w = {k: v.detach().float().requires_grad_() for k, v in standard_weights(blk).items()}
        xx = x.float().requires_grad_()
        ye = fn(xx, w)
        ye.backward(dy.float())
        res[name] = (ye.detach() - x.float(), xx.grad, {k: v.grad for k, v in w.items()})
    pairs = [("branch", 0), ("dx", 1)] + [(n, None) for n in coda[2]]
    for name, i in pairs:
        c, e, x_ = ((t[i] if i is not None else t[2][name]) for t in (coda, res["emulated"], res["exact"]))
        e_ce, e_ex, e_cx = rel(c, e), rel(e, x_), rel(c, x_)
        # FP8 is in play (the emulation is 5-10% from exact); coda computes the emulated math: closer
        # to it than FP8 is to exact (measured 0.45-0.7x: bf16 intermediates move values across e4m3
        # rounding boundaries), and no further from exact than the emulation
        assert e_ex > 0.03, (name, e_ex)
        assert e_ce < bound * e_ex, (name, e_ce, e_ex)
        assert e_cx < 1.25 * e_ex, (name, e_cx, e_ex)


def test_every_gemm_is_per_tensor_and_weight_gradients_read_the_epilogues_transposed_copies():
    blk = _block(2)
    run = RecordingRunner()
    blk.runner = run
    x = torch.randn(1, 256, 256).to(BF16).requires_grad_()
    for _ in range(2):
        run.gemms.clear()
        run.maps.clear()
        blk(x).sum().backward()
    assert all(g[4] == (E4M3, "tensor", True) for g in run.gemms), run.gemms     # fast accumulation
    sites = [g[0] for g in run.gemms]
    # after calibration each GEMM runs once (gate/up's weight gradient too: dz's transposed copy has
    # the gate and up rows interleaved, as the parameter's rows are; it ran as two half GEMMs before)
    assert sorted(sites) == sorted(["qkv", "o", "gate_up", "down.last", "down.dgrad", "down.wgrad",
                                    "gate_up.dgrad", "gate_up.wgrad", "o.dgrad", "o.wgrad",
                                    "qkv.dgrad", "qkv.wgrad"])
    assert sorted(m[0] for m in run.maps) == ["dx2.quant", "h.quant", "norm0", "o.quant", "rope.dgrad", "rope.dgrad",
                                              "rope.dgrad"]
    stats = blk.fp8_stats()
    assert stats["dz"]["calibrated"] and stats["dz"]["scale"] > 0 and stats["h2"]["calibrated"] is False


def test_weight_copies_by_the_map_kernel_give_the_blocks_compiled_copies_results(monkeypatch):
    """nn.fp8.tensorwise.weight_copies_by = "map" (the experiment the probe times): a block's four
    weight copies by the runner's quantize_tensor map kernel, one launch a weight ("weight.quant"),
    and the block's output and every gradient bit for bit those of the compiled copies; the four
    scales come from one call (one compiled graph on a GPU), not one a weight."""
    from coda_cutlass.nn.fp8 import tensorwise, weights
    calls = {"one": 0, "all": 0}
    for name, key in (("tensor_scale", "one"), ("tensor_scales_all", "all")):
        def counted(*a, _fn=getattr(weights, name), _key=key, **k):
            calls[_key] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(weights, name, counted)
    x = torch.randn(1, 256, 256).to(BF16)
    dy = torch.randn(1, 256, 256).to(BF16)
    results, launches = {}, {}
    for by in ("compiled", "map"):
        monkeypatch.setattr(tensorwise, "weight_copies_by", by)
        blk = _block(3)
        run = RecordingRunner()
        blk.runner = run
        xi = x.clone().requires_grad_()
        blk(xi).backward(dy)
        results[by] = [xi.grad] + [p.grad for p in blk.parameters()]
        launches[by] = sorted(m[0] for m in run.maps if m[0] == "weight.quant")
    assert launches == {"compiled": [], "map": ["weight.quant"] * 4}
    assert calls == {"one": 0, "all": 1}
    assert all(torch.equal(a, b) for a, b in zip(results["compiled"], results["map"]))
    monkeypatch.setattr(tensorwise, "weight_copies_by", "maps")
    with pytest.raises(ConfigError, match="weight_copies_by must be one of"):
        _block(3)(x)


def test_a_model_mixing_recipes_hands_operands_across():
    torch.manual_seed(0)
    m = LlamaModel(512, 256, 2, 2, 1, 512, head_dim=128, dtype=BF16)
    tok = torch.randint(0, 512, (2, 128))
    ref = m(tok, tok)
    m.blocks[0] = LlamaBlock(256, 2, 1, 512, head_dim=128, fp8="blockwise", dtype=BF16)
    m.blocks[1] = LlamaBlock(256, 2, 1, 512, head_dim=128, fp8="tensorwise", dtype=BF16)
    torch.manual_seed(0)
    m2 = LlamaModel(512, 256, 2, 2, 1, 512, head_dim=128, dtype=BF16)
    for b, b2 in zip(m.blocks, m2.blocks):
        b.load_state_dict(b2.state_dict())
    loss = m(tok, tok)
    loss.backward()
    assert set(m.fp8_stats()) == {1} and m.fp8_stats()[1]["dx"]["calibrated"]
    assert abs(float(loss) - float(ref)) < 0.02 * float(ref)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_the_amax_histories_travel_in_the_state_dict_and_resume_with_the_same_scales(tmp_path):
    torch.manual_seed(0)
    m = LlamaModel(512, 256, 2, 2, 1, 512, head_dim=128, fp8="tensorwise", dtype=BF16)
    tok = torch.randint(0, 512, (1, 128), generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        m(tok, tok).backward()
    torch.save(m.state_dict(), tmp_path / "ckpt.pt")
    torch.manual_seed(1)
    resumed = LlamaModel(512, 256, 2, 2, 1, 512, head_dim=128, fp8="tensorwise", dtype=BF16)
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=False))
    run = RecordingRunner()
    for b in resumed.blocks:
        b.runner = run
    loss_r = resumed(tok, tok)
    loss_m = m(tok, tok)
    assert torch.equal(loss_r, loss_m)                   # the same scales: the same numbers
    assert run.sites.count("o") == 2                     # one per block: nothing recalibrated
    ref, got = m.fp8_stats(), resumed.fp8_stats()
    assert all(got[i][n]["scale"] == ref[i][n]["scale"] for i in ref for n in ref[i])
    # a bf16 or blockwise model loads the same checkpoint (it keeps no histories)
    LlamaModel(512, 256, 2, 2, 1, 512, head_dim=128, fp8="blockwise", dtype=BF16).load_state_dict(m.state_dict())
    LlamaModel(512, 256, 2, 2, 1, 512, head_dim=128, dtype=BF16).load_state_dict(m.state_dict())
    # a recipe with another history length takes the most recent amaxes (test_fp8_training_state.py)
    other = LlamaModel(512, 256, 2, 2, 1, 512, head_dim=128, dtype=BF16,
                       fp8=Fp8Recipe("long", scaling="tensor", history=32))
    other.load_state_dict(m.state_dict())
    assert other.fp8_stats()[0]["h"]["amax_history"][:16] == m.fp8_stats()[0]["h"]["amax_history"]
    with pytest.raises(ConfigError, match="tensor names"):
        other.blocks[0].fp8_path().scales.load_state({"names": ["h"], "history": None})


def test_a_compiled_helper_that_fails_to_compile_runs_eagerly_with_one_notice(monkeypatch, capsys):
    """nn/fp8/compiled.py: where torch.compile cannot build a helper's graph (a torch or Triton
    version that rejects it), the helper runs eagerly from then on, with one notice, same results."""
    from coda_cutlass.nn.fp8 import compiled

    class OnGpu:
        is_cuda = True

    def broken(fn, **kwargs):
        def call(*args):
            raise RuntimeError("cannot build this graph\ndetails")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(compiled, "_COMPILED", {})
    helper = compiled.on_device(lambda x: x + 1, OnGpu(), "k", "a test helper")
    assert helper(1) == 2 and helper(2) == 3
    captured = capsys.readouterr()
    assert (captured.err + captured.out).count("torch.compile failed (RuntimeError: cannot build this graph)") == 1
    ident = lambda x: x  # noqa: E731
    assert compiled.on_device(ident, torch.zeros(1), "k", "cpu") is ident     # on the CPU: the function itself


def test_one_changed_weight_is_copied_again_by_the_map_kernel(monkeypatch):
    """weight_copies_by = "map": a block whose one weight changed remakes that copy alone, by the map
    kernel still (get_all's one-weight path kept the runner)."""
    from coda_cutlass.nn.fp8 import tensorwise
    monkeypatch.setattr(tensorwise, "weight_copies_by", "map")
    x = torch.randn(1, 256, 256).to(BF16)
    blk = _block(3)
    run = RecordingRunner()
    blk.runner = run
    with torch.no_grad():
        blk(x)
        before = len([m for m in run.maps if m[0] == "weight.quant"])
        blk.o.mul_(1.0)                                   # a new version: o's copies are stale
        blk(x)
    assert before == 4 and len([m for m in run.maps if m[0] == "weight.quant"]) == 5


def _mixed_model() -> LlamaModel:
    """Four blocks, the second blockwise, the rest tensorwise, weights drawn larger than the init's."""
    torch.manual_seed(0)
    m = LlamaModel(512, 256, 4, 2, 1, 512, head_dim=128, fp8=["tensorwise", "blockwise", "tensorwise", "tensorwise"],
                   dtype=BF16)
    for b in m.blocks:
        draw_weights(b)
    return m


def test_a_model_makes_its_blocks_weight_copies_together_with_the_same_results(monkeypatch):
    """nn.fp8.tensorwise.copies_blocks_per_call = 2 on a 3-block "tensorwise" model (a blockwise block
    between: left to itself): the tensorwise blocks' copies come from one call per 2 blocks before the
    first block (again after an optimizer step, none while fresh), no block makes its own, and the
    losses and every gradient over two optimizer steps are bit for bit those of per-block copies."""
    from coda_cutlass.nn.fp8 import tensorwise, weights
    calls: dict[str, list[int]] = {"blocks": [], "block": []}

    def counted(fn: Any, key: str) -> Any:
        def call(ws: list, *a: Any, **k: Any) -> Any:
            calls[key].append(len(ws))
            return fn(ws, *a, **k)
        return call
    monkeypatch.setattr(weights, "blocks_tensor_copies", counted(weights.blocks_tensor_copies, "blocks"))
    monkeypatch.setattr(weights, "tensor_copies_all", counted(weights.tensor_copies_all, "block"))
    tok = torch.randint(0, 512, (1, 128), generator=torch.Generator().manual_seed(3))
    results = {}
    for per_call in (1, 2):
        monkeypatch.setattr(tensorwise, "copies_blocks_per_call", per_call)
        m = _mixed_model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        calls = {"blocks": [], "block": []}
        out = []
        for _ in range(2):
            loss = m(tok, tok)
            loss.backward()
            out += [loss.detach()] + [p.grad.clone() for p in m.parameters()]
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            m(tok, tok)                      # after the last step: copies made
            m(tok, tok)                      # fresh copies: nothing made
        results[per_call] = (out, calls)
    assert results[1][1] == {"blocks": [], "block": [4, 4, 4, 4, 4, 4, 4, 4, 4]}   # 3 blocks x 3 forwards
    assert results[2][1] == {"blocks": [8, 4, 8, 4, 8, 4], "block": []}
    assert all(torch.equal(a, b) for a, b in zip(results[1][0], results[2][0]))
    monkeypatch.setattr(tensorwise, "copies_blocks_per_call", 0)
    with pytest.raises(ConfigError, match="copies_blocks_per_call must be a whole number"):
        m(tok, tok)


def test_a_model_folds_its_blocks_delayed_scales_together_with_the_same_results(monkeypatch):
    """nn.fp8.tensorwise.folds_together: the tensorwise blocks' amax folds in one call before the
    first block of each training forward (from the second step: the first has nothing to fold), none
    in evaluation forwards; a block whose own parameters are frozen folds in its own call. Losses,
    gradients and the scale statistics over three steps and an evaluation forward are bit for bit
    those of a fold a block."""
    from coda_cutlass.nn.fp8 import delayed, tensorwise
    calls: list[int] = []

    def counted(histories: list, *a: Any) -> Any:
        calls.append(len(histories))
        return fold_all(histories, *a)
    fold_all = delayed._folds
    monkeypatch.setattr(delayed, "_folds", counted)
    tok = torch.randint(0, 512, (1, 128), generator=torch.Generator().manual_seed(3))
    results = {}
    for together in (False, True):
        monkeypatch.setattr(tensorwise, "folds_together", together)
        m = _mixed_model()
        for p in m.blocks[3].parameters():
            p.requires_grad_(False)
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
        calls.clear()
        out = []
        for _ in range(3):
            loss = m(tok, tok)
            loss.backward()
            out += [loss.detach()] + [p.grad.clone() for p in m.parameters() if p.requires_grad]
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            out.append(m(tok, tok))
        results[together] = (out, list(calls), m.fp8_stats())
    assert results[False][1] == [] and results[True][1] == [2, 2]    # blocks 0 and 2; block 3 is frozen
    assert all(torch.equal(a, b) for a, b in zip(results[False][0], results[True][0]))
    assert results[False][2] == results[True][2]
    monkeypatch.setattr(tensorwise, "folds_together", "yes")
    with pytest.raises(ConfigError, match="folds_together must be True or False"):
        m(tok, tok)


@pytest.mark.parametrize("case", ["a block listed twice", "a refused call", "checkpointing switched on"])
def test_folding_together_keeps_what_a_fold_a_block_gives_in_the_edge_cases(monkeypatch, case):
    """folds_together against a fold a block, where they parted before a review: a block object listed
    twice in the model folded twice per step; a call refused by the blocks (129 tokens) had folded
    every block first; a block checkpointed after some steps (its first pass runs without autograd and
    folds in its recompute) was folded in the forward."""
    from coda_cutlass.nn.fp8 import tensorwise
    from coda_cutlass.nn.parallel import checkpoint_blocks
    tok = torch.randint(0, 512, (1, 128), generator=torch.Generator().manual_seed(4))
    states = {}
    for together in (False, True):
        monkeypatch.setattr(tensorwise, "folds_together", together)
        torch.manual_seed(0)
        m = LlamaModel(512, 256, 2, 2, 1, 512, head_dim=128, fp8="tensorwise", dtype=BF16)
        for b in m.blocks:
            draw_weights(b)
        if case == "a block listed twice":
            m.blocks.append(m.blocks[0])
        losses = []
        for step in range(4):
            if case == "checkpointing switched on" and step == 2:
                checkpoint_blocks(m)
            loss = m(tok, tok)
            loss.backward()
            losses.append(loss.detach())
            if case == "a refused call" and step == 1:
                with pytest.raises(Exception, match="128"):
                    m(torch.cat([tok, tok[:, :1]], 1), torch.cat([tok, tok[:, :1]], 1))
                after_refusal = (m.fp8_stats(), [b.fp8_path().scales.steps for b in m.blocks])
        states[together] = (losses, m.fp8_stats(), [b.fp8_path().scales.steps for b in m.blocks],
                            after_refusal if case == "a refused call" else None)
    assert all(torch.equal(a, b) for a, b in zip(states[False][0], states[True][0]))
    assert states[False][1:] == states[True][1:]
