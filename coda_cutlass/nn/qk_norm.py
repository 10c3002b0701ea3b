"""Per-head RMSNorm of q and k before RoPE (Qwen 3), around the QKV GEMM of a block
(``epilogues.qk_norm`` has the programs and why they are split so).

Forward: the QKV GEMM writes z = r * acc and the per-head sums of z^2; one map kernel per q and k
(rows = one head of one token) normalises, weights and rotates into the tensor attention reads; v
is copied. Backward: per q and k, two map kernels (RoPE backward with the norm's c, then the norm
backward writing dz' = r * dz into the QKV dX GEMM's operand); the gains' gradients are column
sums in torch.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

import coda_cutlass as cc

from .. import epilogues as E


@lru_cache(maxsize=None)
def stats_program(head_dim: int) -> Any:
    """The QKV GEMM epilogue: z = r * acc and the per-head sums of z^2, shape (M, heads)."""
    @cc.epilogue(name=f"qkv_head_sumsq_{head_dim}")
    def qkv_head_sumsq(acc, r: cc.PerRow(torch.float32)):
        z = acc * r
        return {"D": z, "head_sumsq": cc.segment_sum(z * z, head_dim)}
    return qkv_head_sumsq


def _parts(dims: Any) -> list[tuple[slice, int]]:
    """(columns, heads) of q and k in the QKV output."""
    nq, nkv = dims.q_width, dims.kv_width
    return [(slice(0, nq), dims.n_heads), (slice(nq, nq + nkv), dims.n_kv_heads)]


def _head_rows(v: torch.Tensor, heads: int) -> torch.Tensor:
    """A per-token vector repeated for each head: the per-row vector of (token, head) rows."""
    return v.repeat_interleave(heads)


def forward(step: Any, h: torch.Tensor, r: torch.Tensor, w: Any, site: str) -> tuple[torch.Tensor, tuple]:
    """(the q/k-normed, rotated QKV output attention reads, context for the backward)."""
    d, run = step.dims, step.runner
    hd, M = d.head_dim, h.shape[0]
    f = run.gemm(site, stats_program(hd), h, w.qkv, r=r)
    z, sumsq = f["D"], f["head_sumsq"]
    out = torch.empty_like(z)
    freq = step.freq[:hd]
    scales = []
    start = 0
    for (cols, heads), g in zip(_parts(d), (w.q_norm, w.k_norm)):
        s = (sumsq[:, start:start + heads].float() / hd + d.eps).rsqrt().reshape(-1)   # per (token, head)
        start += heads
        run.map("qk_norm", E.qk_norm_rope, z[:, cols].view(M, heads, hd), out={"y": out[:, cols].view(M, heads, hd)},
                s=s, g=g, pos=_head_rows(step.pos, heads), freq=freq)
        scales.append(s)
    v = slice(d.q_width + d.kv_width, d.qkv_width)
    out[:, v] = z[:, v]
    return out, (z, scales)


def backward(step: Any, ctx: tuple, w: Any, r: torch.Tensor, grads: tuple[torch.Tensor, ...],
             dqkv: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Writes dz' = r * dz of q and k into ``dqkv``; returns (per-token z . dz partials, dgain_q,
    dgain_k)."""
    d, run = step.dims, step.runner
    z, scales = ctx
    hd = d.head_dim
    M = z.shape[0]
    freq = step.freq[:hd]
    zdz, dgains = [], []
    for (cols, heads), g, s, dy in zip(_parts(d), (w.q_norm, w.k_norm), scales, grads):
        zh = z[:, cols].view(M, heads, hd)
        pos = _head_rows(step.pos, heads)
        a = run.map("qk_norm.dgrad", E.qk_norm_rope_backward, dy.reshape(M, heads, hd), partial=True,
                    z=zh, s=s, g=g, pos=pos, freq=freq)
        c = a["c"].sum(0) / hd
        b = run.map("qk_norm.dgrad2", E.qk_norm_backward, a["dn"], partial=True,
                    out={"dz": dqkv[:, cols].view(M, heads, hd)}, z=zh, s=s, c=c, g=g, r=_head_rows(r, heads))
        zdz.append(b["zdz"].view(-1, M, heads).sum(-1))
        xhat = zh.reshape(-1, hd).float() * s[:, None]
        dgains.append((a["dn"].float() * xhat).sum(0).to(g.dtype))
    return zdz, dgains[0], dgains[1]
