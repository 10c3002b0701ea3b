"""``CompiledMap``: a built map kernel (an epilogue program over an existing tensor, no GEMM).

``k(X, **operands)`` checks every argument, allocates the outputs, launches once on the current
stream, finishes the row reductions (one small deterministic call each) and returns a dict of
outputs, like a GEMM epilogue kernel. ``X`` and the tile operands may be 2-D (M, N), 3-D (B, S, N)
or 4-D (B, S, H, D) strided tensors (unit innermost stride): a 4-D one is read as the
(B * S) x (H * D) matrix, so e.g. attention gradients laid out (B, H, S, D) and transposed to
(B, S, H, D) need no copy. Outputs are returned as (M, N) matrices, transposed ones as (N, M) (or
written into ``out=``).
"""

from __future__ import annotations

import ctypes
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ..build.builder import BuildResult
from ..build.resources import Resources, read_resources
from ..errors import CallError, DeviceError
from ..ir.nodes import Kind, scale_shape
from ..lower.map import MAP_ABI_VERSION, PARTIALS_TILE, TILE_N, MapGraph
from . import checks
from . import kernel as _kernel
from .arguments import CallSpec
from .kernel import ReductionOutputs, current_stream, ensure_gpu, new_buffer
from .library import LibraryBinding, load
from .map_op import call_map_op, register_map
from .torch_op import contiguous_strides

# The call's own keyword: k(X, out=..., **operands) (a misspelling of it is suggested too).
MAP_CALL_KEYWORDS = ("out",)


class MapLibrary(LibraryBinding):
    """A map kernel `.so`: ``coda_map_run`` (templates/map.cu.j2)."""

    def __init__(self, path: Path):
        super().__init__(path, "coda_map_abi_version", MAP_ABI_VERSION)
        self.lib.coda_map_run.restype = ctypes.c_int
        self.lib.coda_map_run.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_void_p, ctypes.c_void_p]
        self.run = self.lib.coda_map_run


def logical_shape(name: str, t: Any) -> tuple[int, int]:
    """(M, N) of a 2-D (M, N), 3-D (B, S, N) or 4-D (B, S, H, D) tensor."""
    if not isinstance(t, torch.Tensor):
        raise CallError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 2:
        return t.shape[0], t.shape[1]
    if t.dim() == 3:
        return t.shape[0] * t.shape[1], t.shape[2]
    if t.dim() == 4:
        return t.shape[0] * t.shape[1], t.shape[2] * t.shape[3]
    raise CallError(f"{name}: expected a 2-D (M, N), 3-D (B, S, N) or 4-D (B, S, H, D) tensor, got shape "
                    f"{tuple(t.shape)}")


def _dtype_device(name: str, t: Any, dtype: torch.dtype, device: torch.device, layout: bool,
                  fp32_ok: bool) -> None:
    if not isinstance(t, torch.Tensor):
        raise CallError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype and not (fp32_ok and t.dtype == torch.float32):
        also = " (or torch.float32 with precision='fp32')" if fp32_ok else ""
        raise CallError(f"{name}: dtype is {t.dtype}, the kernel was compiled for {dtype}{also}")
    if t.device != device:
        raise CallError(f"{name}: is on {t.device}, but X is on {device}; all tensors must be on the same "
                        + ("GPU" if layout else "device"))


def tile_view(name: str, t: torch.Tensor, M: int, N: int, dtype: torch.dtype, device: torch.device,
              half: bool = False, *, layout: bool = True, fp32_ok: bool = False) -> list[int]:
    """The 5-int strided view (outer_m, stride_m, inner_m, outer_n, inner_n) of a tile argument.
    ``layout=False`` (cc.map_reference): the checks without those of strides and alignment;
    ``fp32_ok``: a float32 tensor is accepted too (precision='fp32')."""
    _dtype_device(name, t, dtype, device, layout, fp32_ok)
    if logical_shape(name, t) != (M, N):
        raise CallError(f"{name}: shape {tuple(t.shape)} is a {logical_shape(name, t)} matrix, expected ({M}, {N})")
    if not layout:
        return []
    st = t.stride()
    if t.dim() == 2:
        view = [0, st[0], max(M, 1), 0, N]
    elif t.dim() == 3:
        view = [st[0], st[1], max(t.shape[1], 1), 0, N]
    else:
        view = [st[0], st[1], max(t.shape[1], 1), st[2], t.shape[3]]
    if M == 0 or N == 0:
        return view      # nothing is read or written (no launch): any strides will do, e.g. (1, 1) of (M, 0)
    if t.shape[-1] > 1 and st[-1] != 1:
        raise CallError(f"{name}: the innermost stride must be 1, got strides {st}")
    vec = 4 if half else 8      # a thread moves 8 columns (half-width outputs: 4)
    if view[4] % vec or any(s % vec for s in (view[0], view[1], view[3])):
        raise CallError(f"{name}: strides {st} and the innermost size {t.shape[-1]} must be multiples of {vec} "
                        f"elements (the kernel moves {vec}-element vectors)")
    if t.data_ptr() % (vec * t.element_size()):
        raise CallError(f"{name}: data pointer is not {vec * t.element_size()}-byte aligned (a view at an element "
                        "offset?)")
    return view


def transposed_view(name: str, t: Any, M: int, N: int, dtype: torch.dtype, device: torch.device, *,
                    layout: bool = True, fp32_ok: bool = False) -> list[int]:
    """The view of a transposed output: an (N, M) matrix with unit inner stride whose rows start on
    16-byte boundaries (each thread writes its row's 32-element runs as 16-byte stores).
    ``layout`` and ``fp32_ok`` as for ``tile_view``."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise CallError(f"{name}: a transposed output is a 2-D (N, M) = ({N}, {M}) tensor"
                        + ("" if not isinstance(t, torch.Tensor) else f", got shape {tuple(t.shape)}"))
    _dtype_device(name, t, dtype, device, layout, fp32_ok)
    if tuple(t.shape) != (N, M):
        raise CallError(f"{name}: shape {tuple(t.shape)}, expected the transpose of X: ({N}, {M})")
    if not layout:
        return []
    if M == 0 or N == 0:
        return [0, 1, max(N, 1), 0, max(M, 1)]
    ld = t.stride(0)
    vec = 16 // t.element_size()
    if (M > 1 and t.stride(1) != 1) or ld % vec or t.data_ptr() % 16:
        raise CallError(f"{name}: rows must be contiguous, 16-byte aligned, with a leading dimension that is a "
                        f"multiple of {vec} elements; got strides {t.stride()}")
    return [0, ld, N, 0, M]


class CompiledMap(ReductionOutputs):
    """A map kernel. Inspect ``source`` (the generated CUDA), ``ir``, ``path``."""

    def __init__(self, graph: MapGraph, source: str, build: BuildResult, partial_reductions: bool = False):
        self.graph = graph
        self.ir = graph.program
        self.name = graph.program.name
        self.source = source
        self.dtype = graph.dtype
        self.path: Path = build.path
        self.key = build.key
        self.origin = build.origin
        self.partial_reductions = partial_reductions
        self.outputs = self.ir.outputs
        self.spec = CallSpec.of(self.ir, positional=("X",))
        self.inout = tuple(s.name for s in graph.slots if s.role == "inout")
        self.operands = tuple(o for o in self.ir.operands if o.name not in self.inout)
        # Precomputed call plan (the eager path runs on every launch).
        self._arg_names = self.spec.names
        self._scalars = graph.scalars
        self._unused = tuple(o for o in self.operands if not o.host_scalar
                             and o.name not in {s.name for s in graph.slots})
        self._tile_outputs = tuple(s.name for s in graph.slots if s.role == "output")
        self._read = tuple(s.name for s in graph.slots if s.role == "input")    # what out= and inout must not alias
        # reduction output -> (its partials layout, the finished dtype); partials per (row, 256 columns),
        # so with partial_reductions a reduction is (ceil(N / 256), M) like cc.map_reference's, empty or not
        self._finish_plan = {s.name: (s.partials, s.dtype.torch) for s in graph.slots if s.role == "partials"}
        self._partials_tile = PARTIALS_TILE
        self._ptr_array = ctypes.c_void_p * len(graph.slots)
        self._view_array = ctypes.c_int64 * (5 * len(graph.slots))
        self._scalar_array = ctypes.c_float * max(len(self._scalars), 1)
        self._uses_index = self.spec.uses_index   # row/col indices are fp32 in the kernel: exact below 2^24
        self._slots = {s.name: s for s in graph.slots}
        self.scale_outputs = tuple(s.name for s in graph.slots if s.role == "output" and s.layout == "scale")
        # Registered now, not on first use: torch.compile cannot trace op registration.
        self._op = register_map(self)

    def __repr__(self) -> str:
        args = ", ".join(["X"] + [o.name for o in self.operands] + list(self.inout))
        return f"<CompiledMap {self.name}({args}) -> ({', '.join(self.outputs)}) {self.dtype.name} [{self.origin}]>"

    @property
    def resources(self) -> Resources | None:
        """ptxas's registers, stack frame and spills for this kernel (None: not recorded)."""
        return read_resources(self.path)

    @cached_property
    def library(self) -> MapLibrary:
        lib = load(self.path, MapLibrary)
        if lib.description != self.graph.describe():
            raise CallError(f"map kernel library {self.path} does not match the program it was loaded for")
        return lib

    def __call__(self, X: torch.Tensor, /, *, out: dict[str, torch.Tensor] | None = None,
                 **operands: Any) -> dict[str, torch.Tensor]:
        """Run the map kernel: ``k(X, name=tensor, ...)`` -> dict of outputs. ``out`` may give
        preallocated (M, N) tensors (or strided views) for tile outputs. Under torch.compile a call
        without ``out`` is the kernel's custom op (map_op.py); one with ``out`` runs eagerly."""
        if not out and torch.compiler.is_compiling():
            return call_map_op(self, X, operands)
        return self.run(X, operands, out)

    def run(self, X: torch.Tensor, operands: dict[str, Any],
            out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The eager call path (the custom op's implementation too)."""
        device = X.device if isinstance(X, torch.Tensor) else None
        if device is None or device.index not in _kernel._READY_DEVICES:
            ensure_gpu(device, self.name)
            if device is not None and device.type != "cuda":
                raise CallError(f"X: is on {device}; the kernel runs on a CUDA GPU")
        M, N, ptrs, views, scalars, results, partials = self._prepare(X, operands, out)
        if M == 0 or N == 0:
            results.update(self._empty_reductions(M, N, X.device))
            return {n: results[n] for n in self.outputs}
        lib = self.library
        args = (M, N, self._ptr_array(*ptrs), self._view_array(*views), self._scalar_array(*scalars),
                current_stream(X.device))
        if X.device.index == torch.cuda.current_device():
            status = lib.run(*args)
        else:
            with torch.cuda.device(X.device):     # the kernel launches on the current device
                status = lib.run(*args)
        if status != 0:
            raise DeviceError(f"{self.name}: {lib.status_string(status)} (M={M}, N={N})")
        for name, buf in partials:
            results[name] = buf if self.partial_reductions else self._finish(name, buf, M, N)
        return {n: results[n] for n in self.outputs}

    def _prepare(self, X: Any, operands: dict[str, Any], out: dict[str, torch.Tensor] | None
                 ) -> tuple[int, int, list[int], list[int], list[float], dict[str, torch.Tensor],
                            list[tuple[str, torch.Tensor]]]:
        """Every check of a call, and the launch's arguments: (M, N, pointers, views, scalars, the
        tile outputs, the partials buffers). Launches nothing and needs no GPU (tests call it with
        CPU tensors)."""
        M, N = logical_shape("X", X)
        if N % 8:
            raise CallError(f"N = {N} is not a multiple of 8 (the kernel moves 8 columns per thread)")
        if self._uses_index:
            self.spec.check_extent(M, N)
        self.check_call_names(operands)
        if out:
            checks.check_out_names(self.name, out, self._tile_outputs)
        device = X.device
        poison = _kernel.poison_enabled()      # CODA_CUTLASS_POISON, read at call time
        scalars = [checks.check_scalar(n, operands[n]) for n in self._scalars]
        for o in self._unused:       # operands the program does not use: still checked
            check_vector_or_tile(o.name, o.kind, operands[o.name], o.dtype, M, N, device)
        ptrs: list[int] = []
        views: list[int] = []
        results: dict[str, torch.Tensor] = {}
        partials: list[tuple[str, torch.Tensor]] = []
        written: dict[str, torch.Tensor] | None = None
        for s in self.graph.slots:
            view = _NO_VIEW
            if s.role == "acc":
                t = X
                view = tile_view("X", X, M, N, s.dtype.torch, device)
            elif s.role == "partials":
                t = new_buffer(s.partials.partial_shape(M, N, PARTIALS_TILE), torch.float32, device, poison)
                partials.append((s.name, t))
            elif s.role == "output" and s.layout == "scale":
                if out and s.name in out:
                    raise CallError(f"{self.name}: out['{s.name}']: block scales are allocated by the kernel call")
                rows, runs, ld = self._scale_dims(s.name, M, N)
                t = new_buffer((runs, ld), torch.float32, device, poison)
                view = (0, ld, max(rows, 1), 0, 1)
                results[s.name] = t[:, :rows].t()
            elif s.role == "output":
                cols = N // 2 if s.layout == "half" else N
                t = out.get(s.name) if out else None
                if t is None and s.layout == "t":      # rows padded to 16 bytes (transposed_view)
                    t = new_buffer((N, _t_ld(M)), s.dtype.torch, device, poison)[:, :M]
                elif t is None:
                    t = new_buffer((M, cols), s.dtype.torch, device, poison)
                else:
                    written = written or {}
                    written[s.name] = t
                where = f"out['{s.name}']"
                view = (transposed_view(where, t, M, N, s.dtype.torch, device) if s.layout == "t" else
                        tile_view(where, t, M, cols, s.dtype.torch, device, half=s.layout == "half"))
                results[s.name] = t
            else:
                t = operands[s.name]
                if s.kind == Kind.TILE:
                    view = tile_view(s.name, t, M, N, s.dtype.torch, device)
                else:
                    check_vector_or_tile(s.name, s.kind, t, s.dtype, M, N, device)
                if s.role == "inout":
                    results[s.name] = t
                    written = written or {}
                    written[s.name] = t
            ptrs.append(t.data_ptr())
            views.extend(view)
        if written:
            # an output may be X itself (the same view): each thread reads its 8 elements of a row
            # before it writes them, and no other thread reads them (the LM head's dlogits over its logits)
            over_x = [n for n, t in written.items() if self._is_x(n, t, X)]
            read = {over_x[0] if over_x else "X": X}
            read.update((n, operands[n]) for n in self._read)
            checks.check_no_overlap(written, read)
        return M, N, ptrs, views, scalars, results, partials

    # ------------------------------------------------------------------ the custom op's view of a call
    def logical_mn(self, X: torch.Tensor) -> tuple[int, int]:
        return logical_shape("X", X)

    def check_call_names(self, operands: dict[str, Any]) -> None:
        if len(operands) != len(self._arg_names) or not all(n in operands for n in self._arg_names):
            self.spec.check_names(operands, keywords=MAP_CALL_KEYWORDS)

    def _scale_dims(self, name: str, M: int, N: int) -> tuple[int, int, int]:
        """A block-scale output's (rows, runs, ld): run-major, 16-byte aligned runs (TensorSlot.storage)."""
        s = self._slots[name]
        rows, runs = scale_shape(s.scale_of, M, N, 128, s.group)   # "t": a run per 128 rows of X's columns
        return rows, runs, -(-rows // 4) * 4

    def output_layout(self, name: str, M: int, N: int) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype]:
        """(shape, strides, dtype) of an output (not an accumulated one) as the custom op returns it,
        as the eager call makes it: tile outputs (M, N) (half-width (M, N / 2)), transposed ones an
        (N, M) view of rows padded to 16 bytes, block scales their run-major buffer (``scale_view``
        gives the (rows, runs) view), reductions finished or as per-tile partials."""
        if name in self._finish_plan:
            shape, dtype = self.reduction_result(name, M, N)
            return tuple(shape), contiguous_strides(tuple(shape)), dtype
        s = self._slots[name]
        if s.layout == "scale":
            _, runs, ld = self._scale_dims(name, M, N)
            return (runs, ld), (ld, 1), torch.float32
        if s.layout == "t":
            return (N, M), (_t_ld(M), 1), s.dtype.torch
        cols = N // 2 if s.layout == "half" else N
        return (M, cols), (cols, 1), s.dtype.torch

    def scale_view(self, name: str, buffer: torch.Tensor, M: int, N: int) -> torch.Tensor:
        """A block-scale output's (rows, runs) view of its run-major buffer (as the eager call returns it)."""
        rows, _, _ = self._scale_dims(name, M, N)
        return buffer[:, :rows].t()

    def _is_x(self, name: str, t: torch.Tensor, X: torch.Tensor) -> bool:
        return is_x_view(self.graph, name, t, X)

    def _finish(self, name: str, buf: torch.Tensor, M: int, N: int) -> torch.Tensor:
        partials, dtype = self._finish_plan[name]
        return partials.finish(buf, M, N, TILE_N).to(dtype)


def is_x_view(graph: MapGraph, name: str, t: torch.Tensor, X: torch.Tensor) -> bool:
    """Whether tile output ``name`` is given as X's own view (same memory, shape, strides, dtype)."""
    slot = next((s for s in graph.slots if s.name == name and s.role == "output"), None)
    return (slot is not None and slot.layout == "tile" and t.dtype == X.dtype
            and t.data_ptr() == X.data_ptr() and t.shape == X.shape and t.stride() == X.stride())


def check_vector_or_tile(name: str, kind: Kind, t: Any, dtype: Any, M: int, N: int, device: torch.device, *,
                         layout: bool = True, fp32_ok: bool = False) -> None:
    """An operand that is not read through a tile view: a vector, a device scalar, or an unused tile."""
    if kind == Kind.SCALAR:
        checks.check_device_scalar(name, t, device)
    elif kind == Kind.TILE:
        tile_view(name, t, M, N, dtype.torch, device, layout=layout, fp32_ok=fp32_ok)
    else:
        checks.check_vector(name, t, M if kind == Kind.ROW else N,
                            "row (length M)" if kind == Kind.ROW else "column (length N)", dtype, device,
                            tma=layout, fp32_ok=fp32_ok)


_NO_VIEW = (0, 0, 1, 0, 1)      # the view of a slot that is not a tile (vectors, partials)


def _t_ld(M: int) -> int:
    """The row length of a transposed output's buffer: M padded to 16 elements (16-byte rows)."""
    return -(-M // 16) * 16


__all__ = ["CompiledMap", "MapLibrary", "check_vector_or_tile", "is_x_view", "logical_shape", "tile_view",
           "transposed_view"]
