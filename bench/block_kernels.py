"""The Llama block's GEMM + epilogue kernels, for `python -m coda_cutlass prebuild`:
    python -m coda_cutlass prebuild bench/block_kernels.py --out DIR                   # default configs, bf16 + fp16
    python -m coda_cutlass prebuild bench/block_kernels.py --all-candidates --out DIR  # + every tuning candidate"""

import os

import torch

from coda_cutlass.nn.kernels import prebuild_items

DTYPES = tuple(getattr(torch, d) for d in os.environ.get("BLOCK_DTYPES", "bfloat16,float16").split(","))
PREBUILD = prebuild_items(DTYPES)
