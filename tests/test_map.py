"""Map kernels (an epilogue program over an existing tensor, no GEMM) on the CPU: the reference,
the generated source, refusals, and one real nvcc build (a map kernel compiles in seconds)."""

from __future__ import annotations

import shutil

import pytest
import torch

import coda_cutlass as cc
from coda_cutlass import epilogues as E

F32 = torch.float32


def test_rope_backward_reference_on_a_strided_4d_gradient():
    g = torch.Generator().manual_seed(0)
    B, S, H, D = 2, 4, 3, 16
    grad = torch.randn(B, H, S, D, generator=g).transpose(1, 2)       # (B, S, H, D) view, not contiguous
    y = torch.randn(B * S, H * D, generator=g)
    r = torch.rand(B * S, generator=g) + 0.5
    pos = torch.arange(S, dtype=F32).repeat(B)
    freq = torch.rand(H * D // 2, generator=g).repeat_interleave(2)
    out = cc.map_reference(E.rope_backward, grad, y=y, r=r, pos=pos, freq=freq, precision="fp32")
    dy = grad.reshape(B * S, H * D)
    theta = -(pos[:, None] * freq[None, :])[:, 0::2]
    a, b = dy[:, 0::2], dy[:, 1::2]
    rot = torch.stack((a * theta.cos() - b * theta.sin(), a * theta.sin() + b * theta.cos()), -1).flatten(1)
    torch.testing.assert_close(out["dz"], rot * r[:, None], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out["zdz"], (dy * y).sum(1), rtol=1e-5, atol=1e-5)


def test_norm_stats_reference():
    x = torch.randn(6, 32)
    gamma = torch.randn(32)
    out = cc.map_reference(E.norm_stats, x, g=gamma, precision="fp32")
    torch.testing.assert_close(out["h"], x * gamma)
    torch.testing.assert_close(out["sumsq"], (x * x).sum(1))


def test_generated_source_hoists_what_does_not_vary_along_rows():
    src = cc.emit_map(E.rope_backward)
    loop = src.index("for (int64_t m = ")
    assert src.index("load1<float>(p.tensors[4], n0 + i)") < loop       # freq: per column, before the loop
    assert src.index("load1<float>(p.tensors[2], m)") > loop           # r: per row, inside
    assert "coda_map_run" in src and "rope_backward" in src


@cc.epilogue
def _with_lse(acc):
    return {"lse": cc.row_logsumexp(acc)}


@cc.epilogue
def _with_col_sum(acc):
    return {"s": cc.col_sum(acc)}


@cc.epilogue
def _with_pack(acc, z: cc.PairTile):
    a, b = cc.unpack(z)
    return a * acc


@cc.epilogue
def _with_pack_store(acc):
    return {"D": cc.pack(acc, acc * 2.0)}


@pytest.mark.parametrize("program,what", [(_with_lse, "log-sum-exp"), (_with_col_sum, "col reductions"),
                                          (_with_pack, "operand 'z'.*packed pairs"),
                                          (_with_pack_store, r"node %\d+ \(pack\).*packed pairs")])
def test_unsupported_nodes_are_refused_by_name(program, what):
    with pytest.raises(cc.EpilogueError, match=what):
        cc.emit_map(program)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_map_kernel_builds_and_describes_itself(tmp_path):
    import json
    import ctypes
    k = cc.compile_map(E.rope_backward, cache_dir=tmp_path, verbose=False)
    assert k.path.is_file() and k.origin == "built"
    lib = ctypes.CDLL(str(k.path))
    lib.coda_describe.restype = ctypes.c_char_p
    desc = json.loads(lib.coda_describe().decode())
    assert desc["program"] == "rope_backward" and [s["name"] for s in desc["slots"]] == ["acc", "y", "r", "pos",
                                                                                       "freq", "dz", "zdz"]
    from coda_cutlass.runtime.library import load
    from coda_cutlass.runtime.map_kernel import MapLibrary
    assert k.library.description == desc and load(k.path, MapLibrary) is k.library     # verified, loaded once
    assert k.library.status_string(0)
    with pytest.raises(cc.BuildError, match="exports no coda_abi_version"):
        load(k.path)                                # as a GEMM kernel's library: another ABI
    if not torch.cuda.is_available():
        with pytest.raises(cc.DeviceError):
            k(torch.zeros(8, 8, dtype=torch.bfloat16), y=None, r=None, pos=None, freq=None)


# ---------------------------------------------------------------- the call's checks, on the CPU
# CompiledMap._prepare runs every check of k(X, ...) and builds the launch's arguments without
# launching (a real call first needs an sm_90 GPU); CPU tensors pass its device checks.
BF = torch.bfloat16


@cc.epilogue
def _checked(acc, s: cc.Scalar, v: cc.PerCol, t: cc.Tile):
    x = cc.where(cc.col_index() < cc.row_index(), acc * s + v, t)
    return {"D": x, "half": cc.half_width(x * 2.0), "mx": cc.row_max(x), "tot": cc.total_sum(x),
            "acc_t": cc.accumulate(x * 0.5)}


def _checked_ops(M: int, N: int) -> dict:
    g = torch.Generator().manual_seed(M * 31 + N)
    return {"s": 0.5, "v": torch.randn(N, generator=g).to(BF), "t": torch.randn(M, N, generator=g).to(BF),
            "acc_t": torch.randn(M, N, generator=g).to(BF)}


def _message(f) -> str:
    with pytest.raises(cc.CallError) as e:
        f()
    return str(e.value)


def test_map_call_names_operands_like_a_gemm_call(fake_nvcc):
    k = cc.compile_map(_checked, BF)
    X, ops = torch.randn(16, 64).to(BF), _checked_ops(16, 64)
    M, N, ptrs, views, scalars, results, partials = k._prepare(X, ops, None)
    assert (M, N, scalars) == (16, 64, [0.5]) and len(ptrs) * 5 == len(views)
    assert results["acc_t"] is ops["acc_t"] and results["half"].shape == (16, 32)
    assert [(n, tuple(b.shape)) for n, b in partials] == [("mx", (1, 16)), ("tot", (1, 16))]
    ops["tt"] = ops.pop("t")
    got = _message(lambda: k._prepare(X, ops, None))
    assert "_checked: unknown operand 'tt'; did you mean 't'?" in got and "missing" not in got
    assert got.endswith("The call is k(X, s=..., v=..., t=..., acc_t=...)")
    del ops["tt"]
    assert "missing operand 't'" in _message(lambda: k._prepare(X, ops, None))
    assert "unknown operand 'ot'; did you mean 'out'?" in _message(lambda: k._prepare(X, {**_checked_ops(16, 64),
                                                                                          "ot": {}}, None))


def test_map_out_names_tile_outputs_only(fake_nvcc):
    k = cc.compile_map(_checked, BF)
    X, ops = torch.randn(16, 64).to(BF), _checked_ops(16, 64)
    D = torch.empty(16, 64, dtype=BF)
    assert k._prepare(X, ops, {"D": D})[5]["D"] is D
    for name in ("mx", "acc_t", "DD"):
        assert _message(lambda: k._prepare(X, ops, {name: D})) == (
            f"out: '{name}' is not a tile output of _checked (tile outputs: D, half)")


def test_map_in_place_outputs_must_not_alias_what_the_kernel_reads(fake_nvcc):
    k = cc.compile_map(_checked, BF)
    X, ops = torch.randn(16, 64).to(BF), _checked_ops(16, 64)
    assert "acc_t: is updated in place and overlaps the memory of X" in _message(
        lambda: k._prepare(X, {**ops, "acc_t": X}, None))
    assert "acc_t: is updated in place and overlaps the memory of t" in _message(
        lambda: k._prepare(X, {**ops, "acc_t": ops["t"]}, None))
    assert k._prepare(X, ops, {"D": X})[5]["D"] is X      # X's own view, shifted views refused: below
    assert "acc_t: is updated in place and overlaps the memory of D" in _message(
        lambda: k._prepare(X, ops, {"D": ops["acc_t"]}))
    k._prepare(X, ops, {"D": torch.empty(16, 64, dtype=BF)})     # separate tensors are fine


def test_map_programs_with_indices_need_extents_below_2_24(fake_nvcc):
    k = cc.compile_map(_checked, BF)
    assert k.spec.uses_index and not cc.compile_map(E.norm_stats, BF).spec.uses_index
    tall = torch.zeros(1, 64, dtype=BF).expand(1 << 24, 64)        # no memory behind the rows
    ops = {**_checked_ops(1, 64), "t": tall, "acc_t": tall}
    assert "need M and N below 2^24" in _message(lambda: k._prepare(tall, ops, None))


@pytest.mark.parametrize("partial", [False, True], ids=["finished", "partials"])
@pytest.mark.parametrize("shape", [(0, 512), (6, 0)], ids=["M0", "N0"])
def test_map_empty_shapes_return_what_the_reference_returns(fake_nvcc, shape, partial):
    """No launch: tile outputs are empty, reductions their identity, shaped as cc.map_reference's
    (partials: (ceil(N / 256), M), e.g. (2, 0) for M = 0)."""
    M, N = shape
    k = cc.compile_map(_checked, BF, partial_reductions=partial)
    X, ops = torch.randn(M, N).to(BF), _checked_ops(M, N)
    assert X.stride() == ((1, 1) if N == 0 else (N, 1))      # any strides of an empty tensor will do
    *_, results, partials = k._prepare(X, ops, None)
    results.update(k._empty_reductions(M, N, X.device))
    ref = cc.map_reference(_checked, X, dtype=BF, partial_reductions=partial, **ops)
    assert set(results) == set(ref)
    for name in ref:
        assert results[name].shape == ref[name].shape and results[name].dtype == ref[name].dtype, name
        torch.testing.assert_close(results[name], ref[name])
    if partial and M == 0:
        assert results["mx"].shape == (2, 0)


# ---------------------------------------------------------------- transposed outputs
@cc.epilogue
def _transposed(acc, s: cc.DeviceScalar):
    return {"q": cc.quantize(acc, scale=s), "qt": cc.quantize(acc, scale=s, transpose=True), "amax": cc.amax(acc)}


@cc.epilogue
def _transposed_blocks(acc):
    return {"qt": cc.quantize(acc, block=128, transpose=True)}


@cc.epilogue
def _transposed_half(acc, s: cc.DeviceScalar):
    return {"qt": cc.quantize(cc.half_width(acc), scale=s, transpose=True)}


def test_transposed_outputs_are_staged_in_shared_memory_and_written_as_rows_of_the_transpose():
    src = cc.emit_map(_transposed)
    assert "__shared__ coda::map::TransposedTile<cutlass::float_e4m3_t, kRows> t3;" in src
    assert "t3.stage(int(m % kRows), lane * coda::map::kVec, out);" in src and "kRows = 32;" in src
    assert "__syncthreads();" in src and "t3.write(p.tensors[3], n * p.views[3].stride_m + m0" in src
    assert "tensors[3]  qt: output e4m3 [N, M] (transposed" in src
    # a program without transposed outputs renders as before: no shared memory, no barrier
    plain = cc.emit_map(E.rope_backward)
    assert "TransposedTile" not in plain and "__syncthreads" not in plain


def test_the_reference_of_a_transposed_output_is_the_transposed_codes():
    X = (torch.randn(64, 48) * 4).to(BF)
    out = cc.map_reference(_transposed, X, s=torch.tensor(0.01))
    assert out["qt"].shape == (48, 64) and torch.equal(out["qt"].view(torch.uint8), out["q"].t().view(torch.uint8))


@cc.epilogue
def _two_transposed_with_blocks(acc, s: cc.DeviceScalar):
    return {"qt": cc.quantize(acc, block=128, transpose=True), "pt": cc.quantize(acc, scale=s, transpose=True)}


def test_block_scaled_transposed_outputs_take_two_passes_over_128_rows():
    """Warp w walks rows 16w .. 16w + 15 of the block's 128 twice; the second pass keeps the
    transposed codes in registers (8 bytes a row) and transposes them there: no shared-memory tile."""
    src = cc.emit_map(_transposed_blocks)
    assert "kRows = 128;" in src and "kRowsPerWarp = kRows / coda::map::kWarps;" in src
    assert "TransposedTile" not in src.split("namespace coda_generated")[1]
    assert "ColumnScales<cutlass::float_e4m3_t, true> cs1;" in src
    first, second = src.index("// First pass"), src.index("// Second pass")
    assert first < second and "cs1.finish(cmax1" in src[first:second]
    assert src[first:].count("const int64_t m = m_first + kRowsPerWarp * warp + j;") == 2
    assert "out[i] = v0[i] * tinv1[i];" in src[second:] and "tq1[j] = coda::map::pack8<cutlass::float_e4m3_t>(out);" in src
    assert "coda::map::write_transposed16(p.tensors[1], p.views[1].stride_m, n0," in src[second:]
    assert "one per 128 x 1 run of each column of X" in src


@cc.epilogue
def _transposed_blocks_of_a_sum(acc, t: cc.Tile, u: cc.Tile(torch.float32), g: cc.PerCol):
    y = acc + t + u * g
    return {"q": cc.quantize(y, block=128), "qt": cc.quantize(y, block=128, transpose=True)}


def test_two_pass_kernels_stage_their_16_bit_inputs_once_in_shared_memory():
    """Both passes of a block-scaled transposed output read X (and further 16-bit tile inputs, while
    they fit STAGE_BYTES) from shared memory, copied there once per block; fp32 tiles, per-column
    vectors and kernels of one pass read global memory as before."""
    from coda_cutlass.lower.map import STAGE_BYTES
    src = cc.emit_map(_transposed_blocks)
    assert "kStageBytes = 65536;" in src and "coda::map::stage8<cutlass::bfloat16_t>(stage0," in src
    first, second = src.index("// First pass"), src.index("// Second pass")
    assert src.index("coda::map::stage_wait();") < first
    assert src[first:].count("load8<cutlass::bfloat16_t>(stage0, int(m - m_first)") == 2
    assert "p.tensors[0], row0" not in src[first:]          # X is never read from global in the passes
    assert STAGE_BYTES == 128 * 256 * 2                     # one bf16 tile: two blocks of ~108 KB per SM
    sum_src = cc.emit_map(_transposed_blocks_of_a_sum)
    assert "stage8<cutlass::bfloat16_t>(stage0," in sum_src and "stage1" not in sum_src   # t would pass the budget
    assert "load8<cutlass::bfloat16_t>(p.tensors[1], row1 + col1" in sum_src
    assert "load8<float>(p.tensors[2], row2 + col2" in sum_src
    plain = cc.emit_map(_transposed)
    assert "kStageBytes = 0;" in plain and "stage8" not in plain.split("namespace coda_generated")[1]


def test_block_scaled_transposed_outputs_are_n_by_m_with_column_run_scales(fake_nvcc):
    k = cc.compile_map(_transposed_blocks, BF)
    X = torch.randn(300, 264).to(BF)                     # M not a multiple of 16: padded rows
    *_, results, _ = k._prepare(X, {}, None)
    assert results["qt"].shape == (264, 300) and results["qt"].stride() == (304, 1)
    assert results["qt_scale"].shape == (264, 3) and results["qt_scale"].stride() == (1, 264)
    ref = cc.map_reference(_transposed_blocks, X)
    from coda_cutlass.quantization import quantize_blocks
    q, s = quantize_blocks(X.float().t(), torch.float8_e4m3fn)
    assert torch.equal(ref["qt"].view(torch.uint8), q.view(torch.uint8)) and torch.equal(ref["qt_scale"], s)


@pytest.mark.parametrize("program,what", [(_two_transposed_with_blocks, "one transposed output when it has 128 x 1"),
                                          (_transposed_half, "half-width transposed")])
def test_transposed_outputs_the_map_kernel_cannot_write_are_refused_by_name(program, what):
    with pytest.raises(cc.EpilogueError, match=what):
        cc.emit_map(program)


def test_map_transposed_outputs_are_n_by_m_and_out_is_checked(fake_nvcc):
    k = cc.compile_map(_transposed, BF)
    X, s = torch.randn(96, 64).to(BF), torch.tensor(0.5)
    *_, results, _ = k._prepare(X, {"s": s}, None)
    assert results["qt"].shape == (64, 96) and results["qt"].dtype == torch.float8_e4m3fn
    buf = torch.empty(128, 96 + 16, dtype=torch.float8_e4m3fn)        # the rows of a larger buffer
    view = buf[32:96, :96]
    assert k._prepare(X, {"s": s}, {"qt": view})[5]["qt"] is view
    assert "expected the transpose of X: (64, 96)" in _message(
        lambda: k._prepare(X, {"s": s}, {"qt": torch.empty(96, 64, dtype=torch.float8_e4m3fn)}))
    assert "leading dimension that is a multiple of 16" in _message(
        lambda: k._prepare(X, {"s": s}, {"qt": torch.empty(64, 104, dtype=torch.float8_e4m3fn)[:, :96]}))
    assert "dtype is torch.float8_e5m2, the kernel was compiled for torch.float8_e4m3fn" in _message(
        lambda: k._prepare(X, {"s": s}, {"qt": torch.empty(64, 96, dtype=torch.float8_e5m2)}))
    assert "a transposed output is a 2-D (N, M) = (64, 96) tensor" in _message(
        lambda: k._prepare(X, {"s": s}, {"qt": torch.empty(64, 96, 1, dtype=torch.float8_e4m3fn)}))


@cc.epilogue
def _doubled(acc, y: cc.Tile):
    return {"D": acc * 2.0 + y, "s": cc.row_sum(acc)}


def test_a_tile_output_may_be_written_over_x_itself_and_nothing_else(fake_nvcc):
    """out={"D": X}: each thread reads its elements of X before it writes them (the LM head writes
    dlogits over its logits chunk). A shifted view of X, or X as another operand's memory, is refused."""
    k = cc.compile_map(_doubled, BF)
    X, y = torch.randn(64, 256).to(BF), torch.randn(64, 256).to(BF)
    assert k._prepare(X, {"y": y}, {"D": X})[5]["D"] is X
    buf = torch.randn(65, 256).to(BF)
    assert "overlaps the memory of X" in _message(lambda: k._prepare(buf[:64], {"y": y}, {"D": buf[1:]}))
    assert "overlaps the memory of y" in _message(lambda: k._prepare(X, {"y": y}, {"D": y}))
    ref = cc.map_reference(_doubled, X, y=y)
    assert torch.equal(ref["D"], (X.float() * 2 + y.float()).to(BF))


# ---------------------------------------------------------------- cc.map_reference checks as the kernel
def test_map_reference_checks_the_call_as_the_kernel_does(fake_nvcc):
    """Same names, dtypes, lengths and out= rules, with the kernel call's messages (no layout rules)."""
    k = cc.compile_map(_checked, BF)
    X, ops = torch.randn(16, 64).to(BF), _checked_ops(16, 64)

    def both(ops, out=None) -> str:
        kernel = _message(lambda: k._prepare(X, ops, out))
        assert _message(lambda: cc.map_reference(_checked, X, out=out, **ops)) == kernel
        return kernel

    renamed = {("tt" if n == "t" else n): v for n, v in ops.items()}
    assert "_checked: unknown operand 'tt'; did you mean 't'?" in both(renamed)
    assert "unknown operand 'extra'" in both({**ops, "extra": ops["t"]})
    assert "v: shape is (16,), expected (64,): one value per column (length N)" in both({**ops, "v": ops["t"][:, 0]})
    assert "v: dtype is torch.float32, the kernel was compiled for torch.bfloat16" in both(
        {**ops, "v": ops["v"].float()})
    assert "t: shape (16, 32) is a (16, 32) matrix, expected (16, 64)" in both({**ops, "t": ops["t"][:, :32]})
    assert both(ops, {"mx": X}) == "out: 'mx' is not a tile output of _checked (tile outputs: D, half)"
    assert "acc_t: is updated in place and overlaps the memory of X" in both({**ops, "acc_t": X})
    # a misspelt option is suggested as the kernel suggests 'out'
    assert "unknown operand 'precison'; did you mean 'precision'?" in _message(
        lambda: cc.map_reference(_checked, X, precison="fp32", **ops))


@pytest.mark.parametrize("program,what", [(_with_lse, "log-sum-exp"), (_with_col_sum, "col reductions"),
                                          (_with_pack, "operand 'z'.*packed pairs"),
                                          (_two_transposed_with_blocks, "one transposed output when it has 128 x 1")])
def test_map_reference_refuses_what_map_kernels_refuse(program, what):
    with pytest.raises(cc.EpilogueError, match=what):
        cc.map_reference(program, torch.randn(8, 256).to(BF), z=torch.zeros(8, 512, dtype=BF))


def test_map_reference_takes_fp32_copies_at_fp32_precision_and_strided_views():
    @cc.epilogue
    def scale_rows(acc, rstd: cc.PerRow(torch.float32), g: cc.PerCol, s: cc.DeviceScalar):
        return {"y": acc * rstd * g * s, "d": cc.accumulate(acc * 2.0)}

    B, S, H, D = 2, 3, 2, 16
    X = torch.randn(B, H, S, D).to(BF).transpose(1, 2)            # (B, S, H, D), strided
    rstd, g, s = torch.rand(B * S), torch.randn(H * D).to(BF), torch.tensor(0.5)
    d = torch.randn(B, H, S, D).to(BF).transpose(1, 2)           # accumulated through a strided view
    want_d = (d.float() + 2 * X.float()).to(BF)
    out = cc.map_reference(scale_rows, X, rstd=rstd, g=g, s=s, d=d)
    assert out["d"] is d and torch.equal(d, want_d)
    x2 = X.reshape(B * S, H * D).float()
    torch.testing.assert_close(out["y"].float(), x2 * rstd[:, None] * g.float() * 0.5, rtol=2e-2, atol=1e-2)
    exact = cc.map_reference(scale_rows, X.float(), dtype=BF, precision="fp32", rstd=rstd, g=g.float(), s=s,
                             d=torch.zeros(B * S, H * D))
    torch.testing.assert_close(exact["y"], x2 * rstd[:, None] * g.float() * 0.5)
    with pytest.raises(cc.CallError, match="X is torch.float32 and no dtype was given"):
        cc.map_reference(scale_rows, X.float(), rstd=rstd, g=g, s=s, d=d)


def test_map_reference_writes_out_tensors_and_lowers_each_typed_program_once(monkeypatch):
    import coda_cutlass.maps as maps
    lowered = []
    real = maps.lower_map
    monkeypatch.setattr(maps, "lower_map", lambda *a: lowered.append(a) or real(*a))
    maps._checked_call.cache_clear()

    @cc.epilogue
    def twice(acc, y: cc.Tile):
        return {"D": acc * 2.0 + y, "h": cc.half_width(acc)}

    X, y = torch.randn(4, 2, 32).to(BF), torch.randn(8, 32).to(BF)
    D, h = torch.empty(4, 2, 32, dtype=BF), torch.empty(8, 16, dtype=BF)
    out = cc.map_reference(twice, X, y=y, out={"D": D, "h": h})
    assert out["D"] is D and out["h"] is h
    assert torch.equal(D.reshape(8, 32), (X.reshape(8, 32).float() * 2 + y.float()).to(BF))
    assert torch.equal(h, X.reshape(8, 32)[:, 0::2])
    cc.map_reference(twice, X, y=y)
    assert len(lowered) == 1
    with pytest.raises(cc.CallError, match=r"out\['h'\]: shape \(8, 32\) is a \(8, 32\) matrix, expected \(8, 16\)"):
        cc.map_reference(twice, X, y=y, out={"h": D.reshape(8, 32)})


def test_map_reference_reads_a_programs_globals_at_each_call():
    """A program is traced at each call, as cc.reference traces it: a cache by the program object
    ran on the global's old value (factor 2 where 3 was set)."""
    global _FACTOR
    X = torch.randn(8, 16).to(BF)
    _FACTOR = 2.0
    a = cc.map_reference(_scaled_by_factor, X)["D"]
    _FACTOR = 3.0
    b = cc.map_reference(_scaled_by_factor, X)["D"]
    assert torch.equal(a, (X.float() * 2).to(BF)) and torch.equal(b, (X.float() * 3).to(BF))


_FACTOR = 1.0


@cc.epilogue
def _scaled_by_factor(acc):
    return {"D": acc * _FACTOR}


def test_map_reference_refuses_a_broadcast_view_accumulated_into_as_a_3d_tensor():
    @cc.epilogue
    def addacc(acc):
        return {"Y": cc.accumulate(acc)}

    X = torch.randn(2, 3, 16).to(BF)
    base = torch.zeros(2, 1, 16).to(BF)
    with pytest.raises(cc.CallError, match="broadcast view"):
        cc.map_reference(addacc, X, Y=base.expand(2, 3, 16))
    assert not base.any()
