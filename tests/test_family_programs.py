"""The epilogue programs the model families add (coda_cutlass.epilogues.gated) lower to CUDA source
(emit runs no nvcc); their math is checked through the interpreter by tests/test_hf_layers.py."""

from __future__ import annotations

import pytest
import torch

import coda_cutlass as cc
from coda_cutlass import epilogues as E


@pytest.mark.parametrize("program,layout", [(E.geglu_only, "nk"), (E.reglu_only, "nk"), (E.rope_bias, "nk"),
                                            (E.geglu_backward_scaled, "kn"), (E.reglu_backward_scaled, "kn")])
def test_gemm_programs_emit_cuda(program, layout):
    src = cc.emit(program, torch.bfloat16, weight_layout=layout)
    assert "extern \"C\"" in src and program.name in src


def test_rope_backward_bias_emits_a_map_kernel():
    src = cc.emit_map(E.rope_backward_bias, torch.bfloat16)
    assert "extern \"C\"" in src and "rope_backward_bias" in src
