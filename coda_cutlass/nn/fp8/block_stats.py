"""Per-step statistics of a blockwise FP8 block's quantised operands, for users who watch training:
for each operand the last step's largest and smallest block scale over its runs that hold a nonzero
value (so the largest |value| lies in (max_scale * fp8_max / 2, max_scale * fp8_max] with
power-of-two scales), how many of its runs were all zero (their scale is 1 by convention: padding,
ignored targets) and how many were non-finite (an inf or NaN in the run: the consumer then computes
NaN, nothing is hidden). An operand without a finite nonzero run reports scales and bound 0.

Off by default (a few reductions per operand and step, one of them over the operand's 1-byte
codes, to tell all-zero runs from runs whose scale is 1); ``LlamaBlock.track_fp8_stats()`` turns it
on. The summaries stay on the device until ``stats()`` reads them (which waits for the GPU: call it
for logging, not every step)."""

from __future__ import annotations

from typing import Any

import torch

from ...dtypes import FP8_MAX, as_dtype


class BlockScaleStats:
    def __init__(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn):
        self.fmax = float(FP8_MAX[as_dtype(fp8_dtype)])
        self._last: dict[str, tuple[torch.Tensor, ...]] = {}

    def record(self, name: str, scales: torch.Tensor, codes: torch.Tensor | None = None) -> None:
        """The row-major 1 x 128 scales of operand ``name`` (this step's), and its codes (which tell
        the all-zero runs; without them every finite run counts)."""
        s = scales.detach().float()
        finite = torch.isfinite(s)
        if codes is None:
            zero = torch.zeros_like(finite)
        else:           # a run is all zero when every code's magnitude bits are (e4m3 / e5m2: sign in bit 7)
            mag = codes.detach().contiguous().view(torch.uint8).reshape(*s.shape, -1) & 0x7F
            zero = mag.amax(-1) == 0
        counted = finite & ~zero
        self._last[name] = (torch.where(counted, s, 0.0).amax(), torch.where(counted, s, float("inf")).amin(),
                            (~finite).sum(), (finite & zero).sum())

    def stats(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, (big, small, bad, zero) in self._last.items():
            hi, lo = float(big), float(small)
            lo = 0.0 if hi == 0.0 else lo          # no finite nonzero run
            out[name] = {"max_scale": hi, "min_scale": lo, "amax_bound": hi * self.fmax, "nonfinite_runs": int(bad),
                         "zero_runs": int(zero)}
        return out
