"""coda_cutlass.nn on the CPU (the reference interpreter runs the kernels' programs): the Llama
block and model, forward and every gradient, against a plain torch Llama in fp32, and the
conversion from and to transformers' LlamaDecoderLayer."""

from __future__ import annotations

import statistics

import pytest
import torch

import coda_cutlass as cc
from coda_cutlass.nn import LlamaBlock, LlamaModel, ReferenceRunner
from coda_cutlass.nn.reference import PROJECTIONS, ReferenceLlama
from llama_reference import coda_grads_standard, standard_block, standard_model_loss, standard_weights

RTOL = 1e-4      # the bound for fp32 (measured: ~1e-6)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def perturb_norms(module: torch.nn.Module, g: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.mark.parametrize("inputs", ["views", "heads", "heads_repeated"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
def test_block_forward_and_every_gradient_match_a_standard_block(heads, kv_heads, inputs):
    """Also with SDPA handed head-major copies of q, k, v (with k, v repeated): the attention
    gradients come back as (B, S, heads, D) views of head-major tensors, read as they are."""
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    torch.manual_seed(heads + kv_heads)
    block = LlamaBlock(64, heads, kv_heads, 96, eps=1e-5, rope_theta=10000.0, dtype=torch.float32)
    block.attention.inputs = inputs
    perturb_norms(block, g)
    assert isinstance(block.get_runner(), ReferenceRunner)
    w = standard_weights(block)
    x = torch.randn(2, 8, 64, generator=g, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = block(x)
    y_ref = standard_block(x_ref, w, block.dims, block.inv_freq)
    assert rel(y, y_ref) < RTOL
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    y_ref.backward(dy)
    assert rel(x.grad, x_ref.grad) < RTOL
    grads = coda_grads_standard(block)
    for name, leaf in w.items():
        assert rel(grads[name], leaf.grad) < RTOL, name


class SiteLog(ReferenceRunner):
    """The reference runner, listing the GEMM sites it runs."""

    def __init__(self):
        super().__init__(torch.bfloat16)
        self.sites: list[str] = []

    def gemm(self, site, program, A, W, **kw):
        self.sites.append(site)
        return super().gemm(site, program, A, W, **kw)


def test_a_forward_without_autograd_skips_the_saved_pre_activation():
    """Under no_grad the block runs its forward alone: the gate/up GEMM writes only the SwiGLU
    output (site gate_up.infer, program swiglu_only), and the result is the training forward's."""
    g = torch.Generator().manual_seed(3)
    block = LlamaBlock(64, 4, 2, 96, eps=1e-5, rope_theta=10000.0, dtype=torch.float32)
    perturb_norms(block, g)
    block.runner = SiteLog()
    x = torch.randn(2, 8, 64, generator=g)
    y_train = block(x.clone().requires_grad_())
    assert "gate_up" in block.runner.sites and "gate_up.infer" not in block.runner.sites
    block.runner.sites.clear()
    with torch.no_grad():
        y_infer = block(x)
    assert block.runner.sites == ["qkv.infer", "o.infer", "gate_up.infer", "down.last.infer"]
    assert not y_infer.requires_grad
    assert rel(y_infer, y_train.detach()) < RTOL
    block.runner.sites.clear()
    for p in block.parameters():            # nothing requires a gradient: the same forward-only path
        p.requires_grad_(False)
    block(x)
    assert "gate_up.infer" in block.runner.sites


def test_the_training_forward_keeps_z_but_not_the_swiglu_output():
    """The block saves z (M x 2f) for its backward and not y = silu(gate) * up (M x f): the
    down-proj dX epilogue writes y again from z for the weight gradient (swiglu_backward_y), so
    the gradients still match the standard block (the test above) with a third less MLP memory."""
    block = LlamaBlock(64, 4, 2, 96, eps=1e-5, rope_theta=10000.0, dtype=torch.float32)
    x = torch.randn(2, 8, 64, requires_grad=True)
    node = block(x).grad_fn
    while type(node).__name__ != "BlockFunctionBackward":      # past the view of the output
        node = node.next_functions[0][0]
    shapes = [tuple(t.shape) for t in node.saved_tensors if t is not None]
    assert (16, 192) in shapes and (16, 96) not in shapes, shapes
    block.runner = SiteLog()
    block(x).sum().backward()
    assert "down.dgrad" in block.runner.sites


def test_the_training_forward_keeps_neither_normed_input():
    """h = x * g and h1 = x1 * g (the QKV and gate/up GEMMs' operands) are not saved: the norm-backward
    dX epilogues, which read x and x1 anyway, write them again for the weight gradients
    (norm_backward_h). Of the block's D-wide tensors only x, the attention output o and x1 stay."""
    block = LlamaBlock(64, 4, 2, 96, eps=1e-5, rope_theta=10000.0, dtype=torch.float32)
    x = torch.randn(2, 8, 64, requires_grad=True)
    node = block(x).grad_fn
    while type(node).__name__ != "BlockFunctionBackward":
        node = node.next_functions[0][0]
    wide = [t for t in node.saved_tensors if t is not None and tuple(t.shape) == (16, 64)]
    assert len(wide) == 3, [tuple(t.shape) for t in node.saved_tensors if t is not None]
    block.runner = SiteLog()
    block(x).sum().backward()
    assert {"qkv.dgrad", "gate_up.dgrad"} <= set(block.runner.sites)


def test_an_inference_site_uses_its_training_sites_tuned_choice():
    from coda_cutlass import epilogues as E
    from coda_cutlass.nn.plan_store import Choice
    from coda_cutlass.nn.runner import KernelRunner
    cfg = cc.KernelConfig(tile_m=128, tile_n=256, tile_k=64, cluster_m=2, cluster_n=1)
    runner = KernelRunner(torch.bfloat16, plan={"gate_up": Choice(cfg, "m", 4)})
    assert runner.choice("gate_up.infer", E.swiglu_only, "nk") == Choice(cfg, "m", 4)
    assert runner.choice("down.dgrad", E.swiglu_backward_scaled, "kn").config != cfg
    own = Choice(cc.KernelConfig(tile_m=128, tile_n=128, tile_k=64, cluster_m=1, cluster_n=2, schedule="pingpong"))
    runner.plan["gate_up.infer"] = own          # tuned in the forward-only sequence: its own choice
    assert runner.choice("gate_up.infer", E.swiglu_only, "nk") == own


def test_every_forward_only_site_falls_back_to_a_training_site_of_the_same_gemm():
    from coda_cutlass.nn.kernels import PLAN_FALLBACK, SITES
    infer = {s for s in SITES if s.endswith(".infer")}
    assert set(PLAN_FALLBACK) == infer
    for site, train in PLAN_FALLBACK.items():
        assert train in SITES and SITES[site][1] == SITES[train][1]


def test_model_loss_and_every_gradient_match_a_standard_model():
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    V = 96
    # ce_chunk_bytes small enough for several row chunks in the LM-head backward
    model = LlamaModel(V, 64, 2, 4, 2, 96, eps=1e-5, rope_theta=10000.0, dtype=torch.float32,
                       ce_chunk_bytes=V * 4 * 5)
    perturb_norms(model, g)
    tokens = torch.randint(0, V, (2, 8), generator=g)
    targets = torch.randint(0, V, (2, 8), generator=g)
    targets[0, 3] = targets[1, 0] = -100
    loss = model(tokens, targets)
    loss.backward()
    ref, leaves = standard_model_loss(model, tokens, targets)
    ref.backward()
    assert abs(loss.item() - ref.item()) < RTOL * abs(ref.item())
    for name in ("embed", "norm", "lm_head"):
        assert rel(getattr(model, name).grad, leaves[name].grad) < RTOL, name
    for block, w in zip(model.blocks, leaves["blocks"]):
        grads = coda_grads_standard(block)
        for name, leaf in w.items():
            assert rel(grads[name], leaf.grad) < RTOL, name


def test_linear_twin_matches_the_plain_twin_and_the_model():
    """ReferenceLlama(linear=True) (nn.Linear projections, the twin torchao's float8 training swaps
    in examples/train_llama.py) computes the plain twin's loss and gradients, and the model's."""
    g = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    model = LlamaModel(64, 64, 2, 4, 2, 96, eps=1e-5, rope_theta=10000.0, dtype=torch.float32)
    perturb_norms(model, g)
    with torch.no_grad():                # weights ~1/sqrt(fan_in): attention far from uniform
        for b in model.blocks:
            for w in (b.qkv, b.o, b.gate_up, b.down):
                w.copy_(torch.randn(w.shape, generator=g) / w.shape[1] ** 0.5)
    tokens = torch.randint(0, 64, (2, 16), generator=g)
    targets = torch.randint(0, 64, (2, 16), generator=g)
    twin = ReferenceLlama(model, linear=True)
    assert all(isinstance(getattr(b, n), torch.nn.Linear) for b in twin.blocks for n in PROJECTIONS)
    loss = twin(tokens, targets)
    loss.backward()
    ref, leaves = standard_model_loss(model, tokens, targets)
    ref.backward()
    assert abs(loss.item() - ref.item()) < RTOL * abs(ref.item())
    assert abs(loss.item() - model(tokens, targets).item()) < RTOL * abs(ref.item())
    assert rel(twin.lm_head.grad, leaves["lm_head"].grad) < RTOL
    for b, w in zip(twin.blocks, leaves["blocks"]):
        for name in PROJECTIONS:
            assert rel(getattr(b, name).weight.grad, w[name].grad) < RTOL, name
        assert rel(b.attn_norm.grad, w["attn_norm"].grad) < RTOL


def test_model_logits_match_a_standard_model():
    torch.manual_seed(1)
    model = LlamaModel(32, 64, 1, 4, 2, 96, rope_theta=10000.0, dtype=torch.float32)
    tokens = torch.randint(0, 32, (1, 8))
    logits = model(tokens)
    assert logits.shape == (1, 8, 32)
    ref, _ = standard_model_loss(model, tokens, torch.zeros(1, 8, dtype=torch.long))
    lse = torch.logsumexp(logits.reshape(8, 32), -1)
    assert abs((lse - logits.reshape(8, 32)[:, 0]).mean().item() - ref.item()) < 1e-4


def test_block_rejects_a_2d_input():
    block = LlamaBlock(64, 4, 2, 96, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"\(batch, seq, 64\)"):
        block(torch.randn(8, 64))


def _hf_layer(rope_scaling=None):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                   rms_norm_eps=1e-5, rope_theta=10000.0, attn_implementation="sdpa",
                                   rope_scaling=rope_scaling, max_position_embeddings=64)
    torch.manual_seed(3)
    layer = LlamaDecoderLayer(cfg, layer_idx=0).float()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.2)
    return cfg, layer, LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}])
def test_from_hf_matches_the_transformers_layer(rope_scaling):
    cfg, layer, rotary = _hf_layer(rope_scaling)
    x = torch.randn(2, 8, 64)
    pos = torch.arange(8)[None].expand(2, 8)
    out = layer(x, position_embeddings=rotary(x, pos), attention_mask=None, position_ids=pos)
    out = out[0] if isinstance(out, tuple) else out
    block = LlamaBlock.from_hf(layer)
    assert rel(block(x), out) < RTOL


def test_to_hf_inverts_from_hf():
    cfg, layer, _ = _hf_layer()
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    other = LlamaDecoderLayer(cfg, layer_idx=0).float()
    LlamaBlock.from_hf(layer).to_hf(other)
    for (name, a), b in zip(layer.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name


def test_an_in_sequence_plan_is_stored_and_found_by_the_runner(tmp_path):
    from coda_cutlass.config import KernelConfig
    from coda_cutlass.nn.runner import Choice, KernelRunner
    from coda_cutlass.nn.plan_store import load_plan, store_plan
    cfg = KernelConfig(tile_m=128, tile_n=256, cluster_m=2, cluster_n=1)
    rec = {"sites": {"gate_up": Choice(cfg, "m", 4).to_json()}}
    store_plan("llama:test", torch.bfloat16, 8000, rec, tmp_path, device="gpu-x")
    assert load_plan("llama:test", torch.bfloat16, 8192, tmp_path, device="gpu-x") == {"gate_up": Choice(cfg, "m", 4)}
    assert load_plan("llama:test", torch.bfloat16, 16384, tmp_path, device="gpu-x", nearest=False) is None
    assert load_plan("llama:test", torch.bfloat16, 8192, tmp_path, device="gpu-y") is None      # other GPU
    explicit = Choice(KernelConfig(), "n", 2)
    runner = KernelRunner(torch.bfloat16, plan={"qkv": explicit}, cache_dir=tmp_path)
    runner.prepare("llama:test", 8192, device="gpu-x")
    assert runner.plan == {"gate_up": Choice(cfg, "m", 4), "qkv": explicit}
    assert runner.plan_source.endswith("|llama:test|M8192")
    runner.prepare("llama:test", 16384, device="gpu-x")       # no plan at 16384: the nearest (8192)
    assert runner.plan["gate_up"] == Choice(cfg, "m", 4) and runner.plan_source.endswith("|M8192")
    runner.prepare("llama:none", 16384, device="gpu-x")
    assert runner.plan == {"qkv": explicit} and runner.plan_source is None
    tuned = Choice(KernelConfig(tile_n=256), "n", 8)           # the tuner adopts what it stored
    runner.adopt("llama:test", 16384, "key16", {"gate_up": tuned})
    runner.prepare("llama:test", 8192, device="gpu-x")
    runner.prepare("llama:test", 16384, device="gpu-x")
    assert runner.plan == {"gate_up": tuned, "qkv": explicit} and runner.plan_source == "key16"
    store_plan("llama:bad", torch.bfloat16, 8192, {"sites": {"x": {"config": "nonsense"}}}, tmp_path, device="gpu-x")
    assert load_plan("llama:bad", torch.bfloat16, 8192, tmp_path, device="gpu-x") is None


def test_a_shape_without_a_plan_takes_the_nearest_m_buckets_plan(tmp_path, monkeypatch):
    """Tuned at 8192 and 16384 tokens (one locally, one shipped): 4096 and 12288 tokens get the
    8192 / 16384 plan, 65536 the 16384 one; between two equally near buckets the larger wins;
    another model width, dtype or GPU gets none, and a corrupt neighbour is skipped."""
    from coda_cutlass.config import KernelConfig
    from coda_cutlass.nn import plan_store
    from coda_cutlass.nn.plan_store import Choice, find_plan, load_plan, plan_key, store_plan
    small, big = Choice(KernelConfig(), "m", 2), Choice(KernelConfig(tile_n=256), "n", 8)
    store_plan("llama:w", torch.bfloat16, 8192, {"sites": {"o": small.to_json()}}, tmp_path, device="gpu-x")
    shipped = {plan_key("llama:w", torch.bfloat16, 16384, "gpu-x"): {"sites": {"o": big.to_json()}},
               plan_key("llama:w", torch.bfloat16, 1 << 20, "gpu-x"): {"sites": "corrupt"}}
    monkeypatch.setattr(plan_store, "shipped_plans", lambda: shipped)

    def site_o(M, **kw):
        plan = load_plan("llama:w", torch.bfloat16, M, tmp_path, device="gpu-x", **kw)
        return None if plan is None else plan["o"]
    assert site_o(8192) == small and site_o(16384) == big
    assert site_o(4096) == small and site_o(128) == small
    assert site_o(12288) == big                     # bucket 16384: exact
    assert site_o(65536) == big                     # the corrupt 2^20 record is not a candidate
    assert site_o(4096, nearest=False) is None
    assert find_plan("llama:w", torch.bfloat16, 4096, tmp_path, device="gpu-x")[0].endswith("|M8192")
    store_plan("llama:w", torch.bfloat16, 32768, {"sites": {"o": small.to_json()}}, tmp_path, device="gpu-x")
    assert site_o(65536) == small                   # now 32768 is nearer
    store_plan("llama:tie", torch.bfloat16, 8192, {"sites": {"o": small.to_json()}}, tmp_path, device="gpu-x")
    store_plan("llama:tie", torch.bfloat16, 32768, {"sites": {"o": big.to_json()}}, tmp_path, device="gpu-x")
    assert load_plan("llama:tie", torch.bfloat16, 16384, tmp_path, device="gpu-x")["o"] == big
    assert load_plan("llama:other", torch.bfloat16, 4096, tmp_path, device="gpu-x") is None
    assert load_plan("llama:w", torch.float16, 4096, tmp_path, device="gpu-x") is None
    assert load_plan("llama:w", torch.bfloat16, 4096, tmp_path, device="gpu-y") is None


def test_module_to_keeps_rope_frequencies_fp32():
    block = LlamaBlock(64, 4, 2, 96, rope_theta=10000.0, dtype=torch.float32)
    ref = block.rope_freq.clone()
    block.to(torch.bfloat16)
    assert block.qkv.dtype == torch.bfloat16
    assert block.rope_freq.dtype == torch.float32 and torch.equal(block.rope_freq, ref)
    assert block.inv_freq.dtype == torch.float32


def test_tuning_without_a_hopper_gpu_is_a_clear_error():
    import coda_cutlass as cc
    block = LlamaBlock(64, 4, 2, 96, dtype=torch.float32)
    with pytest.raises(cc.DeviceError, match="Hopper GPU"):
        block.tune(1, 8)
    model = LlamaModel(32, 64, 1, 4, 2, 96, dtype=torch.float32)
    with pytest.raises(cc.DeviceError, match="Hopper GPU"):
        model.tune(torch.randint(0, 32, (1, 8)))


def test_tuner_compares_choices_through_a_drifting_clock(monkeypatch):
    """Three configurations of one site timed while the GPU slows down 0.2% a step as it heats up
    (several percent over a tuning run on the H200). The choices are visited in a shuffled order
    and then its mirror, so every choice sees the same mean clock: B's kernel wins, and the ratios
    of the scores are exactly those of the kernels' and the steps' costs."""
    from coda_cutlass.config import KernelConfig
    from coda_cutlass.nn import tuning
    from coda_cutlass.nn.plan_store import Choice

    cost = {"a": (100.0, 1000.0), "b": (95.0, 1010.0), "c": (110.0, 990.0)}   # (site us, rest of the step us)
    choices = {name: Choice(KernelConfig(tile_n=n)) for name, n in zip(cost, (64, 128, 256))}
    by_config = {c.config.name(): name for name, c in choices.items()}

    class FakeRecorder:
        def __init__(self):
            self.times = []

        def times_us(self):
            return {"gate_up": self.times}

    runner = type("R", (), {"plan": {}, "recorder": None})()
    clock = {"steps": 0, "last": 0.0}

    def step():
        site, rest = cost[by_config[runner.plan["gate_up"].config.name()]]
        drift = 1 + 0.002 * clock["steps"]
        clock["steps"] += 1
        if runner.recorder is not None:
            runner.recorder.times.append(site * drift)
        clock["last"] = (site + rest) * drift

    monkeypatch.setattr(tuning, "Recorder", FakeRecorder)
    monkeypatch.setattr(tuning, "timed_call", lambda fn: (fn(), clock["last"])[1])
    monkeypatch.setattr(tuning, "_us", lambda t: t)
    monkeypatch.setattr(tuning, "_sync", lambda: None)
    scored = tuning.compare_choices(runner, step, "gate_up", list(choices.values()), rounds=2, iters=3, warmup=1)
    assert clock["steps"] == 2 * 3 * 4
    by_name = {by_config[s.choice.config.name()]: s for s in scored}
    assert tuning.best_choice(scored) is by_name["b"]
    assert all(len(s.visits_us) == 2 for s in scored)      # one reading per round, for the confirmation
    for name in "bc":       # the drift cancels exactly
        assert by_name[name].site_us / by_name["a"].site_us == pytest.approx(cost[name][0] / cost["a"][0])
        assert by_name[name].step_us / by_name["a"].step_us == pytest.approx(sum(cost[name]) / sum(cost["a"]))

def test_extra_configurations_join_a_sites_candidates_once():
    from coda_cutlass import epilogues as E
    from coda_cutlass.nn.tuning import Site, _site_candidates
    from coda_cutlass.tuning.space import CANDIDATES
    site = Site("o", E.residual_norm_stats, "nk", True)
    c22 = cc.KernelConfig(tile_m=128, tile_n=128, tile_k=64, cluster_m=2, cluster_n=2, schedule="pingpong")
    base = _site_candidates(site, torch.bfloat16, None, ())
    assert c22 not in base
    assert _site_candidates(site, torch.bfloat16, None, (c22, CANDIDATES[0])) == base + [c22]
    assert _site_candidates(site, torch.bfloat16, lambda s: [CANDIDATES[0]], (c22,)) == [CANDIDATES[0], c22]


def _scored(n: int, visits: tuple[float, ...]):
    from coda_cutlass.config import KernelConfig
    from coda_cutlass.nn.plan_store import Choice
    from coda_cutlass.nn.tuning import Scored
    import statistics
    return Scored(Choice(KernelConfig(tile_n=n)), 0.0, statistics.fmean(visits), visits)


def test_confirmation_keeps_the_incumbent_unless_clearly_beaten():
    """The confirmation pass's rule: a challenger replaces the incumbent only when it is faster by
    more than the margin and by more than twice the standard error of the per-round difference."""
    from coda_cutlass.nn.tuning import confirm
    inc = _scored(128, (100.0, 101.0, 100.5, 100.0))
    slight = _scored(64, (99.5, 100.4, 100.0, 99.6))         # 0.5% faster: inside the 1% margin
    assert confirm([inc, slight], 0.01)[0] is inc
    clear = _scored(256, (96.0, 97.2, 96.5, 96.1))           # 4% faster in every round
    chosen, verdict = confirm([inc, slight, clear], 0.01)
    assert chosen is clear and verdict.startswith("replaced")
    lucky = _scored(256, (80.0, 104.0, 103.0, 102.0))        # 4% faster on average, from one round
    chosen, verdict = confirm([inc, slight, lucky], 0.01)
    assert chosen is inc and "not clear" in verdict
    assert confirm([inc], 0.01) == (inc, "kept (no challenger)")
    slower = _scored(64, (110.0, 111.0, 110.0, 112.0))
    assert confirm([inc, slower], 0.0)[0] is inc


def test_confirmation_finalists_are_the_incumbent_and_the_fastest_others():
    from coda_cutlass.nn.tuning import finalists
    a, b, c, d = (_scored(n, (t,)) for n, t in ((64, 90.0), (128, 100.0), (256, 95.0), (192, 97.0)))
    assert finalists([a, b, c, d], b.choice, 2) == [b.choice, a.choice, c.choice]
    assert finalists([a, b, c, d, a], a.choice, 2) == [a.choice, c.choice, d.choice]   # no repeats
    assert finalists([a], b.choice, 3) == [b.choice, a.choice]


def fake_clock(monkeypatch, tuning, site_us, compile_many) -> None:
    """The tuner without a GPU: each launch of a site takes ``site_us(site)``, every step 1000 us,
    kernels come from ``compile_many``, plans are keyed without a device."""

    class FakeRecorder:
        def __init__(self):
            self.times: dict[str, list[float]] = {}

        def around(self, site, fn):
            fn()
            self.times.setdefault(site, []).append(site_us(site))

        def times_us(self):
            return self.times

        def medians_us(self):
            return {k: statistics.median(v) for k, v in self.times.items()}

    monkeypatch.setattr(tuning, "Recorder", FakeRecorder)
    monkeypatch.setattr(tuning, "timed_call", lambda fn: (fn(), 1000.0)[1])
    monkeypatch.setattr(tuning, "_us", lambda t: t)
    monkeypatch.setattr(tuning, "_sync", lambda: None)
    monkeypatch.setattr(tuning, "compile_many", compile_many)
    monkeypatch.setattr(tuning, "plan_key", lambda context, dtype, M: f"inseq|fake|{context}|M{M}")


def test_tuning_end_to_end_with_a_fake_clock(monkeypatch):
    """tune_in_sequence's whole flow without a GPU: kernels are stand-ins and each site's time comes
    from a table. Site "a": the other configuration is 10% faster, so the first pass picks it and
    the confirmation replaces the incumbent (the default). Site "b": the other configuration is
    only 0.5% faster (inside the 1% margin): the first pass picks it, the confirmation keeps the
    incumbent. ``only`` leaves site "c" alone."""
    from coda_cutlass import epilogues as E
    from coda_cutlass.lower.plan import default_config
    from coda_cutlass.nn import tuning
    from coda_cutlass.nn.runner import KernelRunner
    from coda_cutlass.pipeline import Options, lower_program

    default = default_config(lower_program(E.identity, Options.make(torch.bfloat16, "nk")).graph)
    other = cc.KernelConfig(tile_m=128, tile_n=256, tile_k=64, cluster_m=2, cluster_n=1)
    cost = {"a": {default.name(): 100.0, other.name(): 90.0},
            "b": {default.name(): 100.0, other.name(): 99.5},
            "c": {default.name(): 50.0, other.name(): 10.0}}
    runner = KernelRunner(torch.bfloat16)

    fake_clock(monkeypatch, tuning, lambda site: cost[site][runner.choice(site, E.identity, "nk").config.name()],
               lambda items, dtype, **kw: [lambda *a, **k: {} for _ in items])
    A = torch.empty(1)
    for cfg in (default, other):        # stand-ins already built: nothing is compiled
        runner.add_kernel(E.identity, "nk", False, cfg, lambda *a, **k: {})

    def step():
        for site in "abc":
            runner.gemm(site, E.identity, A, A)

    rec = tuning.tune_in_sequence(runner, step, context="fake", M=64, candidates=lambda s: [default, other],
                                  runtime=False, store=False, only=lambda site: site != "c")
    assert set(rec["timings"]) == set(rec["confirm"]) == {"a", "b"}
    assert rec["confirm"]["a"]["verdict"].startswith("replaced")
    assert "not clear" in rec["confirm"]["b"]["verdict"]
    assert runner.plan["a"].config == other and runner.plan["b"].config == default
    assert "c" not in runner.plan and rec["sites"].keys() == {"a", "b"}
    first_b = min(rec["timings"]["b"], key=lambda r: r["us"])
    assert first_b["config"] == other.name()        # the first pass alone would have switched b


@pytest.mark.parametrize("forward_only", [False, True])
def test_tune_module_runs_the_step_the_tuner_times(monkeypatch, forward_only):
    """What tune_module hands the tuner: a step that clears the gradients, then runs the forward and
    its backward (training) or the forward alone without autograd, whose sites are the only ones
    tuned."""
    from coda_cutlass.nn import tuning
    from coda_cutlass.nn.runner import KernelRunner
    g = torch.Generator().manual_seed(4)
    block = LlamaBlock(64, 4, 2, 96, eps=1e-5, rope_theta=10000.0, dtype=torch.float32)
    block.runner = SiteLog()
    x = torch.randn(2, 8, 64, generator=g, requires_grad=True)
    seen = {}

    def fake_tune(runner, step, *, context, M, **options):
        block.qkv.grad = torch.ones_like(block.qkv)        # a stale gradient the step must clear
        step()
        seen.update(sites=list(block.runner.sites), grad=block.qkv.grad, only=options.get("only"))
        return {}

    monkeypatch.setattr(tuning, "tune_in_sequence", fake_tune)
    tuning.tune_module(block, KernelRunner(torch.bfloat16), lambda: block(x), torch.randn_like(x),
                       context="c", M=16, forward_only=forward_only)
    assert block.qkv.grad is None                           # the tuning steps' gradients are dropped
    if forward_only:
        assert seen["grad"] is None and all(s.endswith(".infer") for s in seen["sites"])
        assert seen["only"]("gate_up.infer") and not seen["only"]("gate_up")
    else:
        assert seen["grad"] is not None and not torch.equal(seen["grad"], torch.ones_like(block.qkv))
        assert "qkv.dgrad" in seen["sites"] and seen["only"] is None


@pytest.mark.parametrize("fails", [False, True])
def test_tuning_gives_back_the_gradients_accumulated_before_it(monkeypatch, fails):
    """Gradient accumulation across a tune() call: the tuning steps' gradients are dropped and the
    accumulated ones come back, also when the tuner fails half-way."""
    from coda_cutlass.nn import tuning
    from coda_cutlass.nn.runner import KernelRunner
    block = LlamaBlock(64, 4, 2, 96, dtype=torch.float32)
    x = torch.randn(2, 8, 64, requires_grad=True)
    block(x).sum().backward()
    before = {n: p.grad.clone() for n, p in block.named_parameters()}

    def fake_tune(runner, step, *, context, M, **options):
        step()                                  # a tuning step: its own gradients
        if fails:
            raise RuntimeError("out of memory while timing")
        return {"sites": {}}

    monkeypatch.setattr(tuning, "tune_in_sequence", fake_tune)
    block.runner = SiteLog()
    call = lambda: tuning.tune_module(block, KernelRunner(torch.bfloat16), lambda: block(x),  # noqa: E731
                                      torch.randn_like(x), context="c", M=16)
    if fails:
        with pytest.raises(RuntimeError, match="out of memory"):
            call()
    else:
        call()
    for n, p in block.named_parameters():
        assert torch.equal(p.grad, before[n]), n


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_the_fused_lm_heads_softmax_is_of_the_logits_it_wrote(softcap):
    """The fused LM head's log-sum-exp is of the logits as written (bf16), so the backward's
    exp(logits - lse) sums to one per row also where one logit dominates (|logit| ~ 20, p ~ 1: a
    tied embedding scaled by sqrt(dim), as Gemma's, or any confident model). From the fp32 logits
    it was off by up to |logit| 2^-9: 6% at 20 (issue 21)."""
    from coda_cutlass.nn.functional import lm_head_programs
    g = torch.Generator().manual_seed(0)
    M, V, D = 32, 64, 32
    h = torch.randn(M, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.2
    w[:M] = h * (20.0 / (h * h).sum(1, keepdim=True))       # logit (m, m) = 20
    h, w = h.bfloat16(), w.bfloat16()
    r = torch.ones(M)
    target = torch.randint(M, V, (M,), generator=g)         # not the dominant column
    scale = torch.ones(M)
    P = lm_head_programs(softcap)
    run = ReferenceRunner(torch.bfloat16)
    f = run.gemm("lm_head.fused", P.lse_logits, h, w, r=r, target=target, **P.extra)
    assert f["D"].dtype == torch.bfloat16
    dl = run.map("lm_head.ce_grad", P.grad, f["D"], r=r, lse=f["lse"], target=target, scale=scale, **P.extra)["D"]
    z = f["D"].float().requires_grad_()                      # the logits as written
    loss = torch.nn.functional.cross_entropy(_capped(z, softcap), target, reduction="sum")
    loss.backward()
    assert (dl.float() - z.grad).abs().max() < 4e-3        # bf16 rounding of dl only (was 3.9e-2)
    assert (z.grad + torch.nn.functional.one_hot(target, V)).diagonal().min() > 0.5    # a dominant logit
    assert ((f["lse"] - f["target_logit"]).sum() - loss).abs() < 1e-4 * loss          # the loss of those logits


def _capped(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    return z if cap is None else cap * torch.tanh(z / cap)


def test_fused_lm_head_equals_the_recomputing_backward():
    """The LM head's gradients from logits written once in the forward (three vocab GEMMs) equal the
    backward that recomputes them, under a dloss other than 1 and with ignored targets."""
    torch.manual_seed(5)
    model = LlamaModel(40, 64, 1, 4, 2, 96, rope_theta=1e4, dtype=torch.float32, ce_chunk_bytes=40 * 4 * 5)
    tokens = torch.randint(0, 40, (2, 8))
    targets = torch.randint(0, 40, (2, 8))
    targets[0, :3] = -100
    grads = {}
    for fused in (True, False):
        model.zero_grad()
        model.fused_lm_head = fused
        loss = model(tokens, targets)
        (3.0 * loss).backward()
        grads[fused] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert torch.allclose(grads[True][0], grads[False][0], rtol=1e-6)
    for name, g in grads[False][1].items():
        assert rel(grads[True][1][name], g) < 1e-5, name
    model.fused_lm_head = True
    loss = model(tokens, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="handed out"):
        loss.backward()


@pytest.mark.parametrize("dtype, dloss", [(torch.bfloat16, 1 / 3), (torch.float16, 65536.0)])
def test_fused_lm_head_scales_its_gradients_by_dloss_in_fp32(dtype, dloss):
    """The fused LM head's gradients (computed for dloss = 1 in the forward) are multiplied by the
    incoming dloss in fp32 and rounded once: in the compute dtype dloss itself was rounded first
    (bf16 1/3 -> 0.333984, 0.2% on every gradient; fp16's loss scale 65536, GradScaler's default,
    -> inf)."""
    torch.manual_seed(6)
    model = LlamaModel(40, 64, 1, 4, 2, 96, rope_theta=1e4, dtype=dtype)
    tokens, targets = torch.randint(0, 40, (2, 8)), torch.randint(0, 40, (2, 8))
    grads = []
    for scale in (1.0, dloss):
        model.zero_grad()
        (model(tokens, targets) * scale).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    # only the LM head's own gradients are its products; the rest go through the blocks' backward
    for name in ("lm_head", "norm"):
        one, scaled = grads[0][name], grads[1][name]
        assert torch.isfinite(scaled).all(), name
        assert torch.equal(scaled, (one.float() * dloss).to(dtype)), name


@pytest.mark.parametrize("chunk", [7, 1 << 26])
def test_dloss_scaling_is_one_fp32_product_per_element_in_chunks_and_strided(monkeypatch, chunk):
    """The scaling by dloss itself: 16-bit gradients through fp32 chunks (any chunk size, a strided
    gradient too), fp32 ones in place; no op without a CUDA bf16 kernel (GradScaler's unscale op,
    used before, has none: the H200 raised NotImplementedError in every FP8 model's backward)."""
    from coda_cutlass.nn import model as model_mod
    monkeypatch.setattr(model_mod, "DLOSS_CHUNK", chunk)

    def no_bf16_kernel_on_cuda(*args, **kwargs):
        raise NotImplementedError("_amp_foreach_non_finite_check_and_unscale_cuda not implemented for 'BFloat16'")
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", no_bf16_kernel_on_cuda)
    torch.manual_seed(2)
    dloss = torch.tensor(1 / 3, dtype=torch.bfloat16)      # as given: 0.333984, the product in fp32
    grads = [torch.randn(5, 9, dtype=torch.bfloat16), torch.randn(9, 5, dtype=torch.bfloat16).t(),
             torch.randn(4, 3, dtype=torch.float16), torch.randn(6, dtype=torch.float32)]
    want = [(g.float() * dloss.float()).to(g.dtype) for g in grads]
    out = model_mod._scaled_by_dloss(dloss, grads)
    assert all(o is g for o, g in zip(out, grads))
    for g, w in zip(grads, want):
        assert torch.equal(g, w)


def test_dloss_scaling_runs_the_runners_map_kernel_in_place_where_it_can():
    """With the runner (the LM head's backward passes its step's), 16-bit gradients in the runner's
    dtype that a map kernel can take as a matrix (rows of a multiple of 8, contiguous) are scaled by
    its ``scale_by`` kernel in place, one pass: the fp32 chunks moved about five times the bytes (~1%
    of a 1B model's step on the H200). The rest as before; the same bits either way."""
    from coda_cutlass import epilogues as E
    from coda_cutlass.nn import ReferenceRunner
    from coda_cutlass.nn import model as model_mod

    calls = []

    class Counting(ReferenceRunner):
        in_place_maps = True          # stands in for the kernels (the interpreter itself keeps the chunks)

        def map(self, site, program, X, **kw):
            calls.append((site, program, tuple(X.shape)))
            return super().map(site, program, X, **kw)

    torch.manual_seed(3)
    dloss = torch.tensor(1 / 3, dtype=torch.float32)
    grads = [torch.randn(2, 6, 16, dtype=torch.bfloat16), torch.randn(40, 64, dtype=torch.bfloat16),
             torch.randn(5, 9, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16),
             torch.randn(16, 8, dtype=torch.bfloat16).t(), torch.randn(4, 8, dtype=torch.float16)]
    want = [(g.float() * dloss).to(g.dtype) for g in grads]
    out = model_mod._scaled_by_dloss(dloss, grads, Counting(torch.bfloat16))
    assert all(o is g for o, g in zip(out, grads))
    for g, w in zip(grads, want):
        assert torch.equal(g, w)
    assert calls == [("lm_head.dloss", E.scale_by, (12, 16)), ("lm_head.dloss", E.scale_by, (40, 64))]
    calls.clear()
    Counting.in_place_maps = False                     # the interpreter: the fp32 chunks, no map call
    model_mod._scaled_by_dloss(dloss, [torch.randn(40, 64, dtype=torch.bfloat16)], Counting(torch.bfloat16))
    assert calls == []


def test_in_sequence_tuning_of_fp8_sites_builds_fp8_candidates(monkeypatch):
    """An FP8 site (a tensorwise block's) is tuned with the FP8 candidate space, its candidates built
    with its operand format, scaling and accumulation, and handed to the runner under its FP8 key
    (so the timed launches use them; nothing else is compiled)."""
    from coda_cutlass import epilogues as E
    from coda_cutlass.nn import tuning
    from coda_cutlass.nn.runner import KernelRunner
    from coda_cutlass.tuning.space import FP8_CANDIDATES
    fp8 = (torch.float8_e4m3fn, "tensor", True)
    runner = KernelRunner(torch.bfloat16)
    built: list[dict] = []

    def fake_compile(items, dtype, **kw):
        built.extend(opts for _, opts in items)
        return [lambda *a, **k: {} for _ in items]

    fake_clock(monkeypatch, tuning, lambda site: 100.0, fake_compile)
    A = torch.empty(1)
    default = runner.choice("o.dgrad", E.identity, "nk", fp8).config
    runner.add_kernel(E.identity, "nk", False, default, lambda *a, **k: {}, fp8)

    def step():
        runner.gemm("o.dgrad", E.identity, A, A, fp8=fp8, scale_a=A, scale_b=A)

    rec = tuning.tune_in_sequence(runner, step, context="fake:fp8-tensorwise", M=64, runtime=False, store=False,
                                  confirm_rounds=0)
    assert built and all(o["dtype"] == torch.float8_e4m3fn and o["scaling"] == "tensor" and o["fast_accum"]
                         for o in built)
    fast = {c.name() for c in FP8_CANDIDATES["fast"]}
    assert {o["config"].name() for o in built} <= fast
    assert rec["sites"]["o.dgrad"]["config"]["schedule"] in ("pingpong", "cooperative")


def test_lm_head_chunks_are_whole_256_row_tiles_where_they_can_be():
    from coda_cutlass.nn.model import ce_chunk_rows
    row = 128256 * 2                                  # a bf16 row of Llama-3's logits
    assert ce_chunk_rows(1 << 30, row) == 4096        # 4186 rows fit
    assert ce_chunk_rows(256 << 20, row) == 1024      # 1046 fit
    assert ce_chunk_rows(100 * row, row) == 100       # fewer than 256: as many as fit
    assert ce_chunk_rows(1, row) == 1


def test_a_batch_with_every_target_ignored_gives_zero_loss_and_gradients():
    """As docs/NN.md says (torch's mean cross-entropy gives nan there, which would poison the weights)."""
    torch.manual_seed(7)
    model = LlamaModel(40, 64, 1, 4, 2, 96, rope_theta=1e4, dtype=torch.float32)
    for fused in (True, False):
        model.zero_grad()
        model.fused_lm_head = fused
        loss = model(torch.randint(0, 40, (2, 8)), torch.full((2, 8), -100))
        loss.backward()
        assert loss.item() == 0.0
        assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


@pytest.mark.parametrize("fp8", [None, "tensorwise", "blockwise"])
def test_an_empty_batch_gives_empty_logits_and_a_zero_loss(fp8):
    """A (0, S) batch (the last, empty shard of a dataset): logits (0, S, vocab), loss 0 with zero
    gradients, as a batch whose targets are all ignored (FP8 blocks: 0 tokens are a multiple of 128)."""
    torch.manual_seed(7)
    model = LlamaModel(256, 128, 2, 1, 1, 128, head_dim=128, fp8=fp8, dtype=torch.bfloat16)
    for shape in ((0, 128), (2, 0)):
        tok = torch.zeros(shape, dtype=torch.long)
        model.zero_grad()
        logits = model(tok)
        assert logits.shape == (*shape, 256) and logits.dtype == torch.bfloat16
        logits.float().sum().backward()
        loss, both = model(tok, tok, return_logits=True)
        assert loss.item() == 0.0 and both.shape == (*shape, 256)
        loss.backward()
        assert all(p.grad is None or not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("fp8", [None, "tensorwise"])
def test_double_backward_is_refused_not_silently_partial(fp8):
    """create_graph=True through coda's blocks and fused loss would miss the second-order terms of
    every kernel-computed gradient (a hypergradient read 9.74 where 11.09 was right): refused."""
    torch.manual_seed(0)
    m = LlamaModel(256, 128, 1, 1, 1, 128, head_dim=128, fp8=fp8, dtype=torch.float32 if fp8 is None else torch.bfloat16)
    tok = torch.randint(0, 256, (1, 128))
    k = torch.tensor(2.0, requires_grad=True)
    for params in ([m.lm_head], list(m.blocks.parameters())):
        with pytest.raises(RuntimeError, match="create_graph=True"):
            torch.autograd.grad(m(tok, tok) * k, params, create_graph=True)
    (g,) = torch.autograd.grad(m(tok, tok) * k, [m.lm_head])      # a first-order grad still works
    assert torch.isfinite(g).all()


def test_a_compiled_training_step_gives_the_eager_step():
    """torch.compile of a whole step (forward, loss, backward) on the interpreter's path: the map
    calls' program checks (cc.map_reference's) once moved its graph breaks so that an in-place write
    was replayed onto a tensor saved for the backward ("modified by an inplace operation")."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(LlamaModel(256, 128, 1, 1, 1, 256, head_dim=128, dtype=torch.bfloat16))
    eager, compiled = models

    def step(m, t):
        loss = m(t, t)
        loss.backward()
        return loss

    run = torch.compile(lambda t: step(compiled, t), backend="aot_eager")
    for s in range(2):
        t = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(s))
        assert torch.equal(step(eager, t), run(t))
        for (n, a), b in zip(eager.named_parameters(), compiled.parameters()):
            assert torch.equal(a.grad, b.grad), n
