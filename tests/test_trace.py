"""Tracing: operand kinds, ops, outputs, and the errors users get for programs that cannot work."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import coda_cutlass as cc
from coda_cutlass.ir import Kind, format_program


def ops(program) -> list[str]:
    return [n.op for n in program.trace().nodes]


def test_readme_program_traces_to_expected_ir():
    @cc.epilogue
    def residual_norm_stats(acc, resid: cc.Tile, g: cc.PerCol):
        x = acc + resid
        return {"D": x, "h": x * g, "sumsq": cc.row_sum(x * x)}

    p = residual_norm_stats.trace()
    assert p.outputs == ("D", "h", "sumsq")
    assert [(o.name, o.kind) for o in p.operands] == [("resid", Kind.TILE), ("g", Kind.COL)]
    assert ops(residual_norm_stats) == ["acc", "load", "load", "add", "mul", "mul", "reduce", "store", "store"]
    red = p.sink("sumsq")
    assert (red.attr("fn"), red.attr("axis"), red.kind) == ("sum", "row", Kind.ROW)
    text = format_program(p)
    assert "reduce sumsq = row_sum" in text and "store h" in text


def test_kinds_broadcast():
    @cc.epilogue
    def f(acc, r: cc.PerRow, c: cc.PerCol, s: cc.Scalar):
        return {"rc": r * c, "rs": r * s, "cs": c + 1.0, "ss": s * 2.0}

    p = f.trace()
    kinds = {n.attr("name"): p.nodes[n.inputs[0]].kind for n in p.sinks()}
    assert kinds == {"rc": Kind.TILE, "rs": Kind.ROW, "cs": Kind.COL, "ss": Kind.SCALAR}


def test_single_value_means_D_and_constants_are_shared():
    @cc.epilogue
    def f(acc):
        return acc * 2.0 + 2.0

    p = f.trace()
    assert p.outputs == ("D",)
    assert sum(n.op == "const" for n in p.nodes) == 1


def test_torch_functions_map_to_ops():
    @cc.epilogue
    def f(acc, t: cc.Tile):
        return torch.sigmoid(acc) + torch.nn.functional.silu(t) + torch.exp(acc) + torch.relu(t) + torch.abs(acc)

    assert {"sigmoid", "silu", "exp", "relu", "abs"} <= set(ops(f))


def test_pow_special_cases():
    @cc.epilogue
    def f(acc):
        return {"a": acc ** 2, "b": acc ** 0.5, "c": acc ** -1, "d": acc ** -0.5, "e": acc ** 3, "f": acc ** 1,
                "g": 2.0 ** acc}

    names = ops(f)
    for op in ("square", "sqrt", "reciprocal", "rsqrt", "pow", "exp"):
        assert op in names


def test_constant_parameters_and_override():
    @cc.epilogue
    def f(acc, eps: float = 1e-6, scale=2.0):
        return acc * scale + eps

    consts = sorted(n.attr("value") for n in f.trace().nodes if n.op == "const")
    assert consts == [1e-6, 2.0]
    consts = sorted(n.attr("value") for n in f.trace({"scale": 3.0}).nodes if n.op == "const")
    assert consts == [1e-6, 3.0]
    with pytest.raises(cc.EpilogueError, match="not a constant parameter"):
        f.trace({"nope": 1.0})


def test_int_constants_stay_python_ints():
    """WRITING_EPILOGUES §2: an int constant (a head size, a repeat count) works where Python wants
    an int; arithmetic with traced values still gives fp32 constants."""
    seen = {}

    @cc.epilogue
    def f(acc, head_dim: int = 64, n=2, eps: float = 1):
        seen.update(head_dim=head_dim, n=n, eps=eps)
        y = acc
        for _ in range(n):
            y = y * 0.5
        return {"y": y + head_dim, "s": cc.segment_sum(acc * acc, head_dim)}

    p = f.trace()
    assert (type(seen["head_dim"]), type(seen["n"]), type(seen["eps"])) == (int, int, float)
    assert p.sink("s").attr("width") == 64 and sum(n.op == "mul" for n in p.nodes) == 3
    assert 64.0 in [n.attr("value") for n in p.nodes if n.op == "const"]
    assert f.trace({"head_dim": 128.0}).sink("s").attr("width") == 128      # Options passes floats
    with pytest.raises(cc.EpilogueError, match=r"head_dim'\]=2.5: .*whole number"):
        f.trace({"head_dim": 2.5})
    A, W = torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(256, 32, dtype=torch.bfloat16)
    out = cc.reference(f, A, W, constants={"head_dim": 32})
    assert out["s"].shape == (4, 8)

    def half(acc, k: int = 2.5):
        return acc * k

    with pytest.raises(cc.EpilogueError, match=r"epilogue 'half': constant parameter 'k'=2.5: .*whole number"):
        cc.epilogue(half)


def test_accumulate_adds_an_inout_operand():
    @cc.epilogue
    def f(acc, r: cc.PerRow):
        return {"dx": cc.accumulate(acc * r)}

    p = f.trace()
    assert [o.name for o in p.operands] == ["r", "dx"]
    st = p.sink("dx")
    assert st.attr("accumulate") is True
    assert p.nodes[st.inputs[0]].op == "add"


def test_a_cast_without_dtype_rounds_as_a_store_does():
    prog = cc.epilogue(lambda acc: {"D": cc.cast(acc), "s": cc.row_sum(cc.cast(acc))}, name="as_stored")
    assert "cast %0 to the GEMM dtype (as stored)" in str(prog.ir)
    A = torch.randn(8, 16) + 3.0
    W = torch.randn(32, 16)
    for dtype in (torch.bfloat16, torch.float16):
        out = cc.reference(prog, A.to(dtype), W.to(dtype))
        torch.testing.assert_close(out["s"], out["D"].float().sum(1), rtol=1e-6, atol=1e-5)
    exact = cc.reference(prog, A, W, dtype=torch.bfloat16, precision="fp32")
    torch.testing.assert_close(exact["s"], (A @ W.T).sum(1))     # not rounded at fp32
    with pytest.raises(cc.EpilogueError, match="needs a dtype"):
        cc.cast(1.0)


def test_constant_only_calls_fold():
    assert cc.exp(0.0) == 1.0
    assert cc.cast(1.0 + 2 ** -10, torch.bfloat16) == 1.0


# ---------------------------------------------------------------------------------------------- errors
def err(fn, match: str) -> None:
    with pytest.raises(cc.EpilogueError, match=match):
        cc.epilogue(fn).trace()


def test_error_reduction_used_later():
    def f(acc):
        s = cc.row_sum(acc)
        return acc / s
    err(f, "cannot be used later in the same epilogue")


def test_error_reduction_passed_to_function():
    def f(acc):
        return cc.exp(cc.row_max(acc))
    err(f, "cannot be used later")


def test_error_python_control_flow():
    def f(acc):
        return acc if acc > 0 else -acc
    err(f, "use cc.where")


def test_error_builtin_max_min_suggests_cc_maximum():
    """max(acc, 0.0) (a ReLU) compares and takes the truth value: the message spoke only of
    if/while/and/or/not and suggested cc.where."""
    err(lambda acc: max(acc, 0.0), r"max\(\)/min\(\).*cc\.maximum/cc\.minimum")
    err(lambda acc: min(acc, 1.0), r"max\(\)/min\(\).*cc\.maximum/cc\.minimum")


def test_error_math_module():
    def f(acc):
        return math.exp(acc)
    err(f, "cc.exp")


def test_error_unsupported_operator():
    def f(acc):
        return acc // 2
    err(f, "operator // is not supported")


def test_error_unsupported_torch_function():
    def f(acc):
        return torch.erf(acc)
    err(f, "not supported on traced epilogue values")


@pytest.mark.parametrize("fn,name", [(torch.clamp, "torch.clamp"), (torch.erf, "torch.erf"),
                                     (torch.special.erf, "torch.special.erf"),
                                     (F.softplus, "torch.nn.functional.softplus"),
                                     (F.leaky_relu, "torch.nn.functional.leaky_relu")])
def test_unsupported_torch_function_is_named_as_the_user_calls_it(fn, name):
    """torch's builtins have internal qualnames: torch.clamp was reported as
    '_VariableFunctionsClass.clamp', torch.special.erf as 'special_erf'."""
    err(lambda acc: fn(acc), f"torch function {name} is not supported on traced epilogue values")


def test_error_captured_tensor():
    bias = torch.ones(4)

    def f(acc):
        return acc + bias
    with pytest.raises(cc.EpilogueError):
        cc.epilogue(f).trace()

    # on the left, torch sees Tensor.add: the message named add unsupported, listing add as supported
    for g in (lambda acc: bias + acc, lambda acc: bias * acc, lambda acc: cc.where(bias > acc, 1.0, 0.0)):
        err(g, "a torch.Tensor was captured inside the epilogue")


def test_error_missing_annotation():
    with pytest.raises(cc.EpilogueError, match="needs an operand annotation"):
        cc.epilogue(lambda acc, r: acc)


def test_error_reserved_name():
    with pytest.raises(cc.EpilogueError, match="reserved"):
        @cc.epilogue
        def f(acc, W: cc.Tile):
            return acc
    err(lambda acc: {"out": cc.accumulate(acc)}, "reserved")


def test_error_bad_returns():
    err(lambda acc: (acc, acc), "must return a dict")
    err(lambda acc: {}, "no outputs")
    err(lambda acc: {"not valid": acc}, "Python identifier")
    err(lambda acc: cc.row_sum(acc), "bare reduction")


def test_error_constant_output():
    """A Python number returned as an output was broadcast to a constant tile (cc.reference and
    cc.emit both accepted it); it is a slip, refused at trace time with the way to ask for one."""
    err(lambda acc: {"D": 1.0}, r"output 'D' is the constant 1.0: an output must be a traced value.*acc \* 0 \+ 1.0")
    err(lambda acc: {"D": acc, "c": 2}, "output 'c' is the constant 2:")
    err(lambda acc, eps=1e-6: {"D": acc, "eps": eps}, "output 'eps' is the constant 1e-06:")
    err(lambda acc: {"h": cc.half_width(0.5)}, "output 'h' is the constant 0.5:")
    err(lambda acc: {"q": cc.quantize(1.0, scale=2.0)}, "output 'q' is the constant 1.0:")
    A, W = torch.randn(4, 8).bfloat16(), torch.randn(8, 8).bfloat16()
    with pytest.raises(cc.EpilogueError, match="output 'D' is the constant"):
        cc.reference(cc.epilogue(lambda acc: {"D": 1.0}), A, W)
    assert (cc.reference(cc.epilogue(lambda acc: {"D": acc * 0 + 1.0}), A, W)["D"] == 1).all()
    n = torch.zeros(4, 8, dtype=torch.bfloat16)      # a constant accumulated is a traced out + c: a counter
    assert (cc.reference(cc.epilogue(lambda acc: {"n": cc.accumulate(1.0)}), A, W, n=n)["n"] == 1).all()


def test_error_output_named_like_operand():
    def f(acc, x: cc.Tile):
        return {"x": acc}
    err(f, "same name as an operand")


def test_error_pow_with_traced_exponent():
    def f(acc, t: cc.Tile):
        return acc ** t
    err(f, "exponent must be a Python number")


def test_error_accumulate_misuse():
    def f(acc):
        return {"D": cc.accumulate(acc) + 1.0}
    with pytest.raises((cc.EpilogueError, TypeError)):
        cc.epilogue(f).trace()
    err(lambda acc: {"D": cc.accumulate(cc.row_sum(acc))}, "accumulate takes an elementwise value")


def test_error_bad_cast_dtype():
    err(lambda acc: cc.cast(acc, torch.int32), "not supported")


def test_program_is_not_directly_callable():
    p = cc.epilogue(lambda acc: acc)
    with pytest.raises(TypeError, match="compile_epilogue"):
        p(torch.ones(1))


def test_total_max_and_min_trace_to_scalar_reductions():
    @cc.epilogue
    def p(acc):
        return {"D": acc, "amax": cc.total_max(abs(acc)), "tmin": cc.total_min(acc)}
    prog = p.trace()
    for name, fn in (("amax", "max"), ("tmin", "min")):
        red = prog.sink(name)
        assert (red.attr("fn"), red.attr("axis"), red.kind) == (fn, "all", Kind.SCALAR)
    assert "reduce amax = all_max" in format_program(prog)


@pytest.mark.parametrize("reduce,operand", [(cc.row_sum, "cc.PerRow"), (cc.col_max, "cc.PerCol"),
                                            (cc.total_max, "cc.Scalar"),
                                            (lambda x: cc.segment_sum(x, 8), "cc.Tile")])
def test_error_reduction_reuse_suggests_the_operand_of_its_shape(reduce, operand):
    def f(acc):
        return acc * reduce(acc)
    with pytest.raises(cc.EpilogueError) as e:
        cc.epilogue(f).trace()
    assert f"as a {operand} operand" in str(e.value)


def test_program_prints_as_its_text_form():
    @cc.epilogue
    def stats(acc, g: cc.PerCol):
        return {"D": acc * g, "ss": cc.row_sum(acc * acc)}
    prog = stats.trace()
    assert str(prog) == format_program(prog)
    assert str(prog).splitlines()[0] == "epilogue stats(acc, g: per-col) -> (D, ss)"
    assert repr(prog) == "<Program stats(acc, g: per-col) -> (D, ss), 6 nodes>"
    assert "\n" not in repr(prog) and "Node(" not in repr(prog)


# ---------------------------------------------------------------- found by a new user's pass (twenty-fourth session)
def test_a_16_bit_gather_index_is_refused():
    # a bf16 index rounds 31999 to 32000: the wrong column, silently
    @cc.epilogue
    def target_logit(acc, tgt: cc.PerRow):
        return {"t": cc.gather(acc, tgt)}

    with pytest.raises(cc.EpilogueError, match=r"operand 'tgt' is compared with element positions.*bfloat16.*"
                                               r"cc.PerRow\(torch.int64\)"):
        cc.emit(target_logit)
    cc.emit(target_logit, input_dtypes={"tgt": torch.int64})     # an integer index is fine
    cc.emit(target_logit, input_dtypes={"tgt": torch.float32})   # so is fp32 (exact below 2^24)


def test_a_gather_with_an_integer_index_reads_the_right_column():
    @cc.epilogue
    def target_logit(acc, tgt: cc.PerRow(torch.int64)):
        return {"t": cc.gather(acc, tgt)}

    A, W = torch.randn(4, 64).bfloat16(), torch.randn(32000, 64).bfloat16()
    tgt = torch.tensor([257, 1001, 31999, 12345])
    got = cc.reference(target_logit, A, W, tgt=tgt, precision="fp32")["t"]
    want = (A.float() @ W.float().T).gather(1, tgt[:, None])[:, 0]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float8_e4m3fn])
def test_reductions_finish_in_floating_point_only(dtype):
    @cc.epilogue
    def stats(acc):
        return {"D": acc, "s": cc.row_sum(acc)}

    with pytest.raises((cc.EpilogueError, cc.ConfigError), match="'s'"):
        cc.emit(stats, output_dtypes={"s": dtype})


def test_an_error_raised_by_a_cc_function_keeps_the_programs_line():
    import traceback

    @cc.epilogue
    def bad_quant(acc):
        return {"q": cc.quantize(acc, block=64)}

    with pytest.raises(cc.EpilogueError, match="block must be one of") as e:
        cc.emit(bad_quant)
    frames = [(f.filename, f.name) for f in traceback.extract_tb(e.value.__traceback__)]
    assert (__file__, "bad_quant") in frames


@pytest.mark.parametrize("body,match", [
    (lambda acc: acc * acc.sigmoid(), r"no attribute 'sigmoid' \(it is not a tensor\); use cc.sigmoid\(x\)"),
    (lambda acc: acc.clamp(min=0.0), "no attribute 'clamp'.*cc.where"),
    (lambda acc: round(acc), r"round\(\)"),
])
def test_tensor_methods_on_traced_values_say_what_to_use(body, match):
    with pytest.raises(cc.EpilogueError, match=match):
        cc.emit(cc.epilogue(body))


def test_traced_values_still_answer_hasattr():
    seen = {}

    @cc.epilogue
    def f(acc):
        seen["has"] = hasattr(acc, "sigmoid")
        return acc

    cc.emit(f)
    assert seen["has"] is False


def test_the_accumulator_must_be_positional():
    def kwacc(*, acc):
        return acc

    with pytest.raises(cc.EpilogueError, match="the first parameter must be the accumulator, positional"):
        cc.epilogue(kwacc)


def test_a_program_renamed_by_cc_epilogue():
    inner = cc.epilogue(lambda acc: acc * 2)
    renamed = cc.epilogue(name="twice")(inner)
    assert renamed.name == "twice" and "generated kernel: twice" in cc.emit(renamed)


def test_operand_defaults_and_partial_bindings_are_refused():
    import functools

    def scaled(acc, s: cc.Scalar = 2.0):
        return acc * s

    with pytest.raises(cc.EpilogueError, match=r"operand 's' has a default value \(2.0\)"):
        cc.epilogue(scaled)

    def scaled2(acc, s: cc.Scalar):
        return acc * s

    with pytest.raises(cc.EpilogueError, match="operand 's' has a default value"):
        cc.epilogue(functools.partial(scaled2, s=2.0))


def test_numpy_scalars_are_numbers():
    import numpy as np

    @cc.epilogue
    def f(acc, eps=np.float32(0.5)):
        return acc * np.float32(2.0) + np.int64(3) + eps

    A, W = torch.randn(4, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    got = cc.reference(f, A, W, precision="fp32")["D"]
    torch.testing.assert_close(got, (A.float() @ W.float().T) * 2 + 3.5)


def test_numpy_functions_on_traced_values_name_the_cc_function():
    import traceback

    import numpy as np

    @cc.epilogue
    def np_exp(acc):
        return np.exp(acc)

    with pytest.raises(cc.EpilogueError, match=r"epilogue 'np_exp', node %0 \(acc\): numpy.exp cannot compute on "
                                               r"a traced value .*use cc.exp\(x\)") as e:
        cc.reference(np_exp, torch.randn(8, 16).bfloat16(), torch.randn(16, 16).bfloat16())
    frames = [(f.filename, f.name) for f in traceback.extract_tb(e.value.__traceback__)]
    assert (__file__, "np_exp") in frames      # the program's line
    err(lambda acc: np.maximum(acc, 0.0), r"numpy.maximum .*use cc.maximum\(a, b\)")
    err(lambda acc: np.clip(acc, 0.0, 1.0), r"numpy.clip .*use cc.minimum\(cc.maximum")
    err(lambda acc: np.add.reduce(acc), r"numpy.add.reduce cannot compute")
    # numpy's operators are Python's: a numpy scalar on the left reaches the ufunc, not __rmul__
    p = cc.epilogue(lambda acc: np.float32(2.0) * acc - np.int64(1) < acc, name="ops").trace()
    assert [n.op for n in p.nodes if n.op not in ("const", "acc")] == ["mul", "sub", "lt", "store"]


def test_a_block_scale_output_may_not_take_an_operands_name():
    @cc.epilogue
    def f(acc, q_scale: cc.PerRow(torch.float32)):
        return {"q": cc.quantize(acc * q_scale, block=128)}

    with pytest.raises(cc.EpilogueError, match="adds the output 'q_scale'.*an operand already has that name"):
        cc.emit(f)

    @cc.epilogue
    def g(acc):
        return {"q": cc.quantize(acc, block=128), "q_scale": acc}

    with pytest.raises(cc.EpilogueError, match="adds the output 'q_scale'.*an output already has that name"):
        cc.emit(g)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_a_constant_quantisation_scale_is_positive_and_finite(scale):
    with pytest.raises(cc.EpilogueError, match="positive finite number"):
        cc.emit(cc.epilogue(lambda acc: {"q": cc.quantize(acc, scale=scale)}))


def test_accumulating_a_quantised_value_is_refused_clearly():
    with pytest.raises(cc.EpilogueError, match=r"cc.accumulate takes an elementwise value, not cc.quantize"):
        cc.emit(cc.epilogue(lambda acc: {"dx": cc.accumulate(cc.quantize(acc, scale=1.0))}))


def test_an_accumulated_broadcast_view_is_refused_by_the_reference():
    @cc.epilogue
    def add_into(acc):
        return {"dx": cc.accumulate(acc)}

    A, W = torch.randn(16, 16).bfloat16(), torch.randn(16, 16).bfloat16()
    with pytest.raises(cc.CallError, match="broadcast view"):
        cc.reference(add_into, A, W, dx=torch.zeros(1, 16).bfloat16().expand(16, 16))


def test_dtype_errors_list_only_what_the_position_takes():
    p = cc.epilogue(lambda acc: acc)
    with pytest.raises(cc.ConfigError) as e:
        cc.emit(p, torch.int8)
    assert "torch.bfloat16, torch.float16, or torch.float8_e4m3fn" in str(e.value) and "int32" not in str(e.value)
    with pytest.raises(cc.ConfigError) as e:
        cc.emit(p, output_dtypes={"D": torch.float64})
    assert "int64" not in str(e.value) and "torch.float8_e5m2" in str(e.value)


def test_the_header_states_the_weight_layout():
    p = cc.epilogue(lambda acc: acc)
    assert "acc[M, N] = A[M, K] @ W^T," in cc.emit(p)
    assert "acc[M, N] = A[M, K] @ W," in cc.emit(p, weight_layout="kn")


def test_numpy_scalars_compare_with_traced_values_and_float_block_sizes_are_ints():
    """np.float32(0) < acc reached __array_ufunc__ as a 0-d ndarray and was refused; a float
    constant block size (128.0) passed the check and generated `128.0` for an int template
    argument (nvcc: "expression must have integral or enum type")."""
    import numpy as np

    @cc.epilogue
    def cmp(acc):
        return {"D": cc.where(np.float32(0) < acc, acc, np.float64(0.5) * acc)}

    @cc.epilogue
    def py(acc):
        return {"D": cc.where(0.0 < acc, acc, 0.5 * acc)}

    assert cc.emit(cmp, dtype=torch.bfloat16).replace("cmp", "py") == cc.emit(py, dtype=torch.bfloat16)

    @cc.epilogue
    def blocks(acc, b=128.0):
        return {"Y": cc.quantize(acc, block=b)}

    assert "128.0" not in cc.emit(blocks, dtype=torch.bfloat16)
