"""The epilogue programs the benchmark suite times (for `python -m coda_cutlass prebuild
bench/programs.py --all-candidates --out DIR`, which builds every autotuning candidate ahead of time)."""

import torch

from run import EPILOGUES

PROGRAMS = [program for program, _, _ in EPILOGUES.values()]
PREBUILD = [(p, {"dtype": torch.bfloat16}) for p in PROGRAMS]
