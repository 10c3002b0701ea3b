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


@pytest.mark.parametrize("name", ["qk_norm_rope", "qk_norm_rope_backward", "qk_norm_backward"])
def test_qk_norm_map_programs_emit_cuda(name):
    assert "extern \"C\"" in cc.emit_map(getattr(E, name), torch.bfloat16)


def test_qk_norm_stats_program_emits_cuda():
    from coda_cutlass.nn.qk_norm import stats_program
    assert "segment_sum width 128" in cc.emit(stats_program(128), torch.bfloat16)


def test_sandwich_programs_emit_cuda():
    assert "extern \"C\"" in cc.emit(E.out_sumsq, torch.bfloat16)
    for p in (E.post_norm_residual, E.post_norm_residual_last, E.post_norm_c, E.post_norm_backward):
        assert "extern \"C\"" in cc.emit_map(p, torch.bfloat16), p.name


def test_softcap_programs_emit_cuda():
    for p, layout in ((E.rowscale_softcap, "nk"), (E.lm_head_lse_softcap, "nk"), (E.lm_head_lse_logits_softcap, "nk"),
                      (E.cross_entropy_backward_softcap, "nk")):
        assert "extern \"C\"" in cc.emit(p, torch.bfloat16, weight_layout=layout), p.name
    assert "extern \"C\"" in cc.emit_map(E.cross_entropy_grad_softcap, torch.bfloat16)
