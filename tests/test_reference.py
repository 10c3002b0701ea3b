"""cc.reference behaves like the kernel call (issue 13): the same argument checks and messages
(runtime/arguments.py), fp32 copies only at precision="fp32", accumulated outputs updated in place,
the identity for reductions over an empty M or N, the dtype rule for float32 inputs, and leading
batch dimensions flattened like nn.Linear (for the reference, and the kernel's argument handling as
far as it runs without a GPU)."""

from __future__ import annotations

import pytest
import torch

import coda_cutlass as cc
from coda_cutlass.dtypes import BF16, I64
from coda_cutlass.runtime import checks
from coda_cutlass.runtime.arguments import CallSpec, flatten_batch

bf = torch.bfloat16


@cc.epilogue
def norm(acc, resid: cc.Tile, g: cc.PerCol, r: cc.PerRow(torch.float32)):
    x = acc + resid
    return {"D": x * g * r, "ss": cc.row_sum(x * x), "cm": cc.col_max(x)}


@cc.epilogue
def lm(acc, target: cc.PerRow(torch.int64)):
    return {"D": acc, "picked": cc.gather(acc, target)}


@cc.epilogue
def accum(acc, y: cc.Tile):
    return {"o": acc * y, "dx": cc.accumulate(acc)}


def gemm_inputs(M=16, N=24, K=16, dtype=bf, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype))


def norm_ops(M=16, N=24, dtype=bf):
    return {"resid": torch.randn(M, N).to(dtype), "g": torch.rand(N).to(dtype), "r": torch.rand(M) + 0.5}


def message(fn) -> str:
    with pytest.raises(cc.CallError) as e:
        fn()
    return str(e.value)


# ---------------------------------------------------------------------------------------------- checks
@pytest.mark.parametrize("name,bad,kernel_check", [
    ("g", lambda o: o["g"].float(), lambda t: checks.check_vector("g", t, 24, "column (length N)", BF16,
                                                                  torch.device("cpu"))),
    ("resid", lambda o: o["resid"][:1], lambda t: checks.check_tile("resid", t, 16, 24, BF16, torch.device("cpu"))),
    ("g", lambda o: o["g"][:20], lambda t: checks.check_vector("g", t, 24, "column (length N)", BF16,
                                                               torch.device("cpu"))),
    ("r", lambda o: o["r"].reshape(16, 1), None),
    ("g", lambda o: o["g"].tolist(), None),
])
def test_reference_refuses_what_the_kernel_refuses_with_its_message(name, bad, kernel_check):
    A, W = gemm_inputs()
    ops = norm_ops()
    ops[name] = bad(ops)
    got = message(lambda: cc.reference(norm, A, W, **ops))
    if kernel_check is not None:
        assert got == message(lambda: kernel_check(ops[name]))
    assert got.startswith(f"{name}: ")


def test_index_vector_dtype_and_float32_operands():
    A, W = gemm_inputs()
    target = torch.randint(0, 24, (16,))
    assert "dtype is torch.int32" in message(lambda: cc.reference(lm, A, W, target=target.int()))
    assert message(lambda: cc.reference(lm, A, W, target=target.int())) == message(
        lambda: checks.check_vector("target", target.int(), 16, "row (length M)", I64, torch.device("cpu")))
    assert "A: dtype is torch.float32" in message(lambda: cc.reference(lm, A.float(), W, dtype=bf, target=target))
    # the exact reference: fp32 copies of everything, index vectors included
    exact = cc.reference(lm, A.float(), W.float(), precision="fp32", target=target.float())
    torch.testing.assert_close(exact["picked"], (A.float() @ W.float().t()).gather(1, target[:, None])[:, 0])
    # fp32 precision still takes the kernel's own dtypes, but not a third one
    cc.reference(lm, A, W, precision="fp32", target=target)
    assert "or torch.float32 with precision='fp32'" in message(
        lambda: cc.reference(lm, A.half(), W, precision="fp32", target=target))


def test_misspelt_and_missing_operands_are_named():
    A, W = gemm_inputs()
    ops = norm_ops()
    ops["gg"] = ops.pop("g")
    got = message(lambda: cc.reference(norm, A, W, **ops))
    assert "unknown operand 'gg'; did you mean 'g'?" in got and "missing" not in got
    assert "The call is k(A, W, resid=..., g=..., r=...)" in got
    ops = norm_ops()
    assert "did you mean 'precision'?" in message(lambda: cc.reference(norm, A, W, precison="fp32", **ops))
    del ops["r"]
    assert "missing operand 'r'" in message(lambda: cc.reference(norm, A, W, **ops))
    assert "unknown operand 'bias'." in message(lambda: cc.reference(norm, A, W, bias=ops["g"], **norm_ops()))


def test_kernel_and_reference_name_the_same_misspelling(fake_nvcc):
    k = cc.compile_epilogue(norm, bf)
    A, W = gemm_inputs()
    ops = norm_ops()
    ops["resdi"] = ops.pop("resid")
    from_kernel = message(lambda: k._check_names(ops))
    assert from_kernel == message(lambda: k.reference(A, W, **ops))
    assert "unknown operand 'resdi'; did you mean 'resid'?" in from_kernel
    assert "did you mean 'swizzle'?" in message(lambda: k._check_names({**norm_ops(), "swizle": 2}))


@cc.epilogue
def scaled(acc, g: cc.PerCol, eps: float = 1e-6):
    return acc * g + eps


def test_a_constant_passed_at_call_time_is_named_as_a_constant(fake_nvcc):
    """``eps: float = 1e-6`` looks like an argument in the program's signature; passing eps= to the
    call used to say only "unknown operand 'eps'", with no word of constants= or cc.Scalar."""
    A, W = gemm_inputs()
    g = torch.rand(24).to(bf)
    got = message(lambda: cc.reference(scaled, A, W, g=g, eps=1e-5))
    assert "'eps' is a compile-time constant of scaled (here 1e-06), not an operand" in got
    assert "constants={'eps': ...}" in got and "cc.Scalar" in got and "unknown operand" not in got
    assert "(here 0.5)" in message(lambda: cc.reference(scaled, A, W, g=g, eps=1e-5, constants={"eps": 0.5}))
    k = cc.compile_epilogue(scaled, bf)
    assert message(lambda: k._check_names({"g": g, "eps": 1e-5})) == got
    assert "compile-time constant of scaled" in message(lambda: cc.map_reference(scaled, A, g=torch.rand(16).to(bf),
                                                                                  eps=1e-5))


def test_gemm_shape_rules_and_overlap_are_checked():
    A, W = gemm_inputs(N=20)
    assert "N = 20 is not a multiple of 8" in message(lambda: cc.reference(norm, A, W, **norm_ops(N=20)))
    A, W = gemm_inputs()
    assert "W: shape (24, 16) does not match A (16, 8)" in message(
        lambda: cc.reference(norm, A[:, :8], W, **norm_ops()))
    y = torch.randn(16, 24).to(bf)
    assert "overlaps the memory of y" in message(lambda: cc.reference(accum, A, W, y=y, dx=y))


# ---------------------------------------------------------------------------------------------- accumulate
@pytest.mark.parametrize("precision", ["kernel", "fp32", "lowp"])
def test_accumulated_outputs_are_updated_in_place(precision):
    A, W = gemm_inputs()
    y = torch.randn(16, 24).to(bf)
    dx = torch.randn(16, 24).to(bf)
    before = dx.clone()
    out = cc.reference(accum, A, W, precision=precision, y=y, dx=dx)
    assert out["dx"] is dx
    want = before.float() + A.float() @ W.float().t()
    torch.testing.assert_close(dx.float(), want.to(bf).float(), rtol=0.02, atol=0.02)
    assert not torch.equal(dx, before)


def test_fp32_copy_of_an_accumulated_output_keeps_the_exact_value():
    A, W = gemm_inputs()
    dx = torch.randn(16, 24)
    want = dx + A.float() @ W.float().t()
    out = cc.reference(accum, A.float(), W.float(), precision="fp32", y=torch.ones(16, 24), dx=dx)
    assert out["dx"] is dx and torch.equal(dx, want)


# ---------------------------------------------------------------------------------------------- empty M / N
@cc.epilogue
def every_reduction(acc, x: cc.Tile):
    y = acc + x
    return {"D": y, "rs": cc.row_sum(y), "rmx": cc.row_max(y), "rmn": cc.row_min(y), "cs": cc.col_sum(y),
            "cmx": cc.col_max(y), "cmn": cc.col_min(y), "ts": cc.total_sum(y), "tmx": cc.total_max(y),
            "tmn": cc.total_min(y), "lse": cc.row_logsumexp(y), "seg": cc.segment_sum(y, 8)}


IDENTITY = {"rs": 0.0, "rmx": float("-inf"), "rmn": float("inf"), "cs": 0.0, "cmx": float("-inf"),
            "cmn": float("inf"), "ts": 0.0, "tmx": float("-inf"), "tmn": float("inf"), "lse": float("-inf")}


@pytest.mark.parametrize("M,N", [(0, 16), (12, 0)])
@pytest.mark.parametrize("precision", ["kernel", "fp32"])
def test_reductions_over_nothing_give_their_identity(M, N, precision):
    A, W = gemm_inputs(M=M, N=N)
    out = cc.reference(every_reduction, A, W, precision=precision, x=torch.zeros(M, N).to(bf))
    shapes = {"rs": (M,), "rmx": (M,), "rmn": (M,), "lse": (M,), "cs": (N,), "cmx": (N,), "cmn": (N,),
              "ts": (), "tmx": (), "tmn": (), "seg": (M, N // 8), "D": (M, N)}
    for name, shape in shapes.items():
        assert out[name].shape == shape, name
    for name, value in IDENTITY.items():
        assert torch.all(out[name] == value), name
        assert out[name].dtype == torch.float32


def test_partials_over_nothing_match_the_kernels_shapes(fake_nvcc):
    k = cc.compile_epilogue(every_reduction, bf, partial_reductions=True)
    A, W = gemm_inputs(M=12, N=0)
    out = k.reference(A, W, x=torch.zeros(12, 0).to(bf))
    for name in IDENTITY:
        assert out[name].shape == k.output_spec(name, 12, 0)[0], name
        assert torch.all(out[name] == IDENTITY[name]), name


# ---------------------------------------------------------------------------------------------- dtype rule
@cc.epilogue
def plain(acc, b: cc.PerCol):
    return acc + b


def test_float32_inputs_need_a_dtype_except_at_fp32_precision():
    A, W = gemm_inputs(dtype=torch.float32)
    b = torch.rand(24)
    for precision in ("kernel", "lowp"):
        with pytest.raises(cc.CallError, match=r"A is torch.float32 and no dtype was given.*precision='fp32'"):
            cc.reference(plain, A, W, precision=precision, b=b)
    out = cc.reference(plain, A, W, precision="fp32", b=b)
    assert out["D"].dtype == torch.float32
    torch.testing.assert_close(out["D"], A @ W.t() + b)
    # with 16-bit inputs the dtype is theirs
    assert cc.reference(plain, A.half(), W.half(), b=b.half())["D"].dtype == torch.float16
    assert cc.reference(plain, A.to(bf), W.to(bf), b=b.to(bf))["D"].dtype == bf
    # an explicit dtype is the kernel's: float32 tensors are then refused outside precision="fp32"
    with pytest.raises(cc.CallError, match="A: dtype is torch.float32"):
        cc.reference(plain, A, W, dtype=bf, b=b.to(bf))


# ---------------------------------------------------------------------------------------------- out=
@cc.epilogue
def quantized(acc):
    return {"D": acc, "q": cc.quantize(acc, block=128)}


def test_out_takes_tile_outputs_as_the_kernel_call_does(fake_nvcc):
    """WRITING_EPILOGUES §5: k(A, W, out={...}) writes tile outputs into the tensors given and returns
    them; cc.reference and CompiledEpilogue.reference take out= with the kernel's checks."""
    A, W = gemm_inputs()
    ops = norm_ops()
    want = cc.reference(norm, A, W, **ops)
    D = torch.empty(16, 24, dtype=bf)
    res = cc.reference(norm, A, W, out={"D": D}, **ops)
    assert res["D"] is D and torch.equal(D, want["D"]) and torch.equal(res["ss"], want["ss"])
    k = cc.compile_epilogue(norm, bf)
    D2 = torch.empty(16, 24, dtype=bf)
    assert k.reference(A, W, out={"D": D2}, **ops)["D"] is D2 and torch.equal(D2, want["D"])
    assert message(lambda: cc.reference(norm, A, W, out={"ss": D}, **ops)) == (
        "out: 'ss' is not a tile output of norm (tile outputs: D)")
    assert message(lambda: cc.reference(norm, A, W, out=[D], **ops)).startswith("out: expected a dict")
    assert message(lambda: cc.reference(norm, A, W, out={"D": D.float()}, **ops)).startswith(
        "out['D']: dtype is torch.float32, the kernel was compiled for torch.bfloat16")
    assert message(lambda: cc.reference(norm, A, W, out={"D": D[:, :12]}, **ops)) == (
        "out['D']: shape is (16, 12), expected (16, 24)")
    assert message(lambda: cc.reference(norm, A, W, out={"D": ops["resid"]}, **ops)) == (
        "D: is updated in place and overlaps the memory of resid; pass a separate tensor")
    exact = torch.empty(16, 24)                     # float32 at precision="fp32", as for operands
    assert cc.reference(norm, A, W, precision="fp32", out={"D": exact}, **ops)["D"] is exact
    B = torch.empty(2, 8, 24, dtype=bf)             # leading batch dimensions: returned as given
    res = cc.reference(norm, A.view(2, 8, 16), W, out={"D": B}, **{**ops, "resid": ops["resid"].view(2, 8, 24),
                                                                   "r": ops["r"].view(2, 8)})
    assert res["D"] is B and torch.equal(B.view(16, 24), want["D"])
    A8, W8 = gemm_inputs(N=128)
    assert message(lambda: cc.reference(quantized, A8, W8, out={"q_scale": torch.empty(16, 1)})) == (
        "quantized: out['q_scale']: block scales are allocated by the kernel call")


# ---------------------------------------------------------------------------------------------- batch dims
@pytest.mark.parametrize("precision", ["kernel", "fp32"])
def test_leading_batch_dims_flatten_like_nn_linear(precision):
    B, S, N, K = 2, 3, 24, 16
    A, W = gemm_inputs(M=B * S, N=N, K=K)
    ops = norm_ops(M=B * S, N=N)
    flat = cc.reference(norm, A, W, precision=precision, **ops)
    batched_ops = {"resid": ops["resid"].view(B, S, N), "g": ops["g"], "r": ops["r"].view(B, S)}
    out = cc.reference(norm, A.view(B, S, K), W, precision=precision, **batched_ops)
    assert out["D"].shape == (B, S, N) and out["ss"].shape == (B, S) and out["cm"].shape == (N,)
    for name in flat:
        assert torch.equal(out[name].reshape(flat[name].shape), flat[name]), name
    # accumulated outputs are updated through the flattened view and returned as passed
    dx = torch.zeros(B, S, N).to(bf)
    res = cc.reference(accum, A.view(B, S, K), W, precision=precision, y=torch.ones(B, S, N).to(bf), dx=dx)
    assert res["dx"] is dx and res["o"].shape == (B, S, N)
    torch.testing.assert_close(dx.view(B * S, N).float(), (A.float() @ W.float().t()).to(bf).float())


def test_batch_shape_errors_name_the_expected_shape():
    A, W = gemm_inputs(M=6)
    ops = {"resid": torch.randn(6, 24).to(bf), "g": torch.rand(24).to(bf), "r": torch.rand(2, 3)}
    got = message(lambda: cc.reference(norm, A.view(2, 3, 16), W, **ops))
    assert got == "resid: shape is (6, 24), expected (2, 3, 24) (A has the leading dimensions (2, 3))"
    ops["resid"] = ops["resid"].view(2, 3, 24)
    ops["r"] = torch.rand(6)
    assert "r: shape is (6,), expected (2, 3): one value per row" in message(
        lambda: cc.reference(norm, A.view(2, 3, 16), W, **ops))
    padded = torch.randn(3, 2, 16).to(bf).transpose(0, 1)        # (2, 3, 16) that cannot be viewed as (6, 16)
    assert "cannot be flattened to 6 rows without a copy" in message(
        lambda: cc.reference(norm, padded, W, **{**ops, "r": ops["r"].view(2, 3)}))


def test_kernel_call_flattens_batch_dims_and_restores_outputs(fake_nvcc, monkeypatch):
    """The kernel's argument handling up to the launch (no GPU here): run() sees 2-D arguments (views
    of the caller's tensors) and the caller gets the leading dimensions back."""
    k = cc.compile_epilogue(accum, bf)
    B, S, N, K = 2, 3, 24, 16
    A, W = gemm_inputs(M=B * S, N=N, K=K)
    y, dx = torch.randn(B, S, N).to(bf), torch.zeros(B, S, N).to(bf)
    o = torch.empty(B, S, N, dtype=bf)
    seen = {}

    def fake_run(A2, W2, operands, *, raster=None, swizzle=None, out=None):
        seen.update(A=A2, W=W2, out=out, **operands)
        res = {"o": out["o"] if out else torch.empty(A2.shape[0], N, dtype=bf)}
        res["dx"] = operands["dx"]
        return res
    monkeypatch.setattr(k, "run", fake_run)
    res = k(A.view(B, S, K), W, y=y, dx=dx, out={"o": o})
    assert seen["A"].shape == (B * S, K) and seen["A"].data_ptr() == A.data_ptr()
    assert seen["y"].shape == (B * S, N) and seen["y"].data_ptr() == y.data_ptr()
    assert seen["dx"].shape == (B * S, N) and seen["dx"].data_ptr() == dx.data_ptr()
    assert seen["out"]["o"].shape == (B * S, N)
    assert res["dx"] is dx and res["o"] is o
    res = k(A.view(B, S, K), W, y=y, dx=dx)
    assert res["o"].shape == (B, S, N)
    with pytest.raises(cc.CallError, match=r"dx: shape is \(6, 24\), expected \(2, 3, 24\)"):
        k(A.view(B, S, K), W, y=y, dx=dx.view(B * S, N))


def test_flatten_batch_leaves_column_vectors_and_scalars():
    spec = CallSpec.of(cc.pipeline.typed_ir(norm, cc.pipeline.Options.make(bf)))
    A, W = gemm_inputs(M=6)
    ops = {"resid": torch.randn(2, 3, 24).to(bf), "g": torch.rand(24).to(bf), "r": torch.rand(2, 3)}
    A2, flat, out, batch = flatten_batch(spec, A.view(2, 3, 16), W, ops, "nk")
    assert A2.shape == (6, 16) and flat["resid"].shape == (6, 24) and flat["r"].shape == (6,)
    assert flat["g"] is ops["g"] and batch.shape == (2, 3) and out is None


def test_partial_reductions_is_refused_by_name_not_taken_for_an_operand():
    prog = cc.epilogue(lambda acc: {"s": cc.row_sum(acc)}, name="rowsum_ref")
    A, W = torch.randn(4, 8).bfloat16(), torch.randn(16, 8).bfloat16()
    with pytest.raises(cc.ArgumentError, match="partial_reductions is not supported: a GEMM kernel's raw partials"):
        cc.reference(prog, A, W, partial_reductions=True)
    assert torch.allclose(cc.reference(prog, A, W, partial_reductions=False, precision="fp32")["s"],
                          (A.float() @ W.float().T).sum(1))


def test_a_bad_precision_or_weight_layout_value_is_a_coda_error():
    # they were bare ValueErrors, missed by `except cc.CodaError`; CallError is still a ValueError
    A, W = gemm_inputs()
    for kwargs, says in [({"precision": "fp16"}, "precision must be one of"),
                         ({"weight_layout": "NK"}, "weight_layout must be 'nk' or 'kn', got 'NK'")]:
        with pytest.raises(cc.CallError, match=says):
            cc.reference(norm, A, W, **kwargs, **norm_ops())
    with pytest.raises(cc.CallError, match="precision must be one of"):
        cc.map_reference(cc.epilogue(lambda acc: acc * 2.0), torch.randn(4, 8).bfloat16(), precision="exact")
