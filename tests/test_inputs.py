"""What careless or unusual input gets (issue 14): correct behaviour or a clear CodaError/TypeError
naming the program, node or argument; never a raw Python error. CPU only; builds use the fake nvcc."""

from __future__ import annotations

import functools
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import coda_cutlass as cc
from coda_cutlass.ir import format_program
from coda_cutlass.lower.kinds import float_literal
from coda_cutlass.pipeline import Options, typed_ir

INF = "cutlass::platform::numeric_limits<float>::infinity()"


def gemm_inputs(M=4, N=8, K=8):      # N, K multiples of 8: cc.reference checks them as the kernel
    g = torch.Generator().manual_seed(0)
    return torch.randn(M, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16()


# ------------------------------------------------------------------------------ 5: threads
def test_tracing_in_many_threads_gives_one_source():
    """Each thread has its own tracer stack: cc.col_index() (which finds the trace through it) never
    picks up another thread's trace, and every thread lowers to the same source."""
    @cc.epilogue
    def p(acc, b: cc.PerCol, r: cc.Tile):
        i, j = cc.col_index(), cc.row_index()
        x = cc.where(i < 8.0, acc + b, acc * 2.0) + r * j
        return {"D": x, "s": cc.row_sum(x)}

    irs, sources, errors = set(), set(), []
    start = threading.Barrier(16)

    def work():
        start.wait()
        try:
            for _ in range(40):
                irs.add(format_program(p.trace()))
            sources.add(cc.emit(p))
        except Exception as e:  # noqa: BLE001 - any failure is the test's finding
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)     # switch threads as often as possible
    try:
        threads = [threading.Thread(target=work) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    assert len(irs) == 1 and len(sources) == 1


# ------------------------------------------------------------------------------ 4: non-ASCII names
@cc.epilogue
def greek(acc, β: cc.PerCol, γ: cc.Scalar):
    return {"Dé": acc + β * γ, "σ": cc.row_sum(acc)}


def test_non_ascii_names_trace_and_emit():
    ir = greek.trace()
    assert [o.name for o in ir.operands] == ["β", "γ"] and ir.outputs == ("Dé", "σ")
    src = cc.emit(greek)
    assert src.isascii()     # names reach the source only as escaped comments/description
    A, W = gemm_inputs()
    out = cc.reference(greek, A, W, β=torch.ones(8).bfloat16(), γ=2.0)
    assert set(out) == {"Dé", "σ"}


# ------------------------------------------------------------------------------ 7: beyond fp32
@pytest.mark.parametrize("value,text", [(1e39, INF), (-1e39, "-" + INF), (1e300, INF), (3.5e38, INF),
                                        (3.4028234e38, "3.40282347e+38f"), (1e-50, "0.0f"), (-1e-50, "-0.0f")])
def test_float_literal_rounds_to_fp32_first(value, text):
    assert float_literal(value) == text


def test_constants_beyond_fp32_range_emit_valid_cpp_and_the_reference_agrees():
    @cc.epilogue
    def big(acc):
        return {"a": acc * 1e39, "b": acc ** 1e300, "c": acc * -1e39}

    src = cc.emit(big)
    assert "inf.0f" not in src and "e+39f" not in src and "e+300f" not in src
    assert src.count(f"{{{{{INF}}}, {{nullptr}}, {{}}}}") == 2 and f"-{INF}" in src
    A, W = gemm_inputs()
    acc = A.float() @ W.float().t()
    inf = torch.tensor(float("inf"))
    out = cc.reference(big, A, W, precision="fp32")
    torch.testing.assert_close(out["a"], acc * inf)              # the constant is fp32 inf, as in the kernel
    torch.testing.assert_close(out["c"], acc * -inf)
    torch.testing.assert_close(out["b"], torch.pow(acc, inf))


# ------------------------------------------------------------------------------ 8: -0.0
@pytest.mark.parametrize("order", ["negative first", "positive first"])
def test_negative_zero_stays_a_distinct_constant(order):
    @cc.epilogue
    def neg_first(acc, z: cc.Tile):
        return {"neg": 1.0 / (z + -0.0), "pos": 1.0 / (z + 0.0)}

    @cc.epilogue
    def pos_first(acc, z: cc.Tile):
        pos = 1.0 / (z + 0.0)
        return {"neg": 1.0 / (z + -0.0), "pos": pos}

    p = neg_first if order == "negative first" else pos_first
    for ir in (p.trace(), typed_ir(p, Options.make(torch.bfloat16))):     # traced, and after CSE
        zeros = sorted(str(n.attr("value")) for n in ir.nodes if n.op == "const" and n.attr("value") == 0.0)
        assert zeros == ["-0.0", "0.0"]
    src = cc.emit(p)
    assert "{{-0.0f}, {nullptr}, {}}" in src and "{{0.0f}, {nullptr}, {}}" in src
    A, W = gemm_inputs()
    z = torch.full((4, 8), -0.0, dtype=torch.bfloat16)
    out = cc.reference(p, A, W, z=z)
    assert torch.all(out["neg"] == float("-inf")) and torch.all(out["pos"] == float("inf"))


# ------------------------------------------------------------------------------ 13: names
@pytest.mark.parametrize("name", ["dtype", "precision", "weight_layout", "constants", "input_dtypes",
                                  "output_dtypes", "raster", "swizzle", "out", "A", "W"])
def test_operand_names_taken_by_call_keywords_are_refused_at_trace_time(name):
    fn = eval(f"lambda acc, {name}: acc", {})
    fn.__annotations__ = {name: cc.Tile}
    with pytest.raises(cc.EpilogueError, match=f"parameter '{name}': '{name}' is reserved"):
        cc.epilogue(fn)
    with pytest.raises(cc.EpilogueError, match=f"accumulated output '{name}'.*reserved"):
        cc.epilogue(lambda acc: {name: cc.accumulate(acc)}).trace()


@pytest.mark.parametrize("name", ["dtype", "precision", "weight_layout", "constants", "input_dtypes",
                                  "output_dtypes", "scaling"])
def test_an_accumulated_output_named_like_a_reference_option_is_named_by_the_references(name):
    """Passed by name, such an output lands on the option (which printed the whole tensor): the
    program's reserved-name check says what is wrong."""
    prog = cc.epilogue(lambda acc: {name: cc.accumulate(acc)}, name="acc_named")
    A, W = gemm_inputs()
    buf = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(cc.EpilogueError, match=f"epilogue 'acc_named': accumulated output '{name}'.*'{name}' is "
                                               "reserved"):
        cc.reference(prog, A, W, **{name: buf})
    if name not in ("weight_layout", "scaling"):
        with pytest.raises(cc.EpilogueError, match=f"accumulated output '{name}'.*reserved"):
            cc.map_reference(prog, buf, **{name: buf})
    with pytest.raises(cc.CallError, match=f"cc.reference: {name}= was given a torch.Tensor, but '{name}' is a "
                                           "keyword option of cc.reference, not an operand of 'plain'"):
        cc.reference(cc.epilogue(lambda acc: acc * 2.0, name="plain"), A, W, **{name: buf})
    with pytest.raises(cc.EpilogueError, match="accumulated output 'partial_reductions'.*cc.map_reference"):
        cc.map_reference(cc.epilogue(lambda acc: {"partial_reductions": cc.accumulate(acc)}), buf,
                         partial_reductions=buf)


def test_operands_named_self_program_and_x_reach_every_call_path(fake_nvcc):
    """self, program and X are positional-only in the calls, so they are ordinary operand names."""
    @cc.epilogue
    def names(acc, self: cc.Tile, program: cc.PerCol, X: cc.PerRow):
        return acc + self * program + X

    A, W = gemm_inputs()
    ops = {"self": torch.ones(4, 8), "program": torch.full((8,), 2.0), "X": torch.full((4,), 3.0)}
    expect = A.float() @ W.float().t() + 5.0
    torch.testing.assert_close(cc.reference(names, A, W, precision="fp32", **ops)["D"], expect)
    k = cc.compile_epilogue(names)
    torch.testing.assert_close(k.reference(A, W, precision="fp32", **ops)["D"], expect)
    with pytest.raises(cc.DeviceError):      # the call binds the operands; only then is there no GPU
        k(A, W, **ops)
    torch.testing.assert_close(cc.map_reference(names, expect, precision="fp32", **ops)["D"], expect + 5.0)


# ------------------------------------------------------------------------------ 13: programs
def test_positional_only_and_keyword_only_programs_trace():
    def f(acc, x: cc.Tile, /, y: cc.PerCol, *, scale=2.0):
        return acc + x * y * scale

    ir = cc.epilogue(f).trace()
    assert [o.name for o in ir.operands] == ["x", "y"]
    assert [n.attr("value") for n in ir.nodes if n.op == "const"] == [2.0]
    cc.emit(f)


def test_functools_partial_programs_bind_constants():
    def f(acc, x: cc.Tile, c=2.0):
        return acc + x * c

    p = cc.epilogue(functools.partial(f, c=3.0))
    assert p.name == "f" and p.source.endswith(str(f.__code__.co_firstlineno))
    assert [n.attr("value") for n in p.trace().nodes if n.op == "const"] == [3.0]
    assert cc.emit(functools.partial(f, c=3.0)) == cc.emit(f, constants={"c": 3.0})


def test_callable_objects_and_bad_names():
    class Scale:
        def __call__(self, acc, x: cc.Tile):
            return acc * x

    assert cc.epilogue(Scale()).name == "Scale"
    cc.emit(Scale())
    with pytest.raises(cc.EpilogueError, match="name must be a non-empty string"):
        cc.epilogue(lambda acc: acc, name=3)
    with pytest.raises(cc.EpilogueError, match="must be a function"):
        cc.epilogue("acc * 2")



def test_a_class_or_module_is_not_a_program():
    """cc.epilogue(torch.nn.ReLU) was accepted (a class is callable) and failed only when traced,
    saying the program returned a ReLU; a module instance failed on its *args signature."""
    for fn, what in ((torch.nn.ReLU, "the class ReLU"), (torch.nn.ReLU(), r"the torch.nn.Module ReLU\(\)")):
        with pytest.raises(cc.EpilogueError, match=f"must be a function of acc, got {what}: pass a function"):
            cc.epilogue(fn)
        with pytest.raises(cc.EpilogueError, match=f"got {what}"):
            cc.emit(fn)

# ------------------------------------------------------------------------------ 13: constants
@cc.epilogue
def scaled(acc, c=1.0):
    return acc * c


@pytest.mark.parametrize("value,match", [
    ("abc", r"constants\['c'\]='abc': a constant must be a real number .*got str"),
    (None, r"constants\['c'\]=None: a constant must be a real number"),
    (10 ** 400, r"constants\['c'\]: int 1000000000\.\.\.000000 \(401 digits\) is too large for a float"),
    ([1.0], r"must be a real number"),
], ids=["str", "None", "10**400", "list"])
def test_bad_constant_values_are_clear_errors(value, match):
    with pytest.raises(cc.EpilogueError, match=match):
        cc.emit(scaled, constants={"c": value})
    with pytest.raises(cc.EpilogueError, match=match):
        scaled.trace({"c": value})


def test_numeric_constants_of_other_types_are_accepted():
    assert cc.emit(scaled, constants={"c": np.float32(2.0)}) == cc.emit(scaled, constants={"c": 2})


def test_huge_python_ints_in_programs_are_clear_errors():
    with pytest.raises(cc.EpilogueError, match=r"epilogue 'f'.*argument 1 of mul: the int .*401 digits.*too large"):
        cc.epilogue(lambda acc: acc * 10 ** 400, name="f").trace()
    with pytest.raises(cc.EpilogueError, match="pow: the exponent.*too large"):
        cc.epilogue(lambda acc: acc ** 10 ** 400).trace()
    with pytest.raises(cc.EpilogueError, match="constant parameter 'c'.*too large"):
        cc.epilogue(lambda acc, c=10 ** 400: acc * c)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"constants": [("c", 1.0)]}, TypeError, "constants must be a dict"),
    ({"input_dtypes": "bf16"}, TypeError, "input_dtypes must be a dict"),
    ({"output_dtypes": {1: torch.float32}}, TypeError, "output_dtypes: names must be strings"),
    ({"config": "banana"}, TypeError, "config must be a KernelConfig or None.*'banana'"),
    ({"config": "tune"}, TypeError, "config='tune' is for cc.compile_epilogue"),
    ({"config": {"tile_m": 128}}, TypeError, "config must be a KernelConfig"),
    ({"weight_layout": 1}, TypeError, "weight_layout must be 'nk' or 'kn'"),
])
def test_bad_options_are_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        cc.emit(scaled, **kwargs)


# ------------------------------------------------------------------------------ 13: KernelConfig, jobs
@pytest.mark.parametrize("kwargs,match", [
    ({"tile_m": 128.0}, "tile_m must be an int, got 128.0"),
    ({"swizzle": 2.0}, "swizzle must be an int"),
    ({"tile_n": "256"}, "tile_n must be an int, got str"),
    ({"cluster_m": True}, "cluster_m must be an int"),
    ({"tile_m": 10 ** 400}, r"tile_m is out of range \(401 digits\)"),
    ({"epilogue_tile": (0, 16)}, r"epilogue_tile must be positive, got \(0, 16\)"),
    ({"epilogue_tile": 64}, "epilogue_tile must be None or a pair"),
    ({"epilogue_tile": (64, 16.0)}, "epilogue_tile must be an int"),
    ({"schedule": 1}, "schedule must be a string"),
    ({"raster": None}, "raster must be a string"),
])
def test_kernel_config_field_types(kwargs, match):
    with pytest.raises(cc.ConfigError, match=match):
        cc.KernelConfig(**kwargs)


@pytest.mark.parametrize("schedule,tile,et", [("cooperative", (128, 128), (64, 32)), ("pingpong", (128, 128), (128, 32)),
                                               ("cooperative", (256, 128), (256, 32))])
def test_epilogue_subtile_rows_follow_the_schedule(schedule, tile, et):
    # CUTLASS's sm90 epilogue builder static_asserts 64 rows for ping-pong and 128 for cooperative:
    # refused here, not after a minute of nvcc
    want = 64 if schedule == "pingpong" else 128
    with pytest.raises(cc.ConfigError, match=f"epilogue_tile's M must be {want} for the {schedule} schedule"):
        cc.KernelConfig(tile_m=tile[0], tile_n=tile[1], schedule=schedule, cluster_m=1, epilogue_tile=et)


def test_kernel_config_takes_numpy_ints_as_ints():
    c = cc.KernelConfig(tile_m=np.int64(128), tile_n=np.int32(128), cluster_m=np.int16(1), cluster_n=2,
                        schedule="pingpong", swizzle=np.int64(2), epilogue_tile=[np.int64(64), 32])
    assert c == cc.KernelConfig(tile_m=128, tile_n=128, cluster_m=1, cluster_n=2, schedule="pingpong", swizzle=2,
                                epilogue_tile=(64, 32))
    assert all(type(v) is int for v in (c.tile_m, c.tile_n, c.cluster_m, c.swizzle, *c.epilogue_tile))
    assert "_128," in cc.emit(scaled, config=c) and "128.0" not in c.name()


def test_config_and_jobs_arguments_of_compile(fake_nvcc):
    with pytest.raises(TypeError, match="config must be a KernelConfig, None .* or 'tune', got 'banana'"):
        cc.compile_epilogue(scaled, config="banana")
    with pytest.raises(TypeError, match="config must be a KernelConfig or None.*'banana'"):
        cc.compile_many([scaled], config="banana")
    for jobs in (-1, 0, 1.5, "2", True):
        with pytest.raises(cc.ConfigError, match=f"jobs must be a positive number .*got {jobs!r}"):
            cc.compile_many([scaled], jobs=jobs)
    [k] = cc.compile_many([scaled], jobs=np.int64(1))
    assert k.path.is_file()
    with pytest.raises(cc.ArgumentError, match=r"compile_many item 1 \('scaled'\): unknown options \['dtpe'\] "
                                               r"\(did you mean 'dtype'\?\)"):
        cc.compile_many([scaled, (scaled, {"dtpe": torch.float16})])
    with pytest.raises(cc.ArgumentError, match=r"unknown options \['zzz'\]; known: dtype, weight_layout"):
        cc.compile_many([(scaled, {"zzz": 1})])


def test_misspelt_keyword_options_are_named_with_the_close_one():
    """As compile_many and cc.reference: an ArgumentError (still a TypeError) suggesting the option
    meant, not Python's bare 'got an unexpected keyword argument'."""
    calls = {"cc.emit": lambda: cc.emit(scaled, weight_layut="kn"),
             "cc.compile_epilogue": lambda: cc.compile_epilogue(scaled, weight_layut="kn"),
             "cc.emit_map": lambda: cc.emit_map(scaled, contants={"c": 2.0}),
             "cc.compile_map": lambda: cc.compile_map(scaled, contants={"c": 2.0})}
    for call, f in calls.items():
        meant = "weight_layout" if "map" not in call else "constants"
        with pytest.raises(cc.ArgumentError,
                           match=rf"^{call}: unknown options \['\w+'\] \(did you mean '{meant}'\?\)$"):
            f()
    with pytest.raises(cc.ArgumentError,
                       match=r"^cc.KernelConfig: unknown options \['tile_mm'\] \(did you mean 'tile_m'\?\)"):
        cc.KernelConfig(tile_mm=128)
    with pytest.raises(TypeError, match=r"unknown options \['zzz'\]; known: tile_m, tile_n"):
        cc.KernelConfig(zzz=1)
    assert cc.KernelConfig(128, 128, 64, 1, 2, "pingpong") == cc.KernelConfig.from_name("128x128x64_c1x2_pingpong")


# ------------------------------------------------------------------------------ env
def test_poison_uses_the_shared_boolean_parser():
    code = ("import importlib, os\n"
            "import coda_cutlass.runtime.kernel as k\n"
            "for v in ['1', 'yes', 'On', 'off', 'No', 'false', '0', '']:\n"
            "    os.environ['CODA_CUTLASS_POISON'] = v\n"
            "    print(v, k.poison_enabled())\n"
            "os.environ['CODA_CUTLASS_POISON'] = 'maybe'\n"
            "importlib.reload(k)\n"                     # a bad value does not break the import
            "try:\n"
            "    k.poison_enabled()\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["1 True", "yes True", "On True", "off False", "No False", "false False", "0 False",
                                " False",
                                "ConfigError CODA_CUTLASS_POISON='maybe' is not a boolean: use 1/0, true/false, "
                                "yes/no or on/off"]
