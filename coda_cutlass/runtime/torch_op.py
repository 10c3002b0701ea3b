"""Registering a compiled kernel as a ``torch.library`` custom op with a fake (meta) implementation,
so ``torch.compile`` traces through it without a graph break.

Schema: ``coda_cutlass::<program>_<digest>(Tensor A, Tensor W, <operands>, <FP8 scales: Tensor
scale_a, Tensor scale_b>, <accumulated outputs as Tensor(a!)>, *, str? raster=None, int? swizzle=None)
-> (<other outputs>)``. Accumulated outputs
are mutated in place, not returned; raster and swizzle are the call's overrides (None: the kernel's
defaults). The digest covers everything the op's implementation depends on (the source key, the
.so path, the runtime defaults, partial reductions, the call's names), so two kernels share an op
only if they are the same kernel. Operand names that are not ASCII identifiers (``γ``) are renamed
in the schema (torch's schema parser reads ASCII only); the op is called positionally.
The kernel (``runtime.kernel.Kernel``) registers itself; this module sees it as an ``OpKernel``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from pathlib import Path
from typing import Any, Protocol

import torch

from ..config import KernelConfig
from ..ir.nodes import Kind, Operand


class OpKernel(Protocol):
    """What registration needs of a kernel."""
    name: str
    source_key: str
    path: Path
    config: KernelConfig
    partial_reductions: bool
    weight_layout: str
    operands: tuple[Operand, ...]
    gemm_scales: tuple[str, ...]           # an FP8 kernel's scales ("scale_a", "scale_b"), else ()
    inout: tuple[str, ...]
    outputs: tuple[str, ...]
    _op: Any

    def run(self, A: torch.Tensor, W: torch.Tensor, operands: dict[str, Any], *, raster: str | None = None,
            swizzle: int | None = None) -> dict[str, torch.Tensor]: ...
    def output_spec(self, name: str, M: int, N: int) -> tuple[tuple[int, ...], torch.dtype]: ...
    def output_stride(self, name: str, M: int, N: int) -> tuple[int, ...]: ...
    def _check_names(self, operands: dict[str, Any]) -> None: ...

_LOCK = threading.Lock()
_OPS: dict[str, Any] = {}
_LIB: torch.library.Library | None = None


def _library() -> torch.library.Library:
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library("coda_cutlass", "FRAGMENT")
    return _LIB


def identity(k: OpKernel) -> str:
    """A digest of what the op's implementation runs: the kernel (source key and .so), its runtime
    defaults, how reductions are returned, and the names it is called with."""
    fields = {
        "program": k.name, "source_key": k.source_key, "path": str(Path(k.path).resolve()),
        "raster": k.config.raster, "swizzle": k.config.swizzle, "partial_reductions": k.partial_reductions,
        "weight_layout": k.weight_layout, "operands": [(o.name, o.kind.value) for o in k.operands],
        "inout": list(k.inout), "outputs": list(k.outputs),
    }
    if k.gemm_scales:
        fields["scales"] = list(k.gemm_scales)
    return digest_of(fields)


def op_name(k: OpKernel) -> str:
    """``<program>_<digest>``: the program name reduced to ASCII identifier characters (so distinct
    names may read alike; the digest, which covers the real name, tells them apart)."""
    return labelled(k.name, identity(k), "epilogue")


def labelled(name: str, digest: str, fallback: str, prefix: str = "") -> str:
    """``<prefix><name as ASCII identifier characters>_<digest[:24]>`` (``fallback`` when nothing of
    the name is left; ``p`` before a leading digit)."""
    base = prefix + (re.sub(r"[^0-9a-zA-Z_]", "_", name)[:40].strip("_") or fallback)
    if base[0].isdigit():
        base = "p" + base
    return f"{base}_{digest[:24]}"


def digest_of(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def schema_names(k: OpKernel) -> list[str]:
    """The schema's argument names for the operands and accumulated outputs, in call order: their
    own names when they are ASCII identifiers, else ``arg<i>`` (unique among all of them)."""
    return ascii_names([o.name for o in k.operands] + list(k.gemm_scales) + list(k.inout),
                       {"A", "W", "raster", "swizzle"})


def ascii_names(names: list[str], reserved: set[str]) -> list[str]:
    """Schema argument names: each name itself when it is an ASCII identifier, else ``arg<i>``
    (unique among all of them and the ``reserved`` ones)."""
    taken = reserved | {n for n in names if _schema_ident(n)}
    out = []
    for i, n in enumerate(names):
        if not _schema_ident(n):
            n = f"arg{i}"
            while n in taken:
                n = "_" + n
            taken.add(n)
        out.append(n)
    return out


def _schema_ident(name: str) -> bool:
    return name.isascii() and name.isidentifier()


def schema(k: OpKernel) -> str:
    args = ["Tensor A", "Tensor W"]
    names = schema_names(k)
    for o, name in zip(k.operands, names):
        args.append(f"float {name}" if o.host_scalar else f"Tensor {name}")
    n_in = len(k.operands) + len(k.gemm_scales)
    args += [f"Tensor {name}" for name in names[len(k.operands):n_in]]
    for i, name in enumerate(names[n_in:]):
        args.append(f"Tensor(a{i}!) {name}")
    args += ["*", "str? raster=None", "int? swizzle=None"]
    return f"({', '.join(args)}) -> {returns_schema(len(returned_outputs(k)))}"


def returns_schema(n: int) -> str:
    """The schema's return part for ``n`` returned tensors."""
    return "()" if not n else ("Tensor" if n == 1 else "(" + ", ".join("Tensor" for _ in range(n)) + ")")


def packed(vals: tuple[torch.Tensor, ...]) -> Any:
    """An op's returned tensors as its schema returns them (none, one, a tuple)."""
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else vals


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(max(d, 1) for d in shape[i + 1:]) for i in range(len(shape)))


def returned_outputs(k: Any) -> list[str]:
    """The outputs an op returns: all but the accumulated ones, which it mutates in place."""
    return [n for n in k.outputs if n not in k.inout]


def define(name: str, schema_text: str, make: Any) -> Any:
    """The op ``coda_cutlass::<name>`` (defined once per process): ``make()`` -> (impl, fake)."""
    with _LOCK:
        if name in _OPS:
            return _OPS[name]
        impl, fake = make()
        lib = _library()
        lib.define(name + schema_text)
        lib.impl(name, impl, "CUDA")
        torch.library.register_fake(f"coda_cutlass::{name}", fake, lib=lib)
        op = getattr(torch.ops.coda_cutlass, name)
        _OPS[name] = op
        return op


def register(k: OpKernel) -> Any:
    return define(op_name(k), schema(k), lambda: _implementations(k))


def _implementations(k: OpKernel) -> tuple[Any, Any]:
    """The op's implementation (the kernel's eager call) and its fake (shapes and strides only)."""
    arg_names = [o.name for o in k.operands] + list(k.gemm_scales) + list(k.inout)
    returned = returned_outputs(k)
    transposed = transposed_returns(k)

    def impl(A: torch.Tensor, W: torch.Tensor, *args: Any, raster: str | None = None,
             swizzle: int | None = None) -> Any:
        out = k.run(A, W, dict(zip(arg_names, args)), raster=raster, swizzle=swizzle)
        # block scales are a view of a run-major buffer: the op returns the buffer (call_op views it)
        return packed(tuple(as_returned(k, n, _scale_buffer(k, n, out[n], A, W) if n in transposed else out[n],
                                        A, W, n in transposed) for n in returned))

    def fake(A: torch.Tensor, W: torch.Tensor, *args: Any, raster: str | None = None,
             swizzle: int | None = None) -> Any:
        return packed(tuple(_fake_output(k, n, A, W, n in transposed) for n in returned))

    return impl, fake


def transposed_returns(k: OpKernel) -> frozenset[str]:
    """Outputs the op returns as their run-major storage (block scales), transposed back by call_op."""
    return frozenset(getattr(k, "scale_outputs", ()))


def _mn(k: OpKernel, A: torch.Tensor, W: torch.Tensor) -> tuple[int, int]:
    return A.shape[0], (W.shape[0] if k.weight_layout == "nk" else W.shape[1])


def _storage(k: OpKernel, name: str, A: torch.Tensor, W: torch.Tensor) -> tuple[int, int]:
    """The run-major buffer behind block scales (TensorSlot.storage)."""
    return k._slots_by_name[name].storage(*_mn(k, A, W))


def _scale_buffer(k: OpKernel, name: str, v: torch.Tensor, A: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """The whole run-major buffer behind the block-scale view ``v``."""
    storage = _storage(k, name, A, W)
    return v.t().as_strided(storage, (storage[1], 1))


def _layout(k: OpKernel, name: str, A: torch.Tensor, W: torch.Tensor,
            transposed: bool) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype]:
    """(shape, strides, dtype) of what the op returns for an output, as the eager call returns it
    (partials are views of a padded buffer: their row stride is the padded length); block scales
    are their contiguous run-major buffer."""
    M, N = _mn(k, A, W)
    shape, dtype = k.output_spec(name, M, N)
    if transposed:
        shape = tuple(_storage(k, name, A, W))
        return shape, contiguous_strides(shape), dtype
    return tuple(shape), tuple(k.output_stride(name, M, N)), dtype


def _fake_output(k: OpKernel, name: str, A: torch.Tensor, W: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    shape, stride, dtype = _layout(k, name, A, W, transposed)
    return A.new_empty_strided(shape, stride, dtype=dtype)


def as_returned(k: OpKernel, name: str, v: torch.Tensor, A: torch.Tensor, W: torch.Tensor,
                transposed: bool = False) -> torch.Tensor:
    """A kernel output as the op returns it: with the fake implementation's strides (Inductor checks
    them), and not a view (a custom op may not return a view of an internal buffer; partials are
    views). A view keeps its storage and strides as a tensor of its own: no copy."""
    shape, stride, _ = _layout(k, name, A, W, transposed)
    return owned(v, stride)


def owned(v: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``v`` with the fake implementation's ``stride`` and not a view (a custom op may not return a
    view of an internal buffer): a view keeps its storage and strides as a tensor of its own."""
    if tuple(v.stride()) != stride:      # not expected but for empty outputs: kept correct anyway
        return v.new_empty_strided(tuple(v.shape), stride).copy_(v)
    if v._base is not None:
        return v.new_empty(0).set_(v.untyped_storage(), v.storage_offset(), v.shape, v.stride())
    return v


def call_op(k: OpKernel, A: torch.Tensor, W: torch.Tensor, operands: dict[str, Any], *,
            raster: str | None = None, swizzle: int | None = None) -> dict:
    """The torch.compile path of ``k(A, W, ...)`` (traced by Dynamo: no locks, no registration)."""
    op = k._op
    k._check_names(operands)
    args = ([operands[o.name] for o in k.operands] + [operands[n] for n in k.gemm_scales]
            + [operands[n] for n in k.inout])
    out = op(A, W, *args, raster=raster, swizzle=swizzle)
    returned = returned_outputs(k)
    if len(returned) == 1:
        out = (out,)
    result = dict(zip(returned, out or ()))
    for n in transposed_returns(k):
        result[n] = k._slots_by_name[n].view(result[n], *_mn(k, A, W))
    for n in k.inout:
        result[n] = operands[n]
    return {n: result[n] for n in k.outputs}
