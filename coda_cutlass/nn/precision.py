"""Parameter dtype and compute dtype of the nn modules (mixed precision).

The kernels compute in bf16 or fp16. The parameters may be kept in fp32 (master weights) while a
call computes in a lower precision, decided per call:

1. ``module.compute_dtype`` when set (the split FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``
   makes: parameters in one dtype, each call in another);
2. else, when the parameters are fp32 and ``torch.autocast`` is on for their device, the autocast
   dtype (the usual mixed-precision recipe);
3. else the parameters' dtype (under FSDP2 with ``param_dtype=torch.bfloat16`` the module already
   sees bf16 unsharded parameters: no cast).

A call casts each weight to the compute dtype once (a differentiable cast, so the weight gradients
come back in the parameters' dtype), runs the kernels with autocast switched off (autocast would
otherwise round the fp32 finishing steps, the row statistics' addmv, to bf16), and returns outputs
in the compute dtype. On a Hopper GPU a compute dtype the kernels do not take (fp32) runs the
reference interpreter with a warning that says so; other GPUs warn too.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch

from .runner import KernelRunner, ReferenceRunner, Runner

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_WARNED: set[tuple[str, str]] = set()


def compute_dtype(param_dtype: torch.dtype, device: torch.device, explicit: torch.dtype | None = None) -> torch.dtype:
    """The dtype one call computes in (rules 1-3 of the module docstring)."""
    if explicit is not None:
        return explicit
    if param_dtype not in (*KERNEL_DTYPES, torch.float32):
        raise ValueError(f"parameters in {param_dtype} are not supported: use torch.float32 (masters, with "
                         "compute_dtype= or autocast for 16-bit compute), torch.bfloat16 or torch.float16")
    if param_dtype == torch.float32 and torch.is_autocast_enabled(device.type):
        dtype = torch.get_autocast_dtype(device.type)
        if dtype in KERNEL_DTYPES:
            return dtype
    return param_dtype


def check_compute_dtype(dtype: torch.dtype | None) -> torch.dtype | None:
    if dtype is not None and dtype not in (*KERNEL_DTYPES, torch.float32):
        raise ValueError(f"compute_dtype must be torch.bfloat16, torch.float16, torch.float32 or None, got {dtype}")
    return dtype


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (differentiable: the gradient comes back in t's dtype); no copy if equal."""
    return t if t.dtype == dtype else t.to(dtype)


@contextlib.contextmanager
def no_autocast(device: torch.device) -> Iterator[None]:
    """The kernels and their fp32 finishing steps run as written, whatever autocast says."""
    if torch.is_autocast_enabled(device.type):
        with torch.autocast(device.type, enabled=False):
            yield
    else:
        yield


def hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def runner_for(device: torch.device, dtype: torch.dtype) -> Runner:
    """Kernels on a Hopper GPU in bf16 / fp16; the reference interpreter elsewhere, with a warning
    on a GPU (it is slow there, and it should not happen unnoticed)."""
    if hopper(device) and dtype in KERNEL_DTYPES:
        return KernelRunner(dtype)
    if device.type == "cuda":
        why = (f"{dtype} compute (the kernels take bf16 / fp16: keep fp32 parameters and run under "
               f"torch.autocast('cuda', dtype=torch.bfloat16), or set compute_dtype=torch.bfloat16)"
               if hopper(device) else
               f"{torch.cuda.get_device_name(device)} is not a Hopper GPU (sm_90), the kernels' target")
        key = (str(device), str(dtype))
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(f"coda_cutlass.nn on {device}: the reference interpreter runs instead of the kernels "
                          f"(slow): {why}", stacklevel=3)
    return ReferenceRunner(dtype if dtype in KERNEL_DTYPES else torch.bfloat16)
