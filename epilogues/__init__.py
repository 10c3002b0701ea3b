"""Ready-made epilogue programs for the non-attention work of a Llama-style block
(TRANSFORMER_MATH.md). Import them from ``coda_cutlass.epilogues``.

Forward:  residual_norm_stats (out-proj / down-proj), rowscale (the consumer of an RMSNorm),
          bias_gelu, residual_add, identity.
Backward: rmsnorm_backward (the norm-backward dX GEMM epilogue).
Helpers:  rstd_from_sumsq (finishes RMSNorm statistics: r = rsqrt(mean x^2 + eps)).
"""

from .activations import bias_gelu, bias_relu, rowscale_silu
from .basic import identity, residual_add, rowscale
from .norms import residual_norm_stats, rmsnorm_backward, rstd_from_sumsq

__all__ = ["identity", "residual_add", "rowscale", "bias_gelu", "bias_relu", "rowscale_silu",
           "residual_norm_stats", "rmsnorm_backward", "rstd_from_sumsq"]
