"""Padding (attention_mask) and packed documents (position_ids) through coda models, against the
transformers model (CPU, fp32, large weights): loss and every gradient."""

from __future__ import annotations

import pytest
import torch

import coda_cutlass.nn as cnn
from coda_cutlass.nn.masks import attention_mask, documents
from test_hf_models import check_model, hf_model


def _batch(S: int = 12):
    g = torch.Generator().manual_seed(4)
    return torch.randint(1, 48, (2, S), generator=g)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("model_type,fields", [("llama", {}), ("mistral", {"sliding_window": 4})])
def test_padding_matches_transformers(side, model_type, fields):
    hf = hf_model(model_type, **fields)
    model = cnn.from_hf(hf)
    tokens = _batch()
    mask = torch.ones_like(tokens)
    if side == "right":
        mask[1, -4:] = 0
    else:
        mask[1, :3] = 0
    labels = tokens.masked_fill(mask == 0, -100)
    if side == "left":      # the first real token is predicted at a padded position: unspecified (nn.masks)
        labels[1, 3] = -100
    ref = hf(input_ids=tokens, attention_mask=mask, labels=labels)
    out = model(input_ids=tokens, attention_mask=mask, labels=labels)
    assert abs(out.loss.item() - ref.loss.item()) < 1e-4 * ref.loss.item()
    model.zero_grad()
    hf.zero_grad()
    check_model(hf, model, tokens, labels, attention_mask=mask)


def test_packed_documents_match_transformers():
    hf = hf_model()
    model = cnn.from_hf(hf)
    tokens = _batch()
    pos = torch.cat((torch.arange(5), torch.arange(7)))[None].repeat(2, 1)
    pos[1] = torch.arange(12)                          # row 1: one document
    # transformers isolates packed documents only without a KV cache (use_cache=False); coda always does
    check_model(hf, model, tokens, tokens, position_ids=pos, use_cache=False)


def test_positions_past_the_trained_length_for_dynamic_rope():
    hf = hf_model(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                  max_position_embeddings=8)
    model = cnn.from_hf(hf)
    tokens = _batch(6)
    pos = (torch.arange(6) + 10)[None].repeat(2, 1)   # positions 10..15 > 8: the dynamic base follows them
    check_model(hf, model, tokens, tokens, position_ids=pos)


def test_mask_helpers():
    assert documents(torch.arange(6)[None]) is None
    assert documents(torch.tensor([[0, 1, 0, 1, 2, 0]])).tolist() == [[0, 0, 1, 1, 1, 2]]
    assert attention_mask(1, 4, torch.device("cpu"), torch.ones(1, 4)) is None
    m = attention_mask(1, 4, torch.device("cpu"), torch.tensor([[0, 1, 1, 1]]))
    assert m.shape == (1, 1, 4, 4) and m[0, 0, 0].tolist() == [True, False, False, False]
    assert m[0, 0, 3].tolist() == [False, True, True, True]
    with pytest.raises(ValueError, match="attention_mask must be"):
        attention_mask(1, 4, torch.device("cpu"), torch.ones(2, 4))
