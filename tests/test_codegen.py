"""Code generation: every catalogue program renders; the generated CUDA has the expected visitor
nodes, host ABI and safety properties. No compiler runs here."""

from __future__ import annotations

import json
import re

import pytest
import torch

import coda_cutlass as cc
from catalog import CASES, compile_options
from coda_cutlass.ir.printer import node_text
from coda_cutlass.lower.kinds import float_literal
from coda_cutlass.pipeline import Options, generate, lower_program

EMIT_KEYS = ("dtype", "weight_layout", "config", "input_dtypes", "output_dtypes", "constants")


def lowered(case):
    opts = {k: v for k, v in compile_options(case).items() if k in EMIT_KEYS}
    return generate(lower_program(case.program, Options.make(**opts)))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_program_renders(case):
    lo = lowered(case)
    src = lo.source
    n = len(lo.graph.nodes)
    # one visitor node per IR node (the D store replaces its IR node), declared and wired in order
    assert len(re.findall(r"^using Node\d+ = ", src, re.M)) == n
    assert src.count("// Node") >= 2 * n
    assert "Sm90TopologicalVisitor" in src
    assert "-DNDEBUG" not in src  # flags live in the build, not the source
    # the ABI description embedded in the .so matches the lowering
    m = re.search(r'kDescription\[\] = "(.*)";', src)
    desc = json.loads(m.group(1).encode().decode("unicode_escape"))
    assert desc == json.loads(json.dumps(lo.plan.describe()))
    # every IR node appears as a comment
    for node in lo.ir.nodes:
        assert node_text(node) in src


def test_node_kinds_map_to_cutlass_names():
    """CUTLASS names are inverted: per-row vectors/reductions are *Col* nodes."""
    @cc.epilogue
    def p(acc, t: cc.Tile, t2: cc.Tile, r: cc.PerRow, c: cc.PerCol, s: cc.Scalar):
        x = acc * r + c * s + t + t2
        return {"D": x, "aux": x * 2.0, "rs": cc.row_sum(x), "cs": cc.col_max(x)}
    src = cc.emit(p)
    assert "Sm90SrcFetch<ElementC>" in src                       # first tile input: the C load
    assert re.search(r"Sm90AuxLoad<\s*AuxLoadDesc", src)          # second tile input
    assert "Sm90ColBroadcast<0, TileShape, cutlass::bfloat16_t, ElementCompute, StridePerRow>" in src
    assert "Sm90RowBroadcast<0, TileShape, cutlass::bfloat16_t, ElementCompute, StridePerCol>" in src
    assert "Sm90ScalarBroadcast<ElementCompute, StrideScalar>" in src
    assert "coda::ColumnCheckedRowReduction<cutlass::plus, TileShape, StridePerRow, RoundStyle>" in src   # row_sum
    assert re.search(r"Sm90RowReduction<\s*cutlass::maximum", src)  # col_max
    assert "/*FinalReduction=*/false" in src
    assert "Sm90AuxStore<" in src
    assert "Sm90Compute<coda::identity, ElementD" in src


@pytest.mark.parametrize("op,functor", [
    ("exp", "coda::exp_fast"), ("log", "coda::log"), ("sqrt", "coda::sqrt"), ("rsqrt", "coda::rsqrt"),
    ("reciprocal", "coda::reciprocal"), ("tanh", "coda::tanh"), ("sigmoid", "coda::sigmoid_fast"),
    ("silu", "coda::silu_fast"), ("relu", "coda::relu"), ("square", "coda::square"), ("abs", "coda::abs"),
])
def test_unary_ops_render_their_functor(op, functor):
    fn = getattr(cc, op)
    src = cc.emit(cc.epilogue(lambda acc: fn(acc), name=f"u_{op}"))
    assert f"Sm90Compute<{functor}, float, ElementCompute, RoundStyle>" in src


def test_functors_exist_in_header():
    from coda_cutlass.ir.ops import OPS, PACK_OPS, PAIR_OPS
    from coda_cutlass.paths import include_dir
    coda = include_dir() / "coda"
    base = (coda / "functors.hpp").read_text()
    pairwise = (coda / "pairwise.hpp").read_text() + (coda / "rotate.hpp").read_text()
    for op in OPS.values():
        if op.name == "pair_rotate":   # lowered to its own node, not a functor
            assert "struct PairRotate" in pairwise
        elif op.name in PAIR_OPS:
            assert f"struct {op.functor}<cutlass::Array<T, N>>" in pairwise, op.name
        elif op.name in PACK_OPS:
            assert f"template <class T> struct {op.functor};" in pairwise, op.name
        elif op.header:   # functors added later live in their own headers
            extra = (include_dir() / op.header).read_text()
            assert f"template <class T> struct {op.functor} : Elementwise<scalar::{op.functor}, T>" in extra, op.name
        else:
            assert f"CODA_ELEMENTWISE({op.functor})" in base, op.name


def test_cast_rounds_through_node_element_type():
    src = cc.emit(cc.epilogue(lambda acc: cc.cast(acc, torch.float16) * 2.0, name="c"))
    assert "Sm90Compute<coda::identity, cutlass::half_t, ElementCompute, RoundStyle>" in src


def test_weight_layouts_and_dtypes():
    p = cc.epilogue(lambda acc: acc, name="ident")
    nk = cc.emit(p)
    kn = cc.emit(p, weight_layout="kn")
    fp16 = cc.emit(p, torch.float16)
    assert "LayoutB = cutlass::layout::ColumnMajor" in nk
    assert "LayoutB = cutlass::layout::RowMajor" in kn
    assert "using ElementA = cutlass::half_t;" in fp16
    with pytest.raises(cc.EpilogueError, match="weight_layout"):
        cc.emit(p, weight_layout="nn")
    with pytest.raises(cc.ConfigError, match="operand dtype"):
        cc.emit(p, torch.float32)


def test_no_tile_output_makes_D_void():
    src = cc.emit(cc.epilogue(lambda acc: {"s": cc.row_sum(acc)}, name="r"))
    assert "using ElementD = void;" in src and "coda::TopologicalVisitorNoD" in src


def test_accumulated_D_reads_and_writes_the_same_slot():
    @cc.epilogue
    def p(acc):
        return {"D": cc.accumulate(acc)}
    lo = lower_program(p, Options.make(torch.bfloat16))
    assert lo.graph.c_slot == lo.graph.d_slot == 0
    assert lo.graph.tensors[0].role == "inout"


def test_config_in_source():
    cfg = cc.KernelConfig(tile_m=128, tile_n=128, tile_k=64, cluster_m=1, cluster_n=2, schedule="cooperative")
    src = cc.emit(cc.epilogue(lambda acc: acc, name="i"), config=cfg)
    assert "Shape<_128, _128, _64>" in src and "Shape<_1, _2, _1>" in src


def test_bad_configs_are_rejected_before_compiling():
    with pytest.raises(cc.ConfigError, match="tile_m"):
        cc.KernelConfig(tile_m=64, schedule="cooperative")
    with pytest.raises(cc.ConfigError, match="cluster"):
        cc.KernelConfig(cluster_m=3)
    with pytest.raises(cc.ConfigError, match="schedule"):
        cc.KernelConfig(schedule="fast")


@pytest.mark.parametrize("name", ["128x128x64_c1x2_pingpong", "256x192x64_c2x1_cooperative",
                                  "128x256x64_c2x1_cooperative_streamk", "128x128x64_c1x2_pingpong_e64x64",
                                  "128x256x64_c2x1_cooperative_streamk_e128x32"])
def test_config_names_round_trip(name):
    assert cc.KernelConfig.from_name(name).name() == name


def test_a_config_name_keeps_its_epilogue_subtile_and_scheduler():
    c = cc.KernelConfig.from_name("128x256x64_c2x1_cooperative_streamk_e128x32")
    assert (c.scheduler, c.epilogue_tile, c.cluster_m, c.cluster_n) == ("streamk", (128, 32), 2, 1)


@pytest.mark.parametrize("bad", ["default", "128x128_c1x2_pingpong", "128x128x64_pingpong",
                                 "128x128x64_c1x2_pingpong_e64", "128x128x64_c1x2_pingpong extra"])
def test_a_malformed_config_name_is_a_clear_error(bad):
    with pytest.raises(cc.ConfigError, match="expected MxNxK_cMxN_SCHEDULE"):
        cc.KernelConfig.from_name(bad)


def test_a_config_name_with_unsupported_values_is_refused_like_the_fields():
    with pytest.raises(cc.ConfigError, match="schedule"):
        cc.KernelConfig.from_name("128x128x64_c1x2_fast")


def test_user_strings_never_become_identifiers():
    """Only generated names reach C++ as code; user names appear in comments, sanitised."""
    evil = 'x */ #include "/etc/passwd"\nint main'
    p = cc.epilogue(lambda acc, weird_operand_name=1.0: acc * weird_operand_name, name=evil)
    src = cc.emit(p)
    for line in src.splitlines():
        if "etc/passwd" in line or "int main" in line:
            assert line.lstrip().startswith("//") or line.startswith("static const char kDescription")
    idents = set(re.findall(r"\busing (\w+) =", src))
    assert all(re.fullmatch(r"(Node|AuxLoadDesc|AuxStoreDesc)\d+|[A-Z]\w*", i) for i in idents)


@pytest.mark.parametrize("value,text", [(1.0, "1.0f"), (0.5, "0.5f"), (1e-6, "9.99999997e-07f"),
                                        (float("inf"), "cutlass::platform::numeric_limits<float>::infinity()"),
                                        (-3.0, "-3.0f")])
def test_float_literals_round_trip_fp32(value, text):
    assert float_literal(value) == text


def test_emit_is_deterministic():
    case = CASES[2]
    assert lowered(case).source == lowered(case).source


def test_description_round_trips_through_json_with_an_epilogue_tile():
    """The loaded library's description (parsed JSON) must equal graph.describe() for every config,
    including tuple-valued fields such as an explicit epilogue tile."""
    cfg = cc.KernelConfig(tile_m=128, tile_n=256, tile_k=64, cluster_m=2, cluster_n=1, epilogue_tile=(128, 64))
    gen = generate(lower_program(CASES[0].program, Options.make(torch.bfloat16, config=cfg)))
    m = re.search(r'kDescription\[\] = "(.*)";', gen.source)
    embedded = json.loads(m.group(1).encode().decode("unicode_escape"))
    assert embedded == gen.plan.describe()


def test_total_max_and_min_are_per_tile_row_partials():
    @cc.epilogue
    def p(acc):
        return {"amax": cc.total_max(abs(acc)), "tmin": cc.total_min(acc)}
    src = cc.emit(p)
    assert "coda::ColumnCheckedRowReduction<cutlass::maximum_with_nan_propagation, TileShape" in src
    assert "coda::ColumnCheckedRowReduction<cutlass::minimum_with_nan_propagation, TileShape" in src
    assert '#include "coda/row_reduction.hpp"' in src
    assert "amax: fp32 partials of total_max" in src and "tmin: fp32 partials of total_min" in src
    assert "fp32 partials of total_max, [ceil(N / 256), M]" in cc.emit_map(p)


def test_cutlass_driver_calls_are_checked_and_the_context_bound_before_launch():
    """CUTLASS encodes TMA descriptors through the driver and only asserts on failure (compiled out
    with NDEBUG): the check header must come before every CUTLASS header so its wrapper replaces
    CUTLASS's, and the host ABI binds a context and checks the encodes before launching."""
    from coda_cutlass import epilogues as E
    from coda_cutlass.paths import templates_dir
    src = cc.emit(E.residual_add)
    first_cutlass = min(src.index('#include "cutlass/'), src.index('#include "cute/'))
    assert src.index('#include "coda/driver_check.hpp"') < first_cutlass
    check = (templates_dir() / "coda" / "driver_check.hpp").read_text()
    assert "#undef CUTLASS_CUDA_DRIVER_WRAPPER_CALL" in check and "record_driver_result" in check
    abi = (templates_dir() / "coda" / "host_abi.hpp").read_text()
    run = abi[abi.index("int run("):]
    assert run.index("ensure_context()") < run.index("gemm.initialize(")
    assert run.index("driver_error = 0") < run.index("gemm.initialize(") < run.index("return kDriverCall") \
        < run.index("gemm.run(")
