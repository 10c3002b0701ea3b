"""``Kernel``: a built kernel, callable from PyTorch (``compiler.CompiledEpilogue`` adds the
reference interpreter on top).

``k(A, W, **operands)`` (FP8 kernels: ``k(A, W, scale_a=, scale_b=, **operands)``, fp8/scales.py)
checks every argument, allocates the outputs, launches the fused GEMM
once on the current stream, finishes the reductions (one small deterministic torch or cuBLAS call
each, by the slot's ``PartialLayout``) and returns a dict of outputs. Accumulated outputs are passed
in by name and updated in place. An A with leading batch dimensions, (..., K), is flattened to
(M, K) like ``nn.Linear`` (``arguments.flatten_batch``). Under ``torch.compile`` the same call goes
through a registered ``torch.library`` custom op.
"""

from __future__ import annotations

import ctypes
import math
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ..build.builder import BuildResult
from ..build.resources import Resources, read_resources
from ..config import KernelConfig
from ..dtypes import as_dtype
from ..env import env_flag
from ..errors import CallError, DeviceError
from ..fp8.scales import SCALE_NAMES, check_fp8_shapes, check_scales, split_scales
from ..frontend.trace import CALL_KEYWORDS, SCALE_KEYWORDS
from ..ir.nodes import Kind
from ..ir.printer import format_program
from ..partials import PartialLayout
from ..pipeline import Generated
from . import checks
from .arguments import CallSpec, flatten_batch
from .library import KernelLibrary, load
from .torch_op import call_op, register

_RASTER = {"heuristic": 0, "m": 1, "n": 2}
_READY_DEVICES: set[int | None] = set()   # devices checked to be usable sm_90 GPUs


def current_stream(device: torch.device) -> int:
    """The raw cudaStream_t of the current torch stream of `device` (cheap private API if present)."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is not None:
        return get(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


BUILT = "The kernel is built and can be inspected (.source, .path) or shipped"


def ensure_gpu(device: torch.device | None, what: str, without_gpu: str = BUILT) -> None:
    """``without_gpu``: what the object is good for on a machine without a GPU (said in the error)."""
    if not torch.cuda.is_available():
        raise DeviceError(f"{what}: no CUDA GPU is available. {without_gpu}, but running it needs a Hopper GPU "
                          "(sm_90: H100/H200)")
    if device is None or device.type != "cuda":
        return  # the argument checks report the wrong device
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = torch.cuda.get_device_capability(index)
    if cap != (9, 0):
        raise DeviceError(f"{what}: kernels are built for sm_90a (Hopper: H100/H200), but cuda:{index} is "
                          f"{torch.cuda.get_device_name(index)} with compute capability {cap[0]}.{cap[1]}")
    if device.index is not None:
        _READY_DEVICES.add(device.index)


def _kernel_ld(layout: str, ld: int) -> int:
    """The row stride the kernel gets: packed 16-bit pairs are addressed as 32-bit words."""
    return ld // 2 if layout == "packed" else ld


# CODA_CUTLASS_POISON=1 fills every buffer the runtime allocates with NaN before the launch, so an
# element the kernel fails to write shows up (used by the GPU tests). Read at call time (a bad value
# is an error of the call, not of `import coda_cutlass`); tests may set POISON to force it.
POISON: bool | None = None


def poison_enabled() -> bool:
    return env_flag("CODA_CUTLASS_POISON", False) if POISON is None else POISON


def new_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, poison: bool) -> torch.Tensor:
    """A buffer the runtime allocates (GEMM and map kernels): NaN-filled when ``poison`` (pass
    ``POISON`` read at call time: tests switch it)."""
    if poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


class ReductionOutputs:
    """The reduction outputs of GEMM and map kernels: ``_finish_plan`` maps each to (its partials
    layout, the finished dtype), ``_partials_tile`` is the (rows, columns) tile each partial covers;
    with ``partial_reductions`` the partials are returned unfinished."""

    partial_reductions: bool
    _finish_plan: dict[str, tuple[PartialLayout, torch.dtype]]
    _partials_tile: tuple[int, int]

    def reduction_result(self, name: str, M: int, N: int) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of a returned reduction: finished, or per-tile partials (tiles, length)."""
        partials, dtype = self._finish_plan[name]
        if self.partial_reductions:
            return partials.partial_shape(M, N, self._partials_tile), torch.float32
        return partials.result_shape(M, N), dtype

    def _empty_reductions(self, M: int, N: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Reductions over an empty M or N: the identity of the reduction (no launch)."""
        out: dict[str, torch.Tensor] = {}
        for name, (partials, _) in self._finish_plan.items():
            shape, dtype = self.reduction_result(name, M, N)
            out[name] = torch.full(shape, partials.identity, dtype=dtype, device=device)
        return out


class Kernel(ReductionOutputs):
    """A fused GEMM + epilogue kernel. Attributes to inspect: ``source`` (the generated CUDA),
    ``ir`` (the typed IR), ``graph`` (the visitor graph), ``plan`` (graph + configuration),
    ``path`` (the .so), ``config``, ``key``."""

    def __init__(self, generated: Generated, build: BuildResult, partial_reductions: bool = False):
        self.program = generated.program
        self.name = generated.program.name
        self.ir = generated.ir
        self.graph = generated.graph
        self.plan = generated.plan
        self.source = generated.source
        self.options = generated.options
        self.config: KernelConfig = generated.config
        self.dtype = self.options.dtype         # 16-bit operands; FP8 kernels: bf16, their epilogue default
        self.fp8 = self.options.fp8             # FP8 operands (A/W dtypes, scaling), else None
        self._a_dtype = self.fp8.a if self.fp8 else self.dtype
        self._w_dtype = self.fp8.w if self.fp8 else self.dtype
        self.gemm_scales: tuple[str, ...] = SCALE_NAMES if self.fp8 else ()
        self.weight_layout = self.options.weight_layout
        self.path: Path = build.path
        self.key = build.key
        self.source_key = build.source_key
        self.origin = build.origin
        self.build_seconds = build.seconds
        self.partial_reductions = partial_reductions
        self.outputs = self.ir.outputs
        self.spec = CallSpec.of(self.ir)
        self.inout = tuple(n.attr("name") for n in self.ir.nodes if n.op == "store" and n.attr("accumulate"))
        self.operands = tuple(o for o in self.ir.operands if o.name not in self.inout)
        self._slots_by_name = {t.name: t for t in self.graph.tensors}
        # Precomputed call plan (the eager path runs on every launch).
        self._arg_names = tuple(o.name for o in self.operands) + self.inout
        self._n_args = len(self._arg_names)
        self._tile_outputs = tuple(t.name for t in self.graph.tensors if t.role == "output")
        self.scale_outputs = tuple(t.name for t in self.graph.tensors if t.layout == "scale")
        self._scalar_names = tuple(o.name for o in self.operands if o.host_scalar)
        self._unused_tensors = tuple(o for o in self.spec.operands
                                     if not o.host_scalar and o.name not in self._slots_by_name)
        self._n_slots = len(self.graph.tensors)
        self._ptr_array = ctypes.c_void_p * max(self._n_slots, 1)
        self._ld_array = ctypes.c_int64 * max(self._n_slots, 1)
        self._scalar_array = ctypes.c_float * max(len(self._scalar_names), 1)
        self._raster = _RASTER[self.config.raster]
        # reduction output -> (its partials layout, the finished dtype)
        self._finish_plan = {n.attr("name"): (self._slots_by_name[n.attr("name")].partials,
                                              as_dtype(n.attr("out_dtype", "f32")).torch)
                             for n in self.ir.nodes if n.op == "reduce"}
        self._partials_tile = self.config.tile
        self._uses_index = self.spec.uses_index   # element indices must stay exact, segments divide N
        # Registered now, not on first use: torch.compile cannot trace op registration.
        self._op = register(self)

    # ------------------------------------------------------------------ inspection
    def __repr__(self) -> str:
        args = ", ".join(["A", "W"] + list(self.gemm_scales) + [o.name for o in self.operands] + list(self.inout))
        operands = self.fp8.describe() if self.fp8 else self.dtype.name
        return (f"<{type(self).__name__} {self.name}({args}) -> ({', '.join(self.outputs)}) "
                f"{operands} W={self.weight_layout} {self.config.name()} [{self.origin}] {self.path}>")

    def describe(self) -> str:
        return format_program(self.ir)

    @property
    def resources(self) -> Resources | None:
        """ptxas's registers, stack frame and spills for this kernel (None: not recorded)."""
        return read_resources(self.path)

    @cached_property
    def library(self) -> KernelLibrary:
        lib = load(self.path)
        expected = self.plan.describe()
        if lib.description != expected:
            raise CallError(f"kernel library {self.path} does not match the program it was loaded for "
                            "(a stale or foreign prebuilt kernel?)")
        return lib

    # ------------------------------------------------------------------ calling
    def __call__(self, A: torch.Tensor, W: torch.Tensor, /, *, raster: str | None = None, swizzle: int | None = None,
                 out: dict[str, torch.Tensor] | None = None, **operands: Any) -> dict[str, torch.Tensor]:
        """Run the fused kernel: ``k(A, W, name=tensor, ...)`` -> dict of outputs.

        ``out`` may give preallocated (M, N) tensors (or row-major views) for tile outputs.
        ``raster`` ("heuristic", "m", "n") and ``swizzle`` (1, 2, 4, 8) override the config's
        tile-scheduler order for this call. An A of shape (..., K) is flattened to (M, K) like
        ``nn.Linear``: tile operands and ``out`` tensors are then (..., N), per-row vectors (...),
        and tile outputs and row reductions come back with the leading dimensions."""
        if isinstance(A, torch.Tensor) and A.dim() > 2:     # (also a traced tensor under torch.compile)
            A2, flat, flat_out, batch = flatten_batch(self.spec, A, W, operands, self.weight_layout, out)
            given = {n: operands[n] for n in self.inout if n in operands}
            given.update(out or {})
            return batch.restore(self.spec, self(A2, W, raster=raster, swizzle=swizzle, out=flat_out, **flat),
                                 given, self.partial_reductions)
        if torch.compiler.is_compiling():
            if out is not None:
                raise CallError("out= is not supported under torch.compile")
            return call_op(self, A, W, operands, raster=raster, swizzle=swizzle)
        return self.run(A, W, operands, raster=raster, swizzle=swizzle, out=out)

    def _check_names(self, operands: dict[str, Any]) -> None:
        rest = dict(operands)
        split_scales(rest, self.fp8, self.name)
        self.spec.check_names(rest, keywords=CALL_KEYWORDS | SCALE_KEYWORDS if self.fp8 else CALL_KEYWORDS)

    def run(self, A: torch.Tensor, W: torch.Tensor, operands: dict[str, Any], *, raster: str | None = None,
            swizzle: int | None = None, out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The eager call path. Kept lean: it is pure host overhead on every launch."""
        device = A.device if type(A) is torch.Tensor else None
        if device is None or device.index not in _READY_DEVICES:
            ensure_gpu(device, self.name)
        M, N, K, lda, ldw = checks.check_gemm(A, W, self._a_dtype, self.weight_layout, self._w_dtype)
        if self._uses_index:
            self.spec.check_extent(M, N)
        if device.index != torch.cuda.current_device():
            with torch.cuda.device(device):     # the kernel launches on the current device
                return self.run(A, W, operands, raster=raster, swizzle=swizzle, out=out)
        scale_ld: dict[str, int] = {}
        if self.fp8 is not None:
            operands = dict(operands)
            scales = split_scales(operands, self.fp8, self.name)
            check_fp8_shapes(self.fp8, M, N, K, self.name)
            scale_ld = dict(zip(SCALE_NAMES, check_scales(self.fp8, scales, M, N, K, device)))
        if len(operands) != self._n_args or not all(n in operands for n in self._arg_names):
            self._check_names(operands)
        if out:
            checks.check_out_names(self.name, out, self._tile_outputs)
        poison = poison_enabled()
        scalars = [checks.check_scalar(name, operands[name]) for name in self._scalar_names]
        for o in self._unused_tensors:     # operands the program does not use: still checked
            self.spec.check_operand(o, operands[o.name], M, N, device)

        ptrs = [0] * self._n_slots
        lds = [0] * self._n_slots
        results: dict[str, torch.Tensor] = {}
        partials: list[tuple[str, torch.Tensor]] = []
        written: dict[str, torch.Tensor] | None = None
        for s in self.graph.tensors:
            role, name, i = s.role, s.name, s.index
            if role == "output":
                t = out.get(name) if out else None
                rows, cols = s.storage(M, N)
                if t is not None:
                    if s.layout == "scale":
                        raise CallError(f"{self.name}: out['{name}']: block scales are allocated by the kernel call")
                    where = f"out['{name}']"
                    lds[i] = (checks.check_register_matrix(where, t, rows, cols, s.dtype, device)
                              if s.stored_from_registers else
                              checks.check_tile(where, t, rows, cols, s.dtype, device))
                    written = written or {}
                    written[name] = t
                else:
                    t = new_buffer((rows, cols), s.dtype.torch, device, poison)
                    lds[i] = cols
                lds[i] = _kernel_ld(s.layout, lds[i])
                results[name] = s.view(t, M, N)
            elif role == "partials":
                t = new_buffer(s.partials.buffer_shape(M, N, self.config.tile), torch.float32, device, poison)
                partials.append((name, t))
            elif role == "gemm_scale":
                t = scales[name]
                lds[i] = scale_ld[name]
            else:
                t = operands[name]
                if s.kind == Kind.TILE:
                    lds[i] = _kernel_ld(s.layout, checks.check_tile(name, t, M, s.columns(N), s.dtype, device))
                elif s.kind == Kind.SCALAR:
                    checks.check_device_scalar(name, t, device)
                else:
                    self._check_vector(name, s.kind, t, s.dtype, M, N, device)
                if role == "inout":
                    results[name] = t
                    written = written or {}
                    written[name] = t
            ptrs[i] = t.data_ptr()
        if written:
            read = {"A": A, "W": W}
            read.update((s.name, operands[s.name]) for s in self.graph.tensors if s.role == "input")
            checks.check_no_overlap(written, read)

        if M == 0 or N == 0:
            results.update(self._empty_reductions(M, N, device))
            return {name: results[name] for name in self.outputs}

        lib = self.library
        ws_bytes = lib.workspace_size(M, N, K)
        workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=device) if ws_bytes else None
        raster_i = self._raster if raster is None else _RASTER.get(raster)
        if raster_i is None:
            raise CallError(f"raster must be one of {tuple(_RASTER)}, got {raster!r}")
        swz = self.config.swizzle if swizzle is None else swizzle
        if swz not in (1, 2, 4, 8):
            raise CallError(f"swizzle must be 1, 2, 4 or 8, got {swizzle!r}")
        status = lib.run(
            A.data_ptr(), lda, W.data_ptr(), ldw, M, N, K,
            self._ptr_array(*ptrs), self._ld_array(*lds), self._scalar_array(*scalars),
            raster_i, swz, workspace.data_ptr() if workspace is not None else None, ws_bytes,
            current_stream(device))
        if status != 0:
            raise (DeviceError if status >= 7 else CallError)(
                f"{self.name}: the kernel refused the call before launch: {lib.status_string(status)} "
                f"(M={M}, N={N}, K={K})")
        for name, buf in partials:
            results[name] = self._finish(name, buf, M, N)
        return {name: results[name] for name in self.outputs}

    def _check_vector(self, name: str, kind: Kind, t: Any, dtype, M: int, N: int, device: torch.device) -> None:
        if kind == Kind.ROW:
            checks.check_vector(name, t, M, "row (length M)", dtype, device)
        else:
            checks.check_vector(name, t, N, "column (length N)", dtype, device)

    def _finish(self, name: str, buf: torch.Tensor, M: int, N: int) -> torch.Tensor:
        """Finish fp32 partials [tiles, padded length] with one small deterministic call (sums: cuBLAS)."""
        partials, dtype = self._finish_plan[name]
        if self.partial_reductions:
            return partials.partial_view(buf, M, N)
        r = partials.finish(buf, M, N, self.config.tile_n)
        return r if dtype is torch.float32 else r.to(dtype)

    def output_spec(self, name: str, M: int, N: int) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of a returned output (what the fake implementation allocates)."""
        if name in self._finish_plan:
            return self.reduction_result(name, M, N)
        slot = self._slots_by_name[name]
        return slot.shape(M, N), slot.dtype.torch

    def output_stride(self, name: str, M: int, N: int) -> tuple[int, ...]:
        """Strides of a returned output: partials keep their padded buffer's, the rest are contiguous."""
        if name in self._finish_plan and self.partial_reductions:
            return self._finish_plan[name][0].partial_stride(M, N, self._partials_tile)
        shape = self.output_spec(name, M, N)[0]
        return tuple(math.prod(max(d, 1) for d in shape[i + 1:]) for i in range(len(shape)))

    # ------------------------------------------------------------------ torch.library
    @property
    def op(self) -> Any:
        """The registered torch custom op (for torch.compile and torch.library users)."""
        return self._op


__all__ = ["Kernel", "ReductionOutputs", "ensure_gpu", "new_buffer"]
