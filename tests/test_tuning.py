"""Autotuning pieces that need no GPU: the candidate space and its pruning, the default heuristic,
the tuning store."""

from __future__ import annotations

import json

import pytest

import torch

import coda_cutlass as cc
from coda_cutlass.config import DEFAULT
from coda_cutlass.lower.plan import FALLBACKS, default_config
from coda_cutlass.lower.smem import check_fits, estimate_stages
from coda_cutlass.pipeline import Options, generate, lower_program
from coda_cutlass.tuning.space import CANDIDATES, candidate_configs
from coda_cutlass.tuning.store import TuningStore, m_bucket


def graph(prog):
    return lower_program(prog, Options.make(torch.bfloat16)).graph


def test_stage_estimate_matches_measured_facts():
    """docs/GPU.md: the EVT's smem takes the 128x256 mainloop from 4 stages to 3."""
    ident = graph(cc.epilogue(lambda acc: acc, name="i"))
    stats = graph(_stats())
    assert estimate_stages(CANDIDATES[0], ident) == 4
    assert estimate_stages(CANDIDATES[0], stats) == 3


def _stats():
    @cc.epilogue
    def stats(acc, resid: cc.Tile, g: cc.PerCol):
        x = acc + resid
        return {"D": x, "h": x * g, "sumsq": cc.row_sum(x * x)}
    return stats


def test_heavy_epilogues_prune_big_tiles():
    @cc.epilogue
    def heavy(acc, a: cc.Tile, b: cc.Tile, c: cc.Tile, d: cc.Tile):
        x = acc + a + b + c + d
        return {"D": x, "o1": x * 2.0, "o2": x * 3.0, "o3": x * 4.0, "o4": x * 5.0, "o5": x * 6.0}
    g = graph(heavy)
    cands = candidate_configs(g)
    assert cands and all(estimate_stages(c, g) >= 2 for c in cands)
    assert len(cands) < len(CANDIDATES)
    d = default_config(g)
    assert estimate_stages(d, g) >= 2
    assert d == DEFAULT or d in FALLBACKS


def test_default_for_light_epilogues_is_the_measured_best_family():
    assert default_config(graph(_stats())) == DEFAULT == cc.KernelConfig(
        tile_m=128, tile_n=128, tile_k=64, cluster_m=1, cluster_n=2, schedule="pingpong")


def test_m_buckets():
    assert [m_bucket(m) for m in (1, 128, 129, 8192, 9000, 16384)] == [128, 128, 256, 8192, 16384, 16384]


def test_store_round_trip(tmp_path):
    s = TuningStore(tmp_path)
    assert s.get("k") is None
    s.put("k", {"config": CANDIDATES[1].build_key, "raster": "n", "swizzle": 4})
    s.put("k2", {"x": 1})
    assert TuningStore(tmp_path).get("k")["raster"] == "n"
    assert set(json.loads((tmp_path / "tuning.json").read_text())) == {"k", "k2"}
    assert cc.KernelConfig.from_dict(s.get("k")["config"]) == CANDIDATES[1]


def test_tune_config_returns_a_tuned_epilogue(fake_nvcc):
    from coda_cutlass.tuning import TunedEpilogue
    k = cc.compile_epilogue(_stats(), torch.bfloat16, config="tune")
    assert isinstance(k, TunedEpilogue) and k.candidates
    assert "TunedEpilogue" in repr(k)


def test_programs_too_heavy_for_the_default_get_a_smaller_tile_or_a_clear_error():
    @cc.epilogue
    def fp32_heavy(acc, a: cc.Tile, b: cc.Tile, m: cc.Tile, r: cc.PerRow):
        x = acc + a + b + m * r
        return {"D": x, "t0": x * 2.0, "t1": x * 3.0}
    opts = Options.make(torch.bfloat16, input_dtypes={"m": torch.float32},
                        output_dtypes={"t0": torch.float32, "t1": torch.float16})
    lo = generate(lower_program(fp32_heavy, opts))   # found by the fuzzer: cooperative 128x128x64 left 1 stage
    assert estimate_stages(lo.options.config, lo.graph) >= 2 and lo.options.config in (DEFAULT, *FALLBACKS)
    with pytest.raises(cc.ConfigError, match="shared memory"):
        check_fits(CANDIDATES[0], lo.graph)
    with pytest.raises(cc.ConfigError, match="shared memory"):
        generate(lower_program(fp32_heavy, Options.make(torch.bfloat16, config=CANDIDATES[0],
                                                        input_dtypes={"m": torch.float32},
                                                        output_dtypes={"t0": torch.float32, "t1": torch.float16})))

    @cc.epilogue
    def impossible(acc, a: cc.Tile, b: cc.Tile, c: cc.Tile, d: cc.Tile):
        x = acc + a + b + c + d
        return {"D": x, "o1": x, "o2": x * 2.0, "o3": x * 3.0, "o4": x * 4.0, "o5": x * 5.0, "o6": x * 6.0}
    f32 = {n: torch.float32 for n in "abcd"}
    with pytest.raises(cc.EpilogueError, match="shared memory"):
        generate(lower_program(impossible, Options.make(torch.bfloat16, input_dtypes=f32,
                                                        output_dtypes={f"o{i}": torch.float32 for i in range(1, 7)})))


def test_refinement_retimes_the_best_variant_of_every_configuration():
    from coda_cutlass.tuning.tuner import refinement_leaders
    a, b, c = ({"tile_n": n} for n in (256, 128, 64))
    timings = [{"config": a, "raster": "m", "swizzle": s, "us": 100.0 + s} for s in (1, 2, 4, 8)]
    timings += [{"config": b, "raster": r, "swizzle": 1, "us": u} for r, u in (("m", 130.0), ("n", 120.0))]
    timings += [{"config": c, "raster": "n", "swizzle": 2, "us": 150.0}]
    leaders = refinement_leaders(timings, 4)
    # the 4 fastest (all variants of a), then the fastest variant of b and of c
    assert [t["us"] for t in leaders] == [101.0, 102.0, 104.0, 108.0, 120.0, 150.0]
    assert len(refinement_leaders(timings, 10)) == len(timings)


def test_a_program_is_lowered_once_however_many_configs(fake_nvcc, monkeypatch):
    """Tracing, the passes and lowering run once per program and options; each configuration only
    plans, renders and builds (candidate expansion, compile_many, the autotuner's kernels)."""
    from coda_cutlass.api import with_candidate_configs
    from coda_cutlass.frontend.trace import EpilogueProgram
    traces = []
    real = EpilogueProgram.trace
    monkeypatch.setattr(EpilogueProgram, "trace", lambda self, c=None: traces.append(self.name) or real(self, c))
    prog = _stats()
    items = with_candidate_configs([(prog, {"dtype": torch.bfloat16})])
    assert traces == ["stats"] and len(items) == len(CANDIDATES)
    traces.clear()
    kernels = cc.compile_many(items, jobs=2)
    assert traces == ["stats"] and [k.config for k in kernels] == [o["config"] for _, o in items]
    traces.clear()
    tuned = cc.compile_epilogue(prog, torch.bfloat16, config="tune")
    assert [tuned.kernel(c).config for c in tuned.candidates[:3]] == tuned.candidates[:3]
    assert traces == ["stats"]
