"""Transformer modules built from GEMM + epilogue kernels: a Llama block and model whose every
non-attention op, forward and backward, runs in a GEMM epilogue or a map kernel."""

from .block import LlamaBlock
from .model import LlamaModel
from .runner import Choice, KernelRunner, Recorder, ReferenceRunner
from .hf.causal_lm import from_hf, patch_hf

__all__ = ["LlamaBlock", "LlamaModel", "Choice", "KernelRunner", "Recorder", "ReferenceRunner", "from_hf", "patch_hf"]
