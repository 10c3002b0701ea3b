"""The token-embedding lookup of a LlamaModel as a module of its own (``model.input_embedding``).

It holds no state: its weight is the model's ``embed`` Parameter, which stays the model's (checkpoints
keep the key ``embed``; a tied LM head shares it). It exists so that what transformers does to
``get_input_embeddings()`` works on coda models: forward hooks see the embedded tokens (NEFTune's
noise in Trainer, ``enable_input_require_grads``), and PEFT's prompt tuning can embed token ids.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class InputEmbedding(nn.Module):
    """``forward(tokens)`` -> ``embed[tokens]`` (nn.Embedding's lookup: the padding token's row gets
    no gradient; no scaling, Gemma's sqrt(dim) is the model's, after it), shape ``(*tokens.shape, dim)``."""

    def __init__(self, owner: nn.Module):
        super().__init__()
        object.__setattr__(self, "_owner", owner)      # not a submodule: no cycle in modules() or state_dict()

    @property
    def weight(self) -> torch.Tensor:
        return self._owner.embed

    @property
    def padding_idx(self) -> int | None:
        return self._owner.padding_idx

    @property
    def num_embeddings(self) -> int:
        return self.weight.shape[0]

    @property
    def embedding_dim(self) -> int:
        return self.weight.shape[1]

    def forward(self, tokens: torch.Tensor) -> Any:
        return nn.functional.embedding(tokens, self.weight, padding_idx=self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} (the model's embed)"
