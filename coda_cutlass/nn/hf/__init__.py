"""Hugging Face transformers models through coda_cutlass.nn.

- ``fields``: reading a transformers config, in the style of transformers 5 (``rope_parameters``)
  or 4 (``rope_theta`` / ``rope_scaling``), and refusing, by name, every field whose effect on the
  math is not implemented;
- ``family``: what a model family is (the Llama layer is the base; ``family.Family``), one module
  per family says how it differs (``llama``, ``mistral``, ``phi3``; ``unsupported`` refuses the rest
  clearly); ``registry`` finds the family of a config;
- ``layer``: one decoder layer to a ``LlamaBlock`` and back.

This package's ``__init__`` imports nothing: ``coda_cutlass.nn.block`` imports ``hf.layer`` while
the whole-model conversion imports the block.
"""
