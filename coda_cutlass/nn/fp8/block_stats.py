"""Per-step statistics of a blockwise FP8 block's quantised operands, for users who watch training:
for each operand the last step's largest and smallest block scale (so the largest |value| lies in
(max_scale * fp8_max / 2, max_scale * fp8_max] with power-of-two scales) and how many of its runs
were non-finite (an inf or NaN in the run: the consumer then computes NaN, nothing is hidden).

Off by default (a few small reductions per operand and step); ``LlamaBlock.track_fp8_stats()``
turns it on. The summaries stay on the device until ``stats()`` reads them (which waits for the
GPU: call it for logging, not every step)."""

from __future__ import annotations

from typing import Any

import torch

from ...dtypes import FP8_MAX, as_dtype


class BlockScaleStats:
    def __init__(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn):
        self.fmax = float(FP8_MAX[as_dtype(fp8_dtype)])
        self._last: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def record(self, name: str, scales: torch.Tensor) -> None:
        """The row-major 1 x 128 scales of operand ``name`` (this step's)."""
        s = scales.detach().float()
        finite = torch.isfinite(s)
        self._last[name] = (torch.where(finite, s, 0.0).amax(), torch.where(finite, s, float("inf")).amin(),
                            (~finite).sum())

    def stats(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, (big, small, bad) in self._last.items():
            hi, lo = float(big), float(small)
            out[name] = {"max_scale": hi, "min_scale": lo, "amax_bound": hi * self.fmax, "nonfinite_runs": int(bad)}
        return out
