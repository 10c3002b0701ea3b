"""Ready-made epilogue programs for the non-attention work of a Llama-style block
(docs/TRANSFORMER_MATH.md). Import them from ``coda_cutlass.epilogues``.

Forward:  residual_norm_stats (out-proj / down-proj), rowscale (the consumer of an RMSNorm),
          swiglu / geglu / reglu (gate/up GEMM, half-width output), rope (QKV GEMM),
          lm_head_lse (LM head: log-sum-exp and target logit), qk_norm_stats (per-head sum of
          squares), bias_gelu, residual_add, identity.
Backward: rmsnorm_backward (the norm-backward dX GEMM epilogue), swiglu_backward (down-proj dX).
Training a Llama block (coda_cutlass.nn; block.py): swiglu_backward_y (swiglu_backward_scaled
          with y written again), norm_backward(_first), norm_backward_h (with h = x * g written again),
          cross_entropy_backward; norm_stats, rope_backward and scale_by (the fused LM head's
          gradients times dloss, in place) are map kernels (no GEMM).
Model families (coda_cutlass.nn.hf; gated.py): geglu_only, reglu_only, geglu_backward_scaled /
          _y, reglu_backward_scaled / _y, rope_bias (q/k/v biases), rope_backward_bias; per-head q/k norms
          (qk_norm.py): qk_norm_rope, qk_norm_rope_backward, qk_norm_backward (map kernels); sandwich
          norms (sandwich.py): out_sumsq, post_norm_residual(_last), post_norm_c, post_norm_backward;
          soft-capped logits (softcap.py): the LM head's programs with a cap.
FP8 blocks (coda_cutlass.nn.fp8; fp8_block.py): norm_stats_fp8, quantize_rows, quantize_rows_t (map
          kernels; with 128 x 1-scaled transposed copies),
          residual_norm_stats_fp8, swiglu_fp8 (its transposed copy; swiglu_fp8_rows: both copies, for
          256-wide tiles), norm_backward_fp8: outputs quantised by cc.quantize; norm_backward_ax (the
          norm-backward dX with acc * x for dgamma, summed outside), swiglu_backward_fp8 (dz as its
          gate and up halves, both copies quantised; not used by the recipes); their "_g16" twins
          (fp8_block_grouped.py) give activations' transposed copies 16 x 128 block scales. Per-tensor scaling
          (fp8_tensorwise.py): quantize_tensor, rope_backward_t (map kernels), residual_norm_stats_t,
          swiglu_t, swiglu_backward_t, norm_backward_t: given scales, amaxes, transposed copies.
Helpers:  rstd_from_sumsq (finishes RMSNorm statistics: r = rsqrt(mean x^2 + eps)).
"""

from .activations import bias_gelu, bias_relu, rowscale_silu
from .basic import identity, residual_add, rowscale, scale_by
from .norms import qk_norm_stats, residual_norm_stats, rmsnorm_backward, rstd_from_sumsq
from .pairwise import geglu, reglu, rope, rope_generic, swiglu, swiglu_backward, swiglu_only
from .loss import lm_head_lse, lm_head_lse_logits
from .block import (cross_entropy_backward, cross_entropy_grad, norm_backward, norm_backward_first, norm_backward_h,
                    norm_stats, rope_backward, swiglu_backward_scaled, swiglu_backward_y)
from .qk_norm import qk_norm_backward, qk_norm_rope, qk_norm_rope_backward
from .fp8_block import (norm_backward_ax, norm_backward_fp8, norm_stats_fp8, quantize_rows, quantize_rows_t,
                        residual_norm_stats_fp8, swiglu_backward_fp8, swiglu_fp8, swiglu_fp8_rows)
from .fp8_block_grouped import (norm_stats_fp8_g16, quantize_rows_t_g16, residual_norm_stats_fp8_g16,
                                swiglu_fp8_g16)
from .fp8_tensorwise import (norm_backward_t, quantize_tensor, residual_norm_stats_t, rope_backward_t,
                             swiglu_backward_t, swiglu_t)
from .softcap import (cross_entropy_backward_softcap, cross_entropy_grad_softcap, lm_head_lse_logits_softcap,
                      lm_head_lse_softcap, rowscale_softcap)
from .sandwich import out_sumsq, post_norm_backward, post_norm_c, post_norm_residual, post_norm_residual_last
from .gated import (geglu_backward_scaled, geglu_backward_y, geglu_only, reglu_backward_scaled, reglu_backward_y,
                    reglu_only, rope_backward_bias,
                    rope_bias)

__all__ = ["identity", "residual_add", "rowscale", "scale_by", "bias_gelu", "bias_relu", "rowscale_silu",
           "residual_norm_stats", "rmsnorm_backward", "rstd_from_sumsq", "qk_norm_stats",
           "swiglu", "swiglu_only", "geglu", "reglu", "swiglu_backward", "rope", "rope_generic", "lm_head_lse",
           "lm_head_lse_logits", "swiglu_backward_scaled", "norm_backward", "norm_backward_first", "norm_backward_h",
           "norm_stats",
           "rope_backward", "cross_entropy_backward", "cross_entropy_grad", "geglu_only", "reglu_only", "geglu_backward_scaled",
           "reglu_backward_scaled", "rope_bias", "rope_backward_bias", "qk_norm_rope", "qk_norm_rope_backward",
           "qk_norm_backward", "out_sumsq", "post_norm_residual", "post_norm_residual_last", "post_norm_c",
           "post_norm_backward", "rowscale_softcap", "lm_head_lse_softcap", "lm_head_lse_logits_softcap",
           "cross_entropy_backward_softcap", "cross_entropy_grad_softcap", "norm_stats_fp8", "quantize_rows", "quantize_rows_t",
           "residual_norm_stats_fp8", "swiglu_fp8", "swiglu_fp8_rows", "norm_backward_fp8",
           "quantize_tensor", "residual_norm_stats_t", "swiglu_t", "swiglu_backward_t", "norm_backward_t",
           "rope_backward_t", "norm_backward_ax", "norm_stats_fp8_g16", "quantize_rows_t_g16",
           "residual_norm_stats_fp8_g16", "swiglu_fp8_g16", "swiglu_backward_y", "geglu_backward_y",
           "reglu_backward_y", "swiglu_backward_fp8"]
