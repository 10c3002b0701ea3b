"""Argument checks run before every launch. Each failure names the argument and what is wrong.

TMA (the Hopper tensor memory accelerator) reads and writes M x N tiles, A and W: their base
pointers must be 16-byte aligned, their innermost stride 1, and their row strides a multiple of
16 bytes (8 elements for 16-bit types). Vectors are read element by element.

With ``tma=False`` the same checks run without those of memory layout (strides, alignment, a CUDA
device): what ``cc.reference`` checks, with the same messages. ``fp32_ok`` also accepts float32
tensors (the reference's ``precision="fp32"`` on fp32 copies).
"""

from __future__ import annotations

from numbers import Real
from typing import Any, Iterable, Sequence

import torch

from ..dtypes import DType
from ..errors import CallError


def _is_tensor(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise CallError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise CallError(f"{name}: is on {t.device}, but A is on {device}; all tensors must be on the same device")


def _dtype(name: str, t: torch.Tensor, dtype: DType, fp32_ok: bool = False) -> None:
    if t.dtype != dtype.torch and not (fp32_ok and t.dtype == torch.float32):
        also = " (or torch.float32 with precision='fp32')" if fp32_ok else ""
        raise CallError(f"{name}: dtype is {t.dtype}, the kernel was compiled for {dtype.torch}{also}"
                        " (compile with dtype/input_dtypes/output_dtypes, or convert the tensor)")


def _shape(name: str, t: torch.Tensor, rows: int, cols: int) -> None:
    if t.dim() != 2 or tuple(t.shape) != (rows, cols):
        raise CallError(f"{name}: shape is {tuple(t.shape)}, expected ({rows}, {cols})")


def _row_stride(name: str, t: torch.Tensor, rows: int, cols: int) -> int:
    """A rows x cols row-major matrix (unit column stride, rows not overlapping) -> its row stride."""
    _shape(name, t, rows, cols)
    if cols > 1 and t.stride(1) != 1:
        raise CallError(f"{name}: must be row-major with unit column stride, got strides {t.stride()}; "
                        "call .contiguous()")
    ld = t.stride(0) if rows > 1 else max(cols, t.stride(0))
    if ld < cols:
        raise CallError(f"{name}: row stride {t.stride(0)} is smaller than the row length {cols} "
                        "(overlapping rows)")
    return ld


def check_tma_matrix(name: str, t: torch.Tensor, rows: int, cols: int, elem_bytes: int) -> int:
    """Checks a row-major matrix read or written by TMA; returns its row stride in elements."""
    ld = _row_stride(name, t, rows, cols)
    if (ld * elem_bytes) % 16 != 0:
        raise CallError(f"{name}: row stride of {ld} elements is not a multiple of 16 bytes, which TMA needs "
                        f"(use a multiple of {16 // elem_bytes} elements, e.g. by padding the last dimension)")
    if t.data_ptr() % 16 != 0:
        raise CallError(f"{name}: data pointer is not 16-byte aligned (a view at an element offset?); "
                        "TMA needs aligned tiles: call .clone() or start the view at an aligned offset")
    return ld


def check_register_matrix(name: str, t: Any, rows: int, cols: int, dtype: DType, device: torch.device) -> int:
    """Checks a row-major matrix that a coda node writes from registers (no TMA, so no 16-byte
    rules); returns its row stride in elements: a view into a wider buffer keeps its stride."""
    t = _is_tensor(name, t)
    _device(name, t, device)
    _dtype(name, t, dtype)
    return _row_stride(name, t, rows, cols)


def _fast_matrix(t: Any, rows: int, cols: int, dtype: torch.dtype, device: torch.device, elem: int) -> int:
    """The common case in one expression: a well-formed row-major matrix -> its row stride, else -1
    (then the detailed check runs and says what is wrong)."""
    if type(t) is torch.Tensor and t.dtype is dtype and t.device == device and t.shape == (rows, cols) and rows > 1:
        s0, s1 = t.stride()
        if s1 == 1 and s0 >= cols and (s0 * elem) % 16 == 0 and t.data_ptr() % 16 == 0:
            return s0
    return -1


def check_gemm(A: Any, W: Any, dtype: DType, weight_layout: str, w_dtype: DType | None = None
               ) -> tuple[int, int, int, int, int]:
    """Returns (M, N, K, lda, ldw). ``w_dtype``: W's dtype when it is not ``dtype`` (mixed FP8)."""
    w_dtype = w_dtype or dtype
    if type(A) is torch.Tensor and type(W) is torch.Tensor and A.dim() == 2 and W.dim() == 2 and A.is_cuda:
        M, K = A.shape
        N = W.shape[0] if weight_layout == "nk" else W.shape[1]
        elem = dtype.bits // 8
        if K > 0 and K % (16 // elem) == 0 and N % 8 == 0 and N > 0:
            lda = _fast_matrix(A, M, K, dtype.torch, A.device, elem)
            ldw = (_fast_matrix(W, N, K, w_dtype.torch, A.device, elem) if weight_layout == "nk"
                   else _fast_matrix(W, K, N, w_dtype.torch, A.device, elem))
            if lda > 0 and ldw > 0:
                return M, N, K, lda, ldw
    return _check_gemm_detailed(A, W, dtype, weight_layout, w_dtype)


def _check_gemm_detailed(A: Any, W: Any, dtype: DType, weight_layout: str, w_dtype: DType
                         ) -> tuple[int, int, int, int, int]:
    A = _is_tensor("A", A)
    W = _is_tensor("W", W)
    if not A.is_cuda:
        raise CallError(f"A: is on {A.device}; the kernel runs on a CUDA GPU")
    M, N, K = check_gemm_shapes(A, W, dtype, weight_layout, w_dtype=w_dtype)
    elem = dtype.bits // 8
    lda = check_tma_matrix("A", A, M, K, elem) if M > 0 else K
    w_rows, w_cols = (N, K) if weight_layout == "nk" else (K, N)
    ldw = check_tma_matrix("W", W, w_rows, w_cols, elem) if N > 0 else w_cols
    return M, N, K, lda, ldw


def check_gemm_shapes(A: Any, W: Any, dtype: DType, weight_layout: str, fp32_ok: bool = False,
                      w_dtype: DType | None = None) -> tuple[int, int, int]:
    """Types, device, dtypes and shapes of A and W, without their memory layout; returns (M, N, K).
    ``w_dtype``: W's dtype when it is not ``dtype`` (mixed FP8)."""
    A = _is_tensor("A", A)
    W = _is_tensor("W", W)
    _device("W", W, A.device)
    _dtype("A", A, dtype, fp32_ok)
    _dtype("W", W, w_dtype or dtype, fp32_ok)
    if A.dim() != 2:
        raise CallError(f"A: expected an (M, K) tensor, or (..., K) with leading batch dimensions, got shape "
                        f"{tuple(A.shape)}")
    if W.dim() != 2:
        raise CallError(f"W: expected a 2-D tensor, got shape {tuple(W.shape)}")
    M, K = A.shape
    if weight_layout == "nk":
        N, Kw = W.shape
        layout = "(N, K) as in nn.Linear"
    else:
        Kw, N = W.shape
        layout = "(K, N)"
    if Kw != K:
        raise CallError(f"W: shape {tuple(W.shape)} does not match A {tuple(A.shape)}: W is laid out {layout}, "
                        f"so its K is {Kw} but A's K is {K}")
    if K == 0:
        raise CallError("K is 0: the accumulator would be all zeros; not supported (pass K > 0)")
    k_multiple = 16 // (dtype.bits // 8)
    for name, n, multiple, what in (("K", K, k_multiple, dtype.torch), ("N", N, 8, "16-bit outputs"
                                                                          if dtype.bits == 8 else dtype.torch)):
        if n % multiple != 0:
            raise CallError(f"{name} = {n} is not a multiple of {multiple}: TMA needs 16-byte aligned rows for "
                            f"{what} (pad {name} to a multiple of {multiple})")
    return M, N, K


def check_tile(name: str, t: Any, M: int, N: int, dtype: DType, device: torch.device, *, tma: bool = True,
               fp32_ok: bool = False) -> int:
    ld = _fast_matrix(t, M, N, dtype.torch, device, dtype.bits // 8) if tma else -1
    if ld > 0:
        return ld
    t = _is_tensor(name, t)
    _device(name, t, device)
    _dtype(name, t, dtype, fp32_ok)
    if not tma or M == 0 or N == 0:
        _shape(name, t, M, N)
        return N
    return check_tma_matrix(name, t, M, N, dtype.bits // 8)


def check_vector(name: str, t: Any, length: int, what: str, dtype: DType, device: torch.device, *,
                 tma: bool = True, fp32_ok: bool = False) -> None:
    if (type(t) is torch.Tensor and t.dtype is dtype.torch and t.device == device and t.shape == (length,)
            and t.stride() == (1,)):
        return
    t = _is_tensor(name, t)
    _device(name, t, device)
    _dtype(name, t, dtype, fp32_ok)
    if t.dim() != 1 or t.shape[0] != length:
        raise CallError(f"{name}: shape is {tuple(t.shape)}, expected ({length},): one value per {what}")
    if tma and length > 1 and t.stride(0) != 1:
        raise CallError(f"{name}: must be contiguous (stride 1), got stride {t.stride(0)}; call .contiguous()")


def check_device_scalar(name: str, t: Any, device: torch.device, *, fp32_ok: bool = True) -> None:
    """A cc.DeviceScalar: one fp32 value in a tensor on the call's device (read by the kernel)."""
    if type(t) is torch.Tensor and t.dtype is torch.float32 and t.device == device and t.numel() == 1:
        return
    if not isinstance(t, torch.Tensor):
        raise CallError(f"{name}: a cc.DeviceScalar operand is a 0-dim fp32 tensor on the GPU (read by the kernel "
                        f"without a host sync), got {type(t).__name__}")
    _device(name, t, device)
    if t.dtype is not torch.float32:
        raise CallError(f"{name}: dtype is {t.dtype}, expected torch.float32 (a cc.DeviceScalar)")
    if t.numel() != 1:
        raise CallError(f"{name}: shape is {tuple(t.shape)}, expected a 0-dim (one-element) tensor")


def check_out_names(program: str, out: Iterable[str], tile_outputs: Sequence[str]) -> None:
    """``out=`` names tile outputs only (reductions and accumulated outputs cannot be given)."""
    for name in out:
        if name not in tile_outputs:
            raise CallError(f"out: '{name}' is not a tile output of {program} (tile outputs: "
                            f"{', '.join(tile_outputs) or 'none'})")


def check_scalar(name: str, v: Any) -> float:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise CallError(f"{name}: a runtime scalar must be a Python number or a 1-element tensor")
        if v.is_complex() or v.dtype == torch.bool:    # as a Python complex or bool: refused, not read as 1.0
            raise CallError(f"{name}: a runtime scalar is a real number, got a {v.dtype} tensor")
        if v.is_cuda:
            raise CallError(f"{name}: a CUDA tensor as a scalar would need a device sync; pass a Python number")
        if v.device.type != "cpu":    # a meta tensor has no value: .item() raised torch's own RuntimeError
            raise CallError(f"{name}: a runtime scalar on {v.device} has no value to read; pass a Python number "
                            "or a CPU tensor (a GPU-resident scale is a cc.DeviceScalar)")
        return float(v.item())
    if isinstance(v, bool) or not isinstance(v, Real):
        raise CallError(f"{name}: expected a number, got {type(v).__name__}")
    try:
        return float(v)
    except OverflowError:
        raise CallError(f"{name}: {str(v)[:20]}... is too large for an fp32 scalar") from None


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range [first, last + 1) a tensor's elements span."""
    p = t.data_ptr()
    if t.numel() == 0:
        return (p, p)
    last = 0
    for size, stride in zip(t.shape, t.stride()):
        last += (size - 1) * stride
    return (p, p + (last + 1) * t.element_size())


def _column_blocks_apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two row-major matrices with the same row stride whose column ranges never meet within a row
    (e.g. the two halves ``t[:, :n]`` and ``t[:, n:]`` of one matrix): disjoint though their extents
    interleave."""
    if a.dim() != 2 or b.dim() != 2 or a.element_size() != b.element_size() or 0 in (a.numel(), b.numel()):
        return False
    if a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) != b.stride(0):
        return False
    es, pitch = a.element_size(), a.stride(0) * a.element_size()
    if a.data_ptr() > b.data_ptr():
        a, b = b, a
    shift = (b.data_ptr() - a.data_ptr()) % pitch
    return shift >= a.shape[1] * es and shift + b.shape[1] * es <= pitch


def check_no_overlap(written: dict[str, torch.Tensor], read: dict[str, torch.Tensor]) -> None:
    """An accumulated (read-then-written) tensor must not share memory with any other argument:
    tiles are read and written asynchronously by different CTAs."""
    # each tensor's extent once (this runs on every launch with an output given: host time)
    items = [(n, t, _extent(t)) for n, t in written.items()]
    reads = [(n, t, _extent(t)) for n, t in read.items()]
    for i, (wn, wt, (w0, w1)) in enumerate(items):
        for on, ot, (o0, o1) in [r for r in reads if r[0] != wn] + items[i + 1:]:
            if w0 < o1 and o0 < w1 and not _column_blocks_apart(wt, ot):
                raise CallError(f"{wn}: is updated in place and overlaps the memory of {on}; pass a separate tensor")
