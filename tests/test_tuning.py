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


# ---------------------------------------------------------------- issue 23 (LOW): errors at the boundary
def test_a_tuned_epilogue_called_with_cpu_tensors_is_a_clear_error(fake_nvcc):
    """It raised AssertionError ('Torch not compiled with CUDA') from the tuning key's GPU lookup."""
    k = cc.compile_epilogue(_stats(), torch.bfloat16, config="tune")
    A, W = torch.randn(8, 16).bfloat16(), torch.randn(24, 16).bfloat16()
    ops = {"resid": torch.randn(8, 24).bfloat16(), "g": torch.randn(24).bfloat16()}
    expected = (cc.CallError, "must be tensors on a CUDA GPU") if torch.cuda.is_available() else \
        (cc.DeviceError, "no CUDA GPU is available. config='tune' builds its kernels when first called")
    with pytest.raises(expected[0], match=expected[1]):
        k(A, W, **ops)
    with pytest.raises(cc.CodaError):
        k("A", W, **ops)


@pytest.mark.parametrize("bad", [{"tile_m": 999}, {"raster": "bogus"}, {"swizzle": 3}, {"swizzle": True},
                                 {"config": {"tile_m": "128"}}])
def test_a_malformed_stored_choice_is_tuned_again(fake_nvcc, monkeypatch, bad):
    from coda_cutlass.tuning import tuner
    monkeypatch.setattr(tuner, "device_tag", lambda device=None: "gpu")
    monkeypatch.setenv("CODA_CUTLASS_AUTOTUNE", "0")       # "tuned again": the default, without a GPU
    k = cc.compile_epilogue(_stats(), torch.bfloat16, config="tune")
    A, W = torch.empty(8, 16), torch.empty(24, 16)
    rec = {"config": CANDIDATES[1].build_key, "raster": "n", "swizzle": 4}
    if "config" in bad:
        rec["config"] = {**rec["config"], **bad["config"]}
    elif "tile_m" in bad:
        rec["config"] = {**rec["config"], "tile_m": 999}
    else:
        rec.update(bad)
    k.store.put(k.key(8, 24, 16, None), rec)
    with pytest.warns(RuntimeWarning, match="ignoring the malformed tuning record"):
        got = k.choice(A, W)
    assert got["tuned"] is False and cc.KernelConfig.from_dict(got["config"]) == k.default


@pytest.mark.parametrize("items", [[("p", "str")], [("p", {}, 3)], [("p",)]])
def test_compile_many_names_a_malformed_item(items):
    prog = _stats()
    items = [tuple(prog if x == "p" else x for x in item) for item in items]
    with pytest.raises(cc.ConfigError, match="compile_many item 0: expected a program or a \\(program, options"):
        cc.compile_many(items)


def test_compile_many_names_a_bare_program_and_takes_list_pairs():
    """compile_many(prog) raised Python's "'EpilogueProgram' object is not iterable", and a
    [program, options] list (as PREBUILD takes) "unhashable type: 'list'"."""
    prog = _stats()
    with pytest.raises(cc.ArgumentError, match=r"a list of programs .*got EpilogueProgram; for one program: "
                                               r"compile_many\(\[program\]\)"):
        cc.compile_many(prog)
    with pytest.raises(cc.ArgumentError, match="a list of programs .*got str"):
        cc.compile_many("stats")
    with pytest.raises(cc.ArgumentError, match=r"compile_many item 0 .*unknown options \['dtpe'\]"):
        cc.compile_many([[prog, {"dtpe": torch.float16}]])      # taken as a pair: its options are read
