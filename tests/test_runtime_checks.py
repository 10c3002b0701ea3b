"""Argument checks that run before any launch (exercised on CPU tensors)."""

from __future__ import annotations

import pytest
import torch

import coda_cutlass as cc
from coda_cutlass.dtypes import BF16, F32
from coda_cutlass.runtime import checks


def test_tma_matrix_accepts_row_major_and_padded_views():
    t = torch.zeros(16, 64, dtype=torch.bfloat16)
    assert checks.check_tma_matrix("t", t, 16, 64, 2) == 64
    padded = torch.zeros(16, 72, dtype=torch.bfloat16)[:, :64]
    assert checks.check_tma_matrix("t", padded, 16, 64, 2) == 72


@pytest.mark.parametrize("make,match", [
    (lambda: torch.zeros(64, 16, dtype=torch.bfloat16).t(), "unit column stride"),
    (lambda: torch.zeros(16, 68, dtype=torch.bfloat16)[:, :64], "multiple of 16 bytes"),
    (lambda: torch.zeros(16 * 64 + 8, dtype=torch.bfloat16)[1:16 * 64 + 1].view(16, 64), "16-byte aligned"),
    (lambda: torch.zeros(16, 32, dtype=torch.bfloat16), "shape"),
    (lambda: torch.zeros(64, dtype=torch.bfloat16).as_strided((16, 64), (0, 1)), "overlapping rows"),
])
def test_tma_matrix_rejections(make, match):
    with pytest.raises(cc.CallError, match=match):
        checks.check_tma_matrix("t", make(), 16, 64, 2)


def test_register_matrix_keeps_the_stride_of_a_view():
    """Outputs written from registers (half-width, transposed, quantised) have no 16-byte rules, but
    a column slice of a wider buffer must still be addressed with the buffer's row stride (the
    stride was once dropped for them: rows of a sliced out= landed in the wrong places)."""
    cpu = torch.device("cpu")
    buf = torch.zeros(16, 70, dtype=torch.bfloat16)
    assert checks.check_register_matrix("y", buf[:, 1:65], 16, 64, BF16, cpu) == 70
    assert checks.check_register_matrix("y", buf[:, :64], 16, 64, BF16, cpu) == 70
    assert checks.check_register_matrix("y", torch.zeros(1, 64, dtype=torch.bfloat16), 1, 64, BF16, cpu) == 64
    with pytest.raises(cc.CallError, match="unit column stride"):
        checks.check_register_matrix("y", torch.zeros(64, 16, dtype=torch.bfloat16).t(), 16, 64, BF16, cpu)
    with pytest.raises(cc.CallError, match="overlapping rows"):
        checks.check_register_matrix("y", torch.zeros(64, dtype=torch.bfloat16).as_strided((16, 64), (0, 1)),
                                     16, 64, BF16, cpu)
    with pytest.raises(cc.CallError, match="dtype"):
        checks.check_register_matrix("y", torch.zeros(16, 64), 16, 64, BF16, cpu)
    with pytest.raises(cc.CallError, match="shape"):
        checks.check_register_matrix("y", torch.zeros(16, 32, dtype=torch.bfloat16), 16, 64, BF16, cpu)


def test_vector_checks():
    cpu = torch.device("cpu")
    checks.check_vector("g", torch.zeros(8, dtype=torch.bfloat16), 8, "column", BF16, cpu)
    with pytest.raises(cc.CallError, match=r"expected \(8,\)"):
        checks.check_vector("g", torch.zeros(9, dtype=torch.bfloat16), 8, "column", BF16, cpu)
    with pytest.raises(cc.CallError, match="dtype"):
        checks.check_vector("g", torch.zeros(8), 8, "column", BF16, cpu)
    with pytest.raises(cc.CallError, match="contiguous"):
        checks.check_vector("g", torch.zeros(16, dtype=torch.bfloat16)[::2], 8, "column", BF16, cpu)
    with pytest.raises(cc.CallError, match="torch.Tensor"):
        checks.check_vector("g", [1.0] * 8, 8, "column", F32, cpu)


def test_scalar_checks():
    assert checks.check_scalar("s", 2) == 2.0
    assert checks.check_scalar("s", torch.tensor(1.5)) == 1.5
    with pytest.raises(cc.CallError, match="number"):
        checks.check_scalar("s", "2")
    with pytest.raises(cc.CallError, match="number"):
        checks.check_scalar("s", True)
    # a meta tensor reached .item() and torch's "cannot be called on meta tensors" RuntimeError
    with pytest.raises(cc.CallError, match="s: a runtime scalar on meta has no value to read"):
        checks.check_scalar("s", torch.tensor(1.5, device="meta"))


def test_gemm_checks_on_cpu_tensors():
    A = torch.zeros(16, 64, dtype=torch.bfloat16)
    with pytest.raises(cc.CallError, match="CUDA GPU"):
        checks.check_gemm(A, A, BF16, "nk")


def test_overlap_of_updated_tensor_is_refused():
    base = torch.zeros(32, 64)
    with pytest.raises(cc.CallError, match="overlaps"):
        checks.check_no_overlap({"dx": base[:16]}, {"x": base[8:24]})
    checks.check_no_overlap({"dx": base[:16]}, {"x": base[16:]})


def test_call_without_gpu_is_a_device_error_not_a_crash(monkeypatch):
    from coda_cutlass.runtime.kernel import ensure_gpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(cc.DeviceError, match="sm_90"):
        ensure_gpu(torch.device("cpu"), "k")


def test_column_halves_of_one_matrix_are_not_an_overlap_but_shared_columns_are():
    from coda_cutlass.runtime.checks import check_no_overlap
    t = torch.empty(64, 256)
    check_no_overlap({"a": t[:, :128], "b": t[:, 128:]}, {})          # interleaved extents, disjoint elements
    check_no_overlap({"a": t[:, :100], "b": t[:, 100:]}, {"x": torch.empty(8)})
    with pytest.raises(cc.CallError, match="a: is updated in place and overlaps the memory of b"):
        check_no_overlap({"a": t[:, :129], "b": t[:, 128:]}, {})
    with pytest.raises(cc.CallError, match="overlaps"):
        check_no_overlap({"a": t[:, :128]}, {"b": t[1:, :128]})
    with pytest.raises(cc.CallError, match="overlaps"):
        check_no_overlap({"a": t[:, :128]}, {"b": t.t()})            # another stride: by extent


def test_scalar_refuses_complex_and_bool_tensors():
    # a complex tensor reached float(v.item()) and raised a bare TypeError; a bool tensor (a mask passed
    # by mistake) was read as 1.0 while a Python bool is refused
    @cc.epilogue
    def scaled(acc, s: cc.Scalar):
        return acc * s

    A = torch.randn(8, 8, dtype=torch.bfloat16)
    with pytest.raises(cc.CallError, match=r"s: a runtime scalar is a real number, got a torch.complex64 tensor"):
        cc.reference(scaled, A, A, s=torch.tensor(1 + 2j))
    with pytest.raises(cc.CallError, match=r"s: a runtime scalar is a real number, got a torch.bool tensor"):
        checks.check_scalar("s", torch.tensor(True))
    assert checks.check_scalar("s", torch.tensor(3)) == 3.0
