"""Which keys each query sees beyond plain causal attention: padding (transformers'
``attention_mask``: 0 marks a padded key) and packed documents (``position_ids`` that do not step by one
inside a row start a new document: a token sees only its own), as transformers builds them
(transformers isolates packed documents only when it keeps no KV cache, ``use_cache=False``, or
with flash-attention; coda always does).

The mask is (batch, 1, seq, seq) bool, True = attend. A query that would see no key at all (a
left-padding token) sees itself instead, so no row of the attention is empty (an empty row is NaN
in SDPA, and its gradient would poison the weights'); the outputs at padded positions are
unspecified, as transformers' are (which differ from coda's there): give -100 to the labels
predicted at padded positions (with left padding, also the first real token's label).
"""

from __future__ import annotations

import torch


def documents(position_ids: torch.Tensor) -> torch.Tensor | None:
    """(B, S) document index of each token of packed rows (a document starts wherever the position
    does not follow the previous one), or None when every row is one document."""
    start = position_ids[:, :1] - 1
    docs = (torch.diff(position_ids, prepend=start, dim=-1) != 1).cumsum(-1)
    return None if bool((docs[:, -1] == 0).all()) else docs


def attention_mask(batch: int, seq: int, device: torch.device, padding: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """The (B, 1, S, S) mask of padding and packed documents (causal included), or None when it
    is plain causal attention."""
    keys_ok = None
    if position_ids is not None and (position_ids.dim() not in (1, 2) or position_ids.shape[-1] != seq
                                     or (position_ids.dim() == 2 and position_ids.shape[0] not in (1, batch))):
        raise ValueError(f"position_ids must be (batch, seq) = ({batch}, {seq}) or (1, {seq}), got "
                         f"{tuple(position_ids.shape)}")
    if padding is not None:
        if tuple(padding.shape) != (batch, seq):
            raise ValueError(f"attention_mask must be (batch, seq) = ({batch}, {seq}), got {tuple(padding.shape)}")
        keys_ok = padding.to(device).bool()
        if bool(keys_ok.all()):
            keys_ok = None
    docs = None
    if position_ids is not None and padding is None:        # transformers looks for packing only without a mask
        docs = documents(position_ids.to(device).expand(batch, seq))
    if keys_ok is None and docs is None:
        return None
    i = torch.arange(seq, device=device)
    mask = (i[None, :] <= i[:, None]).expand(batch, seq, seq)
    if keys_ok is not None:
        mask = mask & keys_ok[:, None, :]
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])
    mask = mask | torch.eye(seq, dtype=torch.bool, device=device)     # no empty row
    return mask[:, None]
