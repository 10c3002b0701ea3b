"""The epilogue programs the benchmark suite times (for `python -m coda_cutlass prebuild
bench/programs.py --all-candidates --out DIR`, which builds every autotuning candidate ahead of time)."""

import torch

from coda_cutlass.epilogues import bias_gelu, identity, residual_add, residual_norm_stats, rowscale_silu

PROGRAMS = [identity, residual_add, residual_norm_stats, rowscale_silu, bias_gelu]
PREBUILD = [(p, {"dtype": torch.bfloat16}) for p in PROGRAMS]
