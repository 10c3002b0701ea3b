"""In-sequence plans read from files (issue 23, item 7): a malformed record is ignored with a
warning and the runner goes on with the other plans (or the default configurations); it never
breaks a forward with a raw error. Choices validate their raster order and swizzle."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch

import coda_cutlass as cc
from coda_cutlass.config import KernelConfig
from coda_cutlass.nn import plan_store
from coda_cutlass.nn.plan_store import Choice, find_plan, plan_key, store_plan
from coda_cutlass.nn.runner import KernelRunner

GOOD = Choice(KernelConfig(), "m", 2)
GOOD_CONFIG = KernelConfig().build_key
INF = float("inf")

MALFORMED_SITES = {
    "tile_m 999": {"config": {**GOOD_CONFIG, "tile_m": 999}},
    "tile_m '128'": {"config": {**GOOD_CONFIG, "tile_m": "128"}},
    "tile_m true": {"config": {**GOOD_CONFIG, "tile_m": True}},
    "tile_m Infinity": {"config": {**GOOD_CONFIG, "tile_m": INF}},
    "swizzle Infinity": {"config": GOOD_CONFIG, "swizzle": INF},
    "swizzle 3": {"config": GOOD_CONFIG, "swizzle": 3},
    "swizzle true": {"config": GOOD_CONFIG, "swizzle": True},
    "raster bogus": {"config": GOOD_CONFIG, "raster": "bogus"},
    "raster list": {"config": GOOD_CONFIG, "raster": ["m"]},
    "raster null": {"config": GOOD_CONFIG, "raster": None},
    "config null": {"config": None},
    "config unknown field": {"config": {**GOOD_CONFIG, "warp": 4}},
    "no config": {"raster": "m"},
    "choice a list": ["m", 2],
}


@pytest.mark.parametrize("what", sorted(MALFORMED_SITES))
def test_a_malformed_plan_record_is_ignored_with_a_warning(tmp_path, what):
    """The runner skips the malformed record (warning with its key) and takes the nearest good
    plan, as if the bad one were not there."""
    store_plan("llama:p", torch.bfloat16, 8192, {"sites": {"o": MALFORMED_SITES[what]}}, tmp_path, device="gpu")
    store_plan("llama:p", torch.bfloat16, 4096, {"sites": {"o": GOOD.to_json()}}, tmp_path, device="gpu")
    runner = KernelRunner(torch.bfloat16, cache_dir=tmp_path)
    with pytest.warns(RuntimeWarning, match=r"ignoring the malformed in-sequence plan .*M8192.*site 'o'"):
        runner.prepare("llama:p", 8192, device="gpu")
    assert runner.plan == {"o": GOOD} and runner.plan_source.endswith("|M4096")


@pytest.mark.parametrize("record", [None, [], "sites", {"sites": ["o"]}, {"sites": None}, {"other": {}}])
def test_a_record_that_is_not_a_plan_is_ignored(tmp_path, record):
    key = plan_key("llama:q", torch.bfloat16, 8192, "gpu")
    shipped = {key: record} if record is not None else {}
    with mock.patch.object(plan_store, "shipped_plans", lambda: shipped), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert find_plan("llama:q", torch.bfloat16, 8192, tmp_path, device="gpu") is None
    assert record is None or any("ignoring the malformed" in str(x.message) for x in w)


def test_neighbour_keys_whose_bucket_is_not_a_number_are_skipped(tmp_path, monkeypatch):
    """Keys of the same context whose M bucket is 5000 digits, not ASCII digits or empty are
    skipped with a warning; the good neighbour is found."""
    prefix = plan_key("llama:n", torch.bfloat16, 128, "gpu")[:-len("128")]
    shipped = {prefix + "9" * 5000: {"sites": {"o": GOOD.to_json()}},
               prefix + "\u0663\u0662": {"sites": {"o": GOOD.to_json()}},      # Arabic-Indic digits
               prefix: {"sites": {"o": GOOD.to_json()}},
               prefix + "2048": {"sites": {"o": GOOD.to_json()}}}
    monkeypatch.setattr(plan_store, "shipped_plans", lambda: shipped)
    with pytest.warns(RuntimeWarning, match="M bucket is not a number"):
        found = find_plan("llama:n", torch.bfloat16, 8192, tmp_path, device="gpu")
    assert found is not None and found[0] == prefix + "2048" and found[1] == {"o": GOOD}


def test_a_choice_validates_its_raster_and_swizzle():
    for raster, swizzle, field in (("bogus", 1, "raster"), (None, 1, "raster"), ("m", 3, "swizzle"),
                                   ("m", True, "swizzle"), ("m", 2.0, "swizzle"), ("m", INF, "swizzle")):
        with pytest.raises(cc.ConfigError, match=f"Choice {field}"):
            Choice(KernelConfig(), raster, swizzle)
    with pytest.raises(cc.ConfigError, match="KernelConfig"):
        Choice("128x128x64_c1x2_pingpong")
    assert Choice.from_json(GOOD.to_json()) == GOOD


@pytest.mark.parametrize("bad", [None, 5, "128x128", ["tile_m"], {"tile_m": 999}, {"warp": 4},
                                 {"epilogue_tile": 7}, {"tile_n": float("nan")}])
def test_kernel_config_from_dict_rejects_what_is_not_a_config(bad):
    with pytest.raises(cc.ConfigError):
        KernelConfig.from_dict(bad)


@pytest.mark.parametrize("name", ["9" * 5000 + "x128x64_c1x2_pingpong", "128x128x64_c1x2_pingpong_e64x" + "6" * 4400,
                                  "\u0661\u0662\u0668x128x64_c1x2_pingpong", None, 128])
def test_kernel_config_from_name_rejects_huge_or_foreign_numbers(name):
    with pytest.raises(cc.ConfigError, match="out of range|expected MxNxK"):
        KernelConfig.from_name(name)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "blockwise_g16"])
@pytest.mark.parametrize("dims", [dict(dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336),
                                  dict(dim=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672)], ids=["8b", "70b"])
def test_the_shipped_h200_plans_cover_the_fp8_blocks_every_site(recipe, dims, tmp_path):
    """The FP8 blocks' tuned H200 plans (their own context, ...:fp8-RECIPE) are found for an H200 and
    parse, with a choice for every GEMM site the recipe launches in a middle block's step."""
    from coda_cutlass.nn import LlamaBlock
    from coda_cutlass.nn.fp8 import RECIPES
    from coda_cutlass.nn.fp8.kernels import gemm_sites
    block = LlamaBlock(**dims, head_dim=128, fp8=recipe, device="meta", dtype=torch.bfloat16)
    found = find_plan(block.context(), torch.bfloat16, 8192, tmp_path, device="NVIDIA H200|sm90|cuda13.0")
    assert found is not None and found[0].endswith(f":fp8-{recipe}|M8192")
    middle = set(gemm_sites(RECIPES[recipe])) - {"down.to_bf16", "down.last"}    # the last block's variants
    assert middle <= set(found[1]), middle - set(found[1])


def test_plan_prebuild_lists_every_launch_with_the_shipped_plans_configuration():
    """scripts/plan_prebuild.py (kernels for a GPU run, built ahead on a machine without one): the
    launches of a small model's step, each with the configuration of the shipped H200 plan of the
    real widths, which is what a KernelRunner there picks."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "scripts" / "plan_prebuild.py"
    spec = importlib.util.spec_from_file_location("plan_prebuild", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rec = mod.launches("blockwise")
    sites = [k[0] for k in rec.gemms]           # a site may run other programs in other blocks
    assert {"qkv", "o", "gate_up", "down", "down.dgrad", "gate_up.wgrad", "lm_head.fused"} <= set(sites)
    items = list(zip(sites, mod.items_for("8b", "blockwise", 8192, rec)))
    key = plan_key(mod.context("8b", "blockwise"), torch.bfloat16, 8192, mod.DEVICE)
    _, shipped = find_plan(mod.context("8b", "blockwise"), torch.bfloat16, 8192, device=mod.DEVICE)
    assert key in plan_store.shipped_plans()
    assert any(p.name == "swiglu_backward_scaled" and o["scaling"] == "block" and o["partial_reductions"]
               for site, (p, o) in items if site == "down.dgrad")
    for site, (_, o) in items:
        if site in shipped:
            assert o["config"] == shipped[site].config, site
    # --gpu-tests: the nn GPU tests' models in bf16 and fp16, each kernel in its dtype, default configs
    nn16 = mod.nn_test_launches()
    assert [r.dtype for r in nn16] == [torch.bfloat16, torch.float16]
    for rec in nn16:
        got = mod.default_items(rec)
        assert got and all(o["dtype"] == rec.dtype for _, o in got)
        assert any(k[0].endswith(".infer") for k in rec.gemms)      # the forward without autograd too
        assert all(dtype == rec.dtype for _, _, dtype in rec.maps)


def test_a_gpu_without_plans_takes_those_tuned_on_another_gpu_of_its_architecture(tmp_path, monkeypatch, capsys):
    """An H100 has no shipped plans: it takes the H200's (same sm90) for the same widths and dtype,
    its exact M bucket before the nearest, its own GPU's plans (any bucket) before another's, the same
    CUDA before another; never another architecture's, another dtype's or another model's; and the
    runner says once which GPU's plan it uses."""
    from coda_cutlass.nn import runner as runner_mod
    h100, h200 = "NVIDIA H100 80GB HBM3|sm90|cuda13.0", "NVIDIA H200|sm90|cuda13.0"
    a, b, c, d = (Choice(KernelConfig(tile_n=n), "m", s) for n, s in ((128, 1), (256, 2), (64, 4), (128, 8)))

    def rec(choice):
        return {"sites": {"o": choice.to_json()}}
    shipped = {plan_key("llama:w", torch.bfloat16, 8192, h200): rec(a),
               plan_key("llama:w", torch.bfloat16, 16384, h200): rec(b),
               plan_key("llama:w", torch.bfloat16, 8192, "NVIDIA H200|sm90|cuda12.8"): rec(d),
               plan_key("llama:w", torch.bfloat16, 8192, "NVIDIA B200|sm100|cuda13.0"): rec(c),
               plan_key("llama:x", torch.bfloat16, 8192, "NVIDIA B200|sm100|cuda13.0"): rec(c)}
    monkeypatch.setattr(plan_store, "shipped_plans", lambda: shipped)

    def found(context, M, device=h100, dtype=torch.bfloat16, **kw):
        f = find_plan(context, dtype, M, tmp_path, device=device, **kw)
        return None if f is None else (plan_store.tuned_on(f[0]), f[1]["o"])
    assert found("llama:w", 8192) == (h200, a)                 # the same CUDA's H200 plan, exact bucket
    assert found("llama:w", 16384) == (h200, b)
    assert found("llama:w", 4096) == (h200, a)                 # nearest bucket
    assert found("llama:w", 8192, device="NVIDIA H100 80GB HBM3|sm90|cuda12.8") == ("NVIDIA H200|sm90|cuda12.8", d)
    assert found("llama:w", 8192, nearest=False) is None       # exact key only
    assert found("llama:x", 8192) is None                      # only another architecture's
    assert found("llama:w", 8192, dtype=torch.float16) is None
    assert found("llama:w", 8192, device="gpu-x") is None      # a tag of unknown architecture: its own plans only
    store_plan("llama:w", torch.bfloat16, 32768, rec(c), tmp_path, device=h100)
    assert found("llama:w", 8192) == (h100, c)                 # its own GPU's plan, even of a farther bucket
    monkeypatch.setattr(runner_mod, "_BORROWED", set())
    for _ in range(2):
        r = KernelRunner(torch.bfloat16, cache_dir=tmp_path, verbose=True)
        r.prepare("llama:w", 16384, device="NVIDIA H100 80GB HBM3|sm90|cuda12.8")
        assert r.plan["o"] == d and "NVIDIA H200|sm90|cuda12.8" in r.plan_source
    err = capsys.readouterr().err
    assert err.count("using the one tuned on NVIDIA H200|sm90|cuda12.8") == 1, err
    assert ("no in-sequence plan tuned on this GPU (NVIDIA H100 80GB HBM3|sm90|cuda12.8) at M = 16384 tokens for "
            "llama:w: using the one tuned on NVIDIA H200|sm90|cuda12.8 at M = 8192") in err, err
    # this GPU's own plan of another M bucket: said once too (its weight gradients' K is the token count)
    for _ in range(2):
        KernelRunner(torch.bfloat16, cache_dir=tmp_path, verbose=True).prepare("llama:w", 8192, device=h100)
    err = capsys.readouterr().err
    assert err.count("no in-sequence plan tuned at M = 8192 tokens for llama:w: using the one tuned at M = 32768 "
                     "(model.tune()") == 1, err
