"""A Llama-style block through the library's epilogue programs, in fp32 on the CPU (the torch
interpreter), against a standard block written with separate q/k/v and gate/up weights,
half-split RoPE and F.rms_norm, after converting the weights with coda_cutlass.layouts
(docs/TRANSFORMER_MATH.md: kernels F1-F4 forward, the SwiGLU backward B4 against autograd)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import coda_cutlass as cc
from coda_cutlass import epilogues as E
from coda_cutlass.epilogues.norms import rstd_from_sumsq
from coda_cutlass.layouts import deinterleave_gate_up, interleave_gate_up, permute_rope_rows, unpermute_rope_rows

M, D, FF, HD, NQ, NKV = 12, 64, 96, 16, 4, 2
EPS = 1e-6


def run(program, A, W, **ops):
    return cc.reference(program, A, W, precision="fp32", **ops)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def standard_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """HF Llama: per head, columns i and i + HD/2 share the angle pos * inv_freq[i]."""
    theta = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((theta, theta), dim=-1)
    heads = x.view(x.shape[0], -1, HD)
    out = heads * emb.cos()[:, None] + rotate_half(heads) * emb.sin()[:, None]
    return out.reshape(x.shape)


def test_llama_block_forward_and_swiglu_backward():
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s, scale=0.3: torch.randn(*s, generator=g) * scale  # noqa: E731
    x0, attn = rnd(M, D, scale=1.0), rnd(M, D, scale=1.0)
    Wo, Wg, Wu, Wd = rnd(D, D), rnd(FF, D), rnd(FF, D), rnd(D, FF)
    Wq, Wk, Wv = rnd(NQ * HD, D), rnd(NKV * HD, D), rnd(NKV * HD, D)
    g1, g2 = 1 + rnd(D), 1 + rnd(D)
    pos = torch.arange(M, dtype=torch.float32) * 37.0
    inv_freq = 10000.0 ** (-torch.arange(0, HD, 2, dtype=torch.float32) / HD)

    # ---- the standard block (autograd through the MLP for the backward check)
    x1 = x0 + attn @ Wo.t()
    h1 = F.rms_norm(x1, (D,), weight=g1, eps=EPS)
    gate = (h1 @ Wg.t()).requires_grad_()
    up = (h1 @ Wu.t()).requires_grad_()
    y = F.silu(gate) * up
    x2 = x1 + y @ Wd.t()
    h2 = F.rms_norm(x2, (D,), weight=g2, eps=EPS)
    q, k, v = h2 @ Wq.t(), h2 @ Wk.t(), h2 @ Wv.t()
    q, k = standard_rope(q, pos, inv_freq), standard_rope(k, pos, inv_freq)

    # ---- the same block as GEMM + epilogue programs, weights converted once
    Wgu = interleave_gate_up(Wg, Wu)
    Wqkv = torch.cat((permute_rope_rows(Wq, HD), permute_rope_rows(Wk, HD), Wv))
    freq = torch.cat((inv_freq.repeat_interleave(2).repeat(NQ + NKV), torch.zeros(NKV * HD)))

    f1 = run(E.residual_norm_stats, attn, Wo, resid=x0, g=g1)                 # F1
    r1 = rstd_from_sumsq(f1["sumsq"], D, EPS)                                 # R1
    f2 = run(E.swiglu, f1["h"], Wgu, r=r1)                                    # F2
    f3 = run(E.residual_norm_stats, f2["y"], Wd, resid=f1["D"], g=g2)         # F3
    r2 = rstd_from_sumsq(f3["sumsq"], D, EPS)                                 # R2
    f4 = run(E.rope, f3["h"], Wqkv, r=r2, pos=pos, freq=freq)["D"]           # F4

    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f1["D"], x1, **close)
    torch.testing.assert_close(f2["y"], y.detach(), **close)
    gz, uz = deinterleave_gate_up(f2["z"].t())
    torch.testing.assert_close(gz.t(), gate.detach(), **close)
    torch.testing.assert_close(uz.t(), up.detach(), **close)
    torch.testing.assert_close(f3["D"], x2.detach(), **close)
    qn, kn = NQ * HD, NKV * HD
    torch.testing.assert_close(unpermute_rope_rows(f4[:, :qn].t(), HD).t(), q.detach(), **close)
    torch.testing.assert_close(unpermute_rope_rows(f4[:, qn:qn + kn].t(), HD).t(), k.detach(), **close)
    torch.testing.assert_close(f4[:, qn + kn:], v.detach(), **close)

    # ---- B4: the down-proj dX GEMM with the SwiGLU backward epilogue, against autograd
    dx2 = rnd(M, D, scale=1.0)
    (x2 * dx2).sum().backward()
    b4 = run(E.swiglu_backward, dx2, Wd.t().contiguous(), z=f2["z"])
    dgate, dup = deinterleave_gate_up(b4["dz"].t())
    torch.testing.assert_close(dgate.t(), gate.grad, **close)
    torch.testing.assert_close(dup.t(), up.grad, **close)
    torch.testing.assert_close(b4["D"], y.detach(), **close)
    torch.testing.assert_close(b4["zdz"], (f2["z"] * b4["dz"]).sum(1), **close)
