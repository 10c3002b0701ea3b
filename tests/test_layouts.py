"""Weight layout helpers: round trips, and that the RoPE permutation turns half-split rotation into
adjacent-pair rotation with identical attention scores."""

from __future__ import annotations

import pytest
import torch

from coda_cutlass.layouts import (deinterleave_gate_up, interleave_gate_up, permute_rope_rows,
                                  rope_pair_permutation, unpermute_rope_rows)


def test_gate_up_round_trip_and_pairs():
    g, u = torch.randn(6, 4), torch.randn(6, 4)
    w = interleave_gate_up(g, u)
    assert torch.equal(w[0], g[0]) and torch.equal(w[1], u[0]) and torch.equal(w[5], u[2])
    g2, u2 = deinterleave_gate_up(w)
    assert torch.equal(g2, g) and torch.equal(u2, u)
    x = torch.randn(3, 4)
    z = x @ w.t()                                   # adjacent columns hold (gate, up) pairs
    assert torch.allclose(z[:, 0::2], x @ g.t()) and torch.allclose(z[:, 1::2], x @ u.t())
    with pytest.raises(ValueError):
        interleave_gate_up(g, u[:5])


def rope_half(x, pos, inv_freq):
    """Llama's rotate_half RoPE on (tokens, heads, head_dim)."""
    ang = pos[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def rope_pairs(x, pos, inv_freq):
    """Adjacent-pair RoPE: (x_2i, x_2i+1) rotated by pos * inv_freq[i]."""
    ang = (pos[:, None] * inv_freq[None, :])[:, None]
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * ang.cos() - b * ang.sin()
    out[..., 1::2] = a * ang.sin() + b * ang.cos()
    return out


def test_rope_permutation_preserves_attention_scores():
    torch.manual_seed(0)
    T, d, H, dh = 5, 32, 2, 8
    x = torch.randn(T, d, dtype=torch.float64)
    wq, wk = torch.randn(H * dh, d, dtype=torch.float64), torch.randn(H * dh, d, dtype=torch.float64)
    pos = torch.arange(T, dtype=torch.float64)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dh, 2, dtype=torch.float64) / dh))
    q = rope_half((x @ wq.t()).view(T, H, dh), pos, inv_freq)
    k = rope_half((x @ wk.t()).view(T, H, dh), pos, inv_freq)
    q2 = rope_pairs((x @ permute_rope_rows(wq, dh).t()).view(T, H, dh), pos, inv_freq)
    k2 = rope_pairs((x @ permute_rope_rows(wk, dh).t()).view(T, H, dh), pos, inv_freq)
    s1 = torch.einsum("thd,shd->hts", q, k)
    s2 = torch.einsum("thd,shd->hts", q2, k2)
    assert torch.allclose(s1, s2, atol=1e-10)
    p = rope_pair_permutation(dh)
    assert torch.allclose(q2, q[..., p], atol=1e-10)
    assert torch.equal(unpermute_rope_rows(permute_rope_rows(wq, dh), dh), wq)
