"""ctypes binding of a kernel `.so` (the extern "C" ABI in templates/coda/host_abi.hpp), and the
verified, once-per-process loading that GEMM and map kernels (``map_kernel.MapLibrary``) share."""

from __future__ import annotations

import ctypes
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable

from ..build.verify import Rejected, metadata_path, verify
from ..errors import BuildError
from ..lower.evt import ABI_VERSION

_LOCK = threading.Lock()
_LOADED: dict[tuple[Any, str], Any] = {}    # (binding, resolved path) -> the loaded binding
_REPLACED: set[str] = set()      # paths whose file changed during dlopen: what got mapped is unknown


class LibraryBinding:
    """What every kernel `.so` exports (GEMM and map kernels alike), opened through
    ``open_verified``: its ABI version (checked), ``coda_describe`` and ``coda_status_string``."""

    def __init__(self, path: Path, abi_symbol: str, abi_version: int):
        self.path = path
        lib = self.lib = open_verified(path)
        abi_fn = getattr(lib, abi_symbol, None)
        if abi_fn is None:      # e.g. a map kernel's library where a GEMM kernel's is expected
            raise BuildError(f"kernel library {path} exports no {abi_symbol}(): another kind of kernel; "
                             "rebuild it")
        abi_fn.restype = ctypes.c_int
        lib.coda_describe.restype = ctypes.c_char_p
        lib.coda_status_string.restype = ctypes.c_char_p
        lib.coda_status_string.argtypes = [ctypes.c_int]
        abi = abi_fn()
        if abi != abi_version:
            raise BuildError(f"kernel library {path} has ABI version {abi}, this coda-cutlass expects "
                             f"{abi_version}; rebuild it")
        self.description: dict[str, Any] = json.loads(lib.coda_describe().decode())

    def status_string(self, status: int) -> str:
        return self.lib.coda_status_string(status).decode()


class KernelLibrary(LibraryBinding):
    """A GEMM kernel `.so`: ``coda_run`` and ``coda_workspace_size``."""

    def __init__(self, path: Path):
        super().__init__(path, "coda_abi_version", ABI_VERSION)
        lib = self.lib
        lib.coda_workspace_size.restype = ctypes.c_int
        lib.coda_workspace_size.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                            ctypes.POINTER(ctypes.c_size_t)]
        lib.coda_run.restype = ctypes.c_int
        lib.coda_run.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
        ]
        self.run = lib.coda_run
        self._workspace: dict[tuple[int, int, int], int] = {}

    def workspace_size(self, M: int, N: int, K: int) -> int:
        key = (M, N, K)
        size = self._workspace.get(key)
        if size is None:
            out = ctypes.c_size_t(0)
            status = self.lib.coda_workspace_size(M, N, K, ctypes.byref(out))
            if status != 0:
                raise RuntimeError(f"coda_workspace_size failed: {self.status_string(status)}")
            size = self._workspace[key] = int(out.value)
        return size


def open_verified(path: Path) -> ctypes.CDLL:
    """dlopen a kernel library, verifying the file right before: its path is controlled by you
    alone and its bytes match the SHA-256 in the metadata beside it (build/verify.py); and the file
    must still be the one verified once dlopen returns."""
    key = str(Path(path).resolve())
    if key in _REPLACED:
        raise BuildError(f"kernel library {path} was replaced while this process loaded it; restart the "
                         "process to load the new file")
    try:
        identity = verify(Path(path), metadata_path(Path(path)))
    except Rejected as e:
        raise BuildError(f"refusing to load kernel library {path}: {e}; rebuild it "
                         "(compile_epilogue(..., force_rebuild=True))") from None
    try:
        lib = ctypes.CDLL(key)
    except OSError as e:
        raise BuildError(f"cannot load kernel library {path}: {e}") from None
    now = os.stat(key)
    if (now.st_dev, now.st_ino) != identity:
        _REPLACED.add(key)
        raise BuildError(f"kernel library {path} was replaced while it was being loaded")
    return lib


def load(path: Path | str, binding: Callable[[Path], Any] = KernelLibrary) -> Any:
    """Load once per process per path and ABI. ``binding(path)`` opens the library (through
    ``open_verified``) and binds its ABI: ``KernelLibrary`` (GEMM kernels) or ``MapLibrary``."""
    key = str(Path(path).resolve())
    with _LOCK:
        lib = _LOADED.get((binding, key))
        if lib is None:
            lib = _LOADED[(binding, key)] = binding(Path(path))   # metadata lies beside the given path
        return lib
