"""Sandwich norms around a block's projections (Gemma 2 / 3): the out-proj's and the down-proj's
outputs are RMSNorm-ed before the residual add (``epilogues.sandwich`` has the programs and why the
norm is a map kernel after the GEMM rather than in its epilogue)."""

from __future__ import annotations

from typing import Any

import torch

from .. import epilogues as E
from .stats import row_mean, rstd


def forward(step: Any, site: str, A: torch.Tensor, W: torch.Tensor, resid: torch.Tensor, g_post: torch.Tensor,
            g_next: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, tuple]:
    """x1 = resid + norm_post(A @ W^T); with g_next also h1 = x1 * g_next and r1 = rstd(x1).
    Returns (x1, h1, r1, context for the backward)."""
    d, run = step.dims, step.runner
    f = run.gemm(site, E.out_sumsq, A, W, partial=True)
    o = f["D"]
    s = rstd(f["sumsq"], d.dim, d.eps)
    if g_next is None:
        return run.map(site + ".post", E.post_norm_residual_last, o, resid=resid, s=s, g=g_post)["x"], None, None, (o, s)
    m = run.map(site + ".post", E.post_norm_residual, o, partial=True, resid=resid, s=s, g=g_post, g_next=g_next)
    return m["x"], m["h"], rstd(m["sumsq"], d.dim, d.eps), (o, s)


def backward(step: Any, site: str, ctx: tuple, g_post: torch.Tensor, dres: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of the projection's output from the stream's (dres), and the post norm's
    gain gradient."""
    d, run = step.dims, step.runner
    o, s = ctx
    c = row_mean(run.map(site + ".post.c", E.post_norm_c, dres, partial=True, o=o, s=s, g=g_post)["c"], d.dim)
    do = run.map(site + ".post.dgrad", E.post_norm_backward, dres, o=o, s=s, c=c, g=g_post)["do"]
    dgain = (dres.float() * o.float() * s[:, None]).sum(0).to(g_post.dtype)
    return do, dgain
