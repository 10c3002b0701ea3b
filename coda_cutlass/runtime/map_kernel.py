"""``CompiledMap``: a built map kernel (an epilogue program over an existing tensor, no GEMM).

``k(X, **operands)`` checks every argument, allocates the outputs, launches once on the current
stream, finishes the row reductions (one small deterministic call each) and returns a dict of
outputs, like a GEMM epilogue kernel. ``X`` and the tile operands may be 2-D (M, N), 3-D (B, S, N)
or 4-D (B, S, H, D) strided tensors (unit innermost stride): a 4-D one is read as the
(B * S) x (H * D) matrix, so e.g. attention gradients laid out (B, H, S, D) and transposed to
(B, S, H, D) need no copy. Outputs are returned as (M, N) matrices (or written into ``out=``).
"""

from __future__ import annotations

import ctypes
import json
import threading
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ..build.builder import BuildResult
from ..errors import BuildError, CallError, DeviceError
from ..ir.nodes import Kind
from ..lower.map import MAP_ABI_VERSION, PARTIALS_TILE, TILE_N, MapGraph, MapSlot
from . import checks
from . import kernel as _kernel
from .kernel import current_stream, ensure_gpu
from .library import open_verified

_LOCK = threading.Lock()
_LOADED: dict[str, ctypes.CDLL] = {}


def _load(path: Path) -> ctypes.CDLL:
    key = str(Path(path).resolve())
    with _LOCK:
        lib = _LOADED.get(key)
        if lib is None:
            lib = open_verified(Path(key))      # checked right before dlopen, like GEMM kernels
            lib.coda_map_abi_version.restype = ctypes.c_int
            lib.coda_describe.restype = ctypes.c_char_p
            lib.coda_status_string.restype = ctypes.c_char_p
            lib.coda_status_string.argtypes = [ctypes.c_int]
            lib.coda_map_run.restype = ctypes.c_int
            lib.coda_map_run.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_void_p, ctypes.c_void_p]
            if lib.coda_map_abi_version() != MAP_ABI_VERSION:
                raise BuildError(f"map kernel library {key} has another ABI version; rebuild it")
            _LOADED[key] = lib
        return lib


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


def tile_view(name: str, t: torch.Tensor, M: int, N: int, dtype: torch.dtype, device: torch.device,
              half: bool = False) -> list[int]:
    """The 5-int strided view (outer_m, stride_m, inner_m, outer_n, inner_n) of a tile argument."""
    if t.dtype != dtype:
        raise CallError(f"{name}: dtype is {t.dtype}, the kernel was compiled for {dtype}")
    if t.device != device:
        raise CallError(f"{name}: is on {t.device}, but X is on {device}; all tensors must be on the same GPU")
    if logical_shape(name, t) != (M, N):
        raise CallError(f"{name}: shape {tuple(t.shape)} is a {logical_shape(name, t)} matrix, expected ({M}, {N})")
    st = t.stride()
    if t.shape[-1] > 1 and st[-1] != 1:
        raise CallError(f"{name}: the innermost stride must be 1, got strides {st}")
    if t.dim() == 2:
        view = [0, st[0], max(M, 1), 0, N]
    elif t.dim() == 3:
        view = [st[0], st[1], max(t.shape[1], 1), 0, N]
    else:
        view = [st[0], st[1], max(t.shape[1], 1), st[2], t.shape[3]]
    vec = 4 if half else 8      # a thread moves 8 columns (half-width outputs: 4)
    if view[4] % vec or any(s % vec for s in (view[0], view[1], view[3])):
        raise CallError(f"{name}: strides {st} and the innermost size {t.shape[-1]} must be multiples of {vec} "
                        f"elements (the kernel moves {vec}-element vectors)")
    if t.data_ptr() % (vec * t.element_size()):
        raise CallError(f"{name}: data pointer is not {vec * t.element_size()}-byte aligned (a view at an element "
                        "offset?)")
    return view


class CompiledMap:
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
        self.inout = tuple(s.name for s in graph.slots if s.role == "inout")
        self.operands = tuple(o for o in self.ir.operands if o.name not in self.inout)
        self._arg_names = {o.name for o in self.operands} | set(self.inout)
        self._scalars = graph.scalars
        self._unused = tuple(o for o in self.operands if o.kind != Kind.SCALAR
                             and o.name not in {s.name for s in graph.slots})

    def __repr__(self) -> str:
        args = ", ".join(["X"] + [o.name for o in self.operands] + list(self.inout))
        return f"<CompiledMap {self.name}({args}) -> ({', '.join(self.outputs)}) {self.dtype.name} [{self.origin}]>"

    @cached_property
    def library(self) -> ctypes.CDLL:
        lib = _load(self.path)
        if json.loads(lib.coda_describe().decode()) != self.graph.describe():
            raise CallError(f"map kernel library {self.path} does not match the program it was loaded for")
        return lib

    def __call__(self, X: torch.Tensor, /, *, out: dict[str, torch.Tensor] | None = None,
                 **operands: Any) -> dict[str, torch.Tensor]:
        device = X.device if isinstance(X, torch.Tensor) else None
        ensure_gpu(device, self.name)
        missing = sorted(self._arg_names - set(operands))
        extra = sorted(set(operands) - self._arg_names)
        if missing or extra:
            raise CallError(f"{self.name}: " + "; ".join(
                p for p in (f"missing {', '.join(missing)}" if missing else "",
                            f"unexpected {', '.join(extra)}" if extra else "") if p)
                + f". The call is k(X, {', '.join(n + '=...' for n in sorted(self._arg_names))})")
        M, N = logical_shape("X", X)
        if N % 8:
            raise CallError(f"N = {N} is not a multiple of 8 (the kernel moves 8 columns per thread)")
        scalars = [checks.check_scalar(n, operands[n]) for n in self._scalars]
        for o in self._unused:
            self._check_vector_or_tile(o.name, o.kind, operands[o.name], o.dtype, M, N, device)
        ptrs: list[int] = []
        views: list[int] = []
        results: dict[str, torch.Tensor] = {}
        partials: list[tuple[MapSlot, torch.Tensor]] = []
        for s in self.graph.slots:
            view = [0, 0, 1, 0, 1]
            if s.role == "acc":
                t = X
                view = tile_view("X", X, M, N, s.dtype.torch, device)
            elif s.role == "partials":
                t = self._new(s.partials.partial_shape(M, N, PARTIALS_TILE), torch.float32, device)
                partials.append((s, t))
            elif s.role == "output":
                cols = N // 2 if s.layout == "half" else N
                t = (out or {}).get(s.name)
                if t is None:
                    t = self._new((M, cols), s.dtype.torch, device)
                view = tile_view(f"out['{s.name}']", t, M, cols, s.dtype.torch, device, half=s.layout == "half")
                results[s.name] = t
            else:
                t = operands[s.name]
                if s.kind == Kind.TILE:
                    view = tile_view(s.name, t, M, N, s.dtype.torch, device)
                    if s.role == "inout":
                        results[s.name] = t
                else:
                    self._check_vector_or_tile(s.name, s.kind, t, s.dtype, M, N, device)
            ptrs.append(t.data_ptr())
            views.extend(view)
        if M == 0 or N == 0:
            for s, _ in partials:
                shape = (0, M) if self.partial_reductions else s.partials.result_shape(M, N)
                dtype = torch.float32 if self.partial_reductions else s.dtype.torch
                results[s.name] = torch.full(shape, s.partials.identity, dtype=dtype, device=device)
            return {n: results[n] for n in self.outputs}
        lib = self.library
        status = lib.coda_map_run(M, N, (ctypes.c_void_p * len(ptrs))(*ptrs), (ctypes.c_int64 * len(views))(*views),
                                  (ctypes.c_float * max(len(scalars), 1))(*scalars), current_stream(device))
        if status != 0:
            raise DeviceError(f"{self.name}: {lib.coda_status_string(status).decode()} (M={M}, N={N})")
        for s, buf in partials:
            results[s.name] = buf if self.partial_reductions else \
                s.partials.finish(buf, M, N, TILE_N).to(s.dtype.torch)
        return {n: results[n] for n in self.outputs}

    @staticmethod
    def _new(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if _kernel.POISON:      # CODA_CUTLASS_POISON (read at call time: tests switch it)
            return torch.full(shape, float("nan"), dtype=dtype, device=device)
        return torch.empty(shape, dtype=dtype, device=device)

    @staticmethod
    def _check_vector_or_tile(name: str, kind: Kind, t: Any, dtype: Any, M: int, N: int, device: torch.device) -> None:
        if kind == Kind.TILE:
            tile_view(name, t, M, N, dtype.torch, device)
        else:
            checks.check_vector(name, t, M if kind == Kind.ROW else N,
                                "row (length M)" if kind == Kind.ROW else "column (length N)", dtype, device)


__all__ = ["CompiledMap", "logical_shape", "tile_view"]
