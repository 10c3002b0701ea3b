"""Registering a compiled kernel as a ``torch.library`` custom op with a fake (meta) implementation,
so ``torch.compile`` traces through it without a graph break.

Schema: ``coda_cutlass::<program>_<key>(Tensor A, Tensor W, <operands>, <accumulated outputs as
Tensor(a!)>) -> (<other outputs>)``. Accumulated outputs are mutated in place, not returned.
The kernel (``runtime.kernel.Kernel``) registers itself; this module sees it as an ``OpKernel``.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Protocol

import torch

from ..ir.nodes import Kind, Operand


class OpKernel(Protocol):
    """What registration needs of a kernel."""
    name: str
    source_key: str
    partial_reductions: bool
    weight_layout: str
    operands: tuple[Operand, ...]
    inout: tuple[str, ...]
    outputs: tuple[str, ...]
    _op: Any

    def run(self, A: torch.Tensor, W: torch.Tensor, operands: dict[str, Any]) -> dict[str, torch.Tensor]: ...
    def output_spec(self, name: str, M: int, N: int) -> tuple[tuple[int, ...], torch.dtype]: ...
    def _check_names(self, operands: dict[str, Any]) -> None: ...

_LOCK = threading.Lock()
_OPS: dict[str, Any] = {}
_LIB: torch.library.Library | None = None


def _library() -> torch.library.Library:
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library("coda_cutlass", "FRAGMENT")
    return _LIB


def op_name(k: OpKernel) -> str:
    base = re.sub(r"[^0-9a-zA-Z_]", "_", k.name)[:40] or "epilogue"
    tag = "p" if k.partial_reductions else "f"
    return f"{base}_{k.source_key[:16]}{tag}"


def schema(k: OpKernel) -> str:
    args = ["Tensor A", "Tensor W"]
    for o in k.operands:
        args.append(f"float {o.name}" if o.kind == Kind.SCALAR else f"Tensor {o.name}")
    for i, name in enumerate(k.inout):
        args.append(f"Tensor(a{i}!) {name}")
    rets = [n for n in k.outputs if n not in k.inout]
    ret = "()" if not rets else ("Tensor" if len(rets) == 1 else "(" + ", ".join("Tensor" for _ in rets) + ")")
    return f"({', '.join(args)}) -> {ret}"


def _returned(k: OpKernel) -> list[str]:
    return [n for n in k.outputs if n not in k.inout]


def register(k: OpKernel) -> Any:
    name = op_name(k)
    with _LOCK:
        if name in _OPS:
            return _OPS[name]
        lib = _library()
        lib.define(name + schema(k))
        arg_names = [o.name for o in k.operands] + list(k.inout)
        returned = _returned(k)

        def impl(A: torch.Tensor, W: torch.Tensor, *args: Any) -> Any:
            out = k.run(A, W, dict(zip(arg_names, args)))
            vals = tuple(out[n] for n in returned)
            if not vals:
                return None
            # custom ops may not return views of internal buffers (partials are views)
            vals = tuple(v.clone() if v._base is not None else v for v in vals)
            return vals[0] if len(vals) == 1 else vals

        def fake(A: torch.Tensor, W: torch.Tensor, *args: Any) -> Any:
            vals = tuple(_fake_output(k, n, A, W) for n in returned)
            if not vals:
                return None
            return vals[0] if len(vals) == 1 else vals

        lib.impl(name, impl, "CUDA")
        torch.library.register_fake(f"coda_cutlass::{name}", fake, lib=lib)
        op = getattr(torch.ops.coda_cutlass, name)
        _OPS[name] = op
        return op


def _fake_output(k: OpKernel, name: str, A: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    M = A.shape[0]
    N = W.shape[0] if k.weight_layout == "nk" else W.shape[1]
    shape, dtype = k.output_spec(name, M, N)
    return A.new_empty(shape, dtype=dtype)


def call_op(k: OpKernel, A: torch.Tensor, W: torch.Tensor, operands: dict[str, Any]) -> dict:
    """The torch.compile path of ``k(A, W, ...)`` (traced by Dynamo: no locks, no registration)."""
    op = k._op
    k._check_names(operands)
    args = [operands[o.name] for o in k.operands] + [operands[n] for n in k.inout]
    out = op(A, W, *args)
    returned = _returned(k)
    if len(returned) == 1:
        out = (out,)
    result = dict(zip(returned, out or ()))
    for n in k.inout:
        result[n] = operands[n]
    return {n: result[n] for n in k.outputs}
