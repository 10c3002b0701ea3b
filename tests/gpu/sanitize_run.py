"""Runs a representative set of kernels once each at ragged shapes, for compute-sanitizer:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python tests/gpu/sanitize_run.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool racecheck python tests/gpu/sanitize_run.py

(Without torch's caching allocator every tensor is its own allocation, so memcheck sees an access
one element past any tensor.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import coda_cutlass as cc  # noqa: E402
from catalog import BY_NAME, compile_options, fit_n, make_inputs  # noqa: E402

CASES = ["residual_norm_stats", "every_op", "kn_accumulate_no_d", "norm_backward", "many_reductions",
         "accumulate_D", "small_tile_config", "fp16_bias_relu", "reductions_only", "aux_only_named",
         "row_max_min"]
# the custom visitor nodes (pairs, half-width stores, packed pairs, LSE, gather, segments, indices)
PAIRWISE_CASES = ["swiglu", "geglu_f16_half_only", "rope", "rope_rotate_pairs_f16", "pair_generic", "lm_head_lse_gather",
                  "lse_masked_rows_and_tiles", "swiglu_backward", "segment_sum_heads", "segment_sum_narrow"]
SHAPES = [(129, 136, 64), (300, 264, 72), (1, 8, 8), (257, 520, 136)]
KEYS = ("dtype", "weight_layout", "config", "input_dtypes", "output_dtypes", "constants", "partial_reductions")

if __name__ == "__main__":
    names = sys.argv[1:] or CASES
    if names == ["pairwise"]:
        names = PAIRWISE_CASES
    for name in names:
        c = BY_NAME[name]
        k = cc.compile_epilogue(c.program, **{x: v for x, v in compile_options(c).items() if x in KEYS})
        for M, N, K in SHAPES:
            A, W, ops = make_inputs(c, M, fit_n(c, N), K, "cuda", seed=7)
            k(A, W, **ops)
        torch.cuda.synchronize()
        print(f"ran {name} at {SHAPES}", flush=True)
