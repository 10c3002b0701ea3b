"""Registering a map kernel (``runtime.map_kernel.CompiledMap``) as a ``torch.library`` custom op with
a fake implementation, so ``torch.compile`` traces ``k(X, ...)`` without a graph break (as the GEMM
kernels' ops do, torch_op.py).

Schema: ``coda_cutlass::map_<program>_<digest>(Tensor X, <operands>, <accumulated outputs as
Tensor(a!)>) -> (<other outputs>)``: host scalars are ``float`` arguments, accumulated outputs are
mutated in place, not returned. Block-scale outputs are returned as their run-major buffer and
viewed after the op (as the GEMM ops do). Calls with ``out=`` are not traced: they run eagerly,
behind a graph break, as every map kernel call did before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from ..ir.nodes import Operand
from .torch_op import ascii_names, define, digest_of, labelled, owned, packed, returned_outputs, returns_schema


class OpMap(Protocol):
    """What registration needs of a map kernel."""
    name: str
    key: str
    path: Path
    partial_reductions: bool
    operands: tuple[Operand, ...]
    inout: tuple[str, ...]
    outputs: tuple[str, ...]
    _op: Any

    def run(self, X: torch.Tensor, operands: dict[str, Any],
            out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]: ...
    def output_layout(self, name: str, M: int, N: int) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype]: ...
    def scale_view(self, name: str, buffer: torch.Tensor, M: int, N: int) -> torch.Tensor: ...
    def check_call_names(self, operands: dict[str, Any]) -> None: ...
    def logical_mn(self, X: torch.Tensor) -> tuple[int, int]: ...
    scale_outputs: tuple[str, ...]


def op_name(k: OpMap) -> str:
    """``map_<program>_<digest>``: the digest covers the kernel (build key and .so), how reductions
    are returned and the names it is called with, so two map kernels share an op only if they are
    the same kernel."""
    fields = {"program": k.name, "key": k.key, "path": str(Path(k.path).resolve()),
              "partial_reductions": k.partial_reductions, "operands": [(o.name, o.kind.value) for o in k.operands],
              "inout": list(k.inout), "outputs": list(k.outputs)}
    return labelled(k.name, digest_of(fields), "map", prefix="map_")


def schema(k: OpMap) -> str:
    names = ascii_names([o.name for o in k.operands] + list(k.inout), {"X"})
    args = ["Tensor X"]
    args += [f"float {n}" if o.host_scalar else f"Tensor {n}" for o, n in zip(k.operands, names)]
    args += [f"Tensor(a{i}!) {n}" for i, n in enumerate(names[len(k.operands):])]
    return f"({', '.join(args)}) -> {returns_schema(len(returned_outputs(k)))}"


def register_map(k: OpMap) -> Any:
    return define(op_name(k), schema(k), lambda: _implementations(k))


def _implementations(k: OpMap) -> tuple[Any, Any]:
    arg_names = [o.name for o in k.operands] + list(k.inout)
    rets = returned_outputs(k)
    scales = set(k.scale_outputs)

    def impl(X: torch.Tensor, *args: Any) -> Any:
        out = k.run(X, dict(zip(arg_names, args)))
        M, N = k.logical_mn(X)
        vals = []
        for n in rets:
            shape, stride, _ = k.output_layout(n, M, N)
            # block scales: the run-major buffer behind the (rows, runs) view
            vals.append(owned(out[n].t().as_strided(shape, stride) if n in scales else out[n], stride))
        return packed(tuple(vals))

    def fake(X: torch.Tensor, *args: Any) -> Any:
        M, N = k.logical_mn(X)
        return packed(tuple(X.new_empty_strided(shape, stride, dtype=dtype)
                            for shape, stride, dtype in (k.output_layout(n, M, N) for n in rets)))

    return impl, fake


def call_map_op(k: OpMap, X: torch.Tensor, operands: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The torch.compile path of ``k(X, ...)`` (traced by Dynamo: no locks, no registration)."""
    k.check_call_names(operands)
    args = [float(operands[o.name]) if o.host_scalar else operands[o.name] for o in k.operands]
    args += [operands[n] for n in k.inout]
    out = k._op(X, *args)
    rets = returned_outputs(k)
    if len(rets) == 1:
        out = (out,)
    result = dict(zip(rets, out or ()))
    if k.scale_outputs:
        M, N = k.logical_mn(X)
        for n in k.scale_outputs:
            result[n] = k.scale_view(n, result[n], M, N)
    for n in k.inout:
        result[n] = operands[n]
    return {n: result[n] for n in k.outputs}
