"""The gated MLP activations a block can run, each as its three epilogue programs: the gate/up GEMM
(z saved for the backward, y = act(gate) * up), the gate/up GEMM of the forward alone (y only) and
the down-proj dX GEMM of the backward (dz' = r * dz, z . dz partials, and y again from z for the
down-proj weight gradient, so the forward does not keep y)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import epilogues as E


@dataclass(frozen=True)
class Activation:
    name: str
    train: Any
    infer: Any
    backward: Any

    def __reduce__(self) -> tuple:
        return (activation, (self.name,))      # pickled by name: the programs are module-level objects


ACTIVATIONS: dict[str, Activation] = {
    "silu": Activation("silu", E.swiglu, E.swiglu_only, E.swiglu_backward_y),
    "gelu_tanh": Activation("gelu_tanh", E.geglu, E.geglu_only, E.geglu_backward_y),
    "relu": Activation("relu", E.reglu, E.reglu_only, E.reglu_backward_y),
}

# transformers' names (ACT2FN) of the activations above
HF_NAMES: dict[str, str] = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                            "gelu_fast": "gelu_tanh", "relu": "relu"}


def activation(name: str) -> Activation:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]
