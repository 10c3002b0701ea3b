"""The Llama block's GEMM + epilogue kernels.

    python -m coda_cutlass prebuild bench/block_kernels.py --out DIR    # default configs, bf16 + fp16

PREBUILD: every kernel of coda_cutlass.nn at its default configuration ($BLOCK_DTYPES, default
bf16 and fp16). BENCH: what bench/block.py needs besides (scripts/gpu_block.sh builds it): the
tuning candidates of the block's fused sites in bf16 and the identity kernels of its coda-identity
skeleton."""

import os

import torch

from coda_cutlass import epilogues as E
from coda_cutlass.api import with_candidate_configs
from coda_cutlass.nn.kernels import SITES, prebuild_items

DTYPES = tuple(getattr(torch, d) for d in os.environ.get("BLOCK_DTYPES", "bfloat16,float16").split(","))
PREBUILD = prebuild_items(DTYPES)

BLOCK_SITES = ("qkv", "o", "gate_up", "down.dgrad", "gate_up.dgrad")   # one per distinct program and layout
BENCH = (PREBUILD
         + with_candidate_configs([(SITES[s][0], {"dtype": torch.bfloat16, "weight_layout": SITES[s][1]})
                                   for s in BLOCK_SITES])
         + [(E.identity, {"dtype": torch.bfloat16, "weight_layout": layout}) for layout in ("nk", "kn")])
