"""Weight layout helpers (with inverses) that let standard checkpoints use pairwise epilogues.

- Gate/up interleaving: a fused gate/up weight whose rows alternate [g0, u0, g1, u1, ...], so each
  gate/up pair lands in adjacent output columns of one GEMM (SwiGLU as a 2 -> 1 pair op).
- RoPE pairs: Llama checkpoints rotate "half-split" pairs (i, i + d_h/2) of each head; a pairwise
  epilogue rotates adjacent columns (2i, 2i + 1). Permuting the rows of W_q and W_k within each head
  converts one into the other; attention scores are unchanged because q and k get the same
  permutation of the head dimension.
"""

from __future__ import annotations

import torch


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """(f, d) gate and up weights -> one (2f, d) weight with rows [g0, u0, g1, u1, ...]."""
    if w_gate.shape != w_up.shape:
        raise ValueError(f"gate and up weights differ in shape: {tuple(w_gate.shape)} vs {tuple(w_up.shape)}")
    return torch.stack((w_gate, w_up), dim=1).reshape(2 * w_gate.shape[0], *w_gate.shape[1:])


def deinterleave_gate_up(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``interleave_gate_up`` (also splits an interleaved (M, 2f) activation by columns
    when given ``w.t()``)."""
    if w.shape[0] % 2:
        raise ValueError(f"an interleaved gate/up weight has an even number of rows, got {w.shape[0]}")
    pairs = w.reshape(w.shape[0] // 2, 2, *w.shape[1:])
    return pairs[:, 0].contiguous(), pairs[:, 1].contiguous()


def rope_pair_permutation(head_dim: int) -> torch.Tensor:
    """Index p with new[j] = old[p[j]]: new columns (2i, 2i+1) are old half-split (i, i + head_dim/2)."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    half = head_dim // 2
    return torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).reshape(-1)


def permute_rope_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a (n_heads * head_dim, d) q or k weight, half-split RoPE order -> adjacent pairs."""
    if w.shape[0] % head_dim:
        raise ValueError(f"{w.shape[0]} rows are not a whole number of heads of {head_dim}")
    p = rope_pair_permutation(head_dim)
    return w.reshape(-1, head_dim, *w.shape[1:])[:, p].reshape(w.shape)


def unpermute_rope_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of ``permute_rope_rows``."""
    if w.shape[0] % head_dim:
        raise ValueError(f"{w.shape[0]} rows are not a whole number of heads of {head_dim}")
    inv = torch.argsort(rope_pair_permutation(head_dim))
    return w.reshape(-1, head_dim, *w.shape[1:])[:, inv].reshape(w.shape)
