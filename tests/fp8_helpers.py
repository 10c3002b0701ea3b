"""Shared by the FP8 block tests (CPU and GPU): a runner that records every launch, weights drawn so
errors show, the blocks of a two-block FP8 model run on their own, and a few optimizer steps'
losses."""

from __future__ import annotations

from typing import Any

import torch

from coda_cutlass.nn import LlamaModel
from coda_cutlass.nn.runner import ReferenceRunner

BF16 = torch.bfloat16


class RecordingRunner(ReferenceRunner):
    """The reference interpreter, recording each GEMM as (site, program, layout, partial, fp8, A dtype,
    W dtype), each map kernel as (site, program, partial), and every site in launch order."""

    def __init__(self) -> None:
        super().__init__(BF16)
        self.gemms: list[tuple] = []
        self.maps: list[tuple] = []
        self.sites: list[str] = []

    def gemm(self, site, program, A, W, *, layout="nk", partial=False, fp8=None, **kw):
        self.gemms.append((site, program, layout, partial, fp8, A.dtype, W.dtype))
        self.sites.append(site)
        return super().gemm(site, program, A, W, layout=layout, partial=partial, fp8=fp8, **kw)

    def map(self, site, program, X, *, partial=False, **kw):
        self.maps.append((site, program, partial))
        self.sites.append(site)
        return super().map(site, program, X, partial=partial, **kw)


def draw_weights(block: Any) -> Any:
    """~1/sqrt(fan_in) weights and norm gains around 1: attention far from uniform, so RoPE, scale
    or operand mistakes show (transformers' 0.02 initialisation hides them)."""
    with torch.no_grad():
        for w in (block.qkv, block.o, block.gate_up, block.down):
            w.normal_(0.0, w.shape[1] ** -0.5)
        block.attn_norm.normal_(1.0, 0.2)
        block.mlp_norm.normal_(1.0, 0.2)
    return block


def blocks_step(seed: int = 0, fp8: Any = "blockwise") -> RecordingRunner:
    """The two blocks of a small FP8 model, forward and backward, without the (bf16) LM head."""
    torch.manual_seed(seed)
    m = LlamaModel(512, 256, 2, 2, 1, 512, head_dim=128, fp8=fp8, dtype=BF16)
    run = RecordingRunner()
    for b in m.blocks:
        b.runner = run
    step, x, h, r = m.hidden(torch.randint(0, 512, (2, 128)))
    (x.float() ** 2).mean().backward()
    return run


def losses(model: Any, tokens: torch.Tensor, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    """The loss of each of ``steps`` optimizer steps on one batch (the model memorises it)."""
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(tokens, tokens)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


BLOCK_OPERANDS = {"h", "o", "h1", "y", "dx2", "dz", "dx1", "dqkv", "dx"}   # a standalone block's FP8 operands


def check_scale_stats(stats: dict, x_grad: torch.Tensor) -> None:
    """A blockwise block's fp8_stats() after one step: every operand has finite, ordered scales, and
    (power-of-two scales) the largest |dx| of the step lies in (bound / 2, bound]."""
    assert set(stats) == BLOCK_OPERANDS, set(stats)
    for name, s in stats.items():
        assert 0 < s["min_scale"] <= s["max_scale"] and s["nonfinite_runs"] == 0, (name, s)
    amax = float(x_grad.float().abs().max())
    assert stats["dx"]["amax_bound"] / 2 < amax <= stats["dx"]["amax_bound"], (amax, stats["dx"])
