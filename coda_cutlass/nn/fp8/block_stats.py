"""Per-step statistics of a blockwise FP8 block's quantised operands, for users who watch training:
for each operand the step's largest and smallest block scale over its runs that hold a nonzero
value (so the largest |value| lies in (max_scale * fp8_max / 2, max_scale * fp8_max] with
power-of-two scales), how many of its runs were all zero (their scale is 1 by convention: padding,
ignored targets) and how many were non-finite (an inf or NaN in the run: the consumer then computes
NaN, nothing is hidden). An operand without a finite nonzero run reports scales and bound 0.

A step is an optimizer step: with gradient accumulation the statistics combine every training call
(micro-batch) since the last optimizer step (largest and smallest scale over them, runs counted in
each; ``micro_batches`` says how many), so a bad micro-batch stays visible until the step that
applies its gradients; the first training call after an optimizer step (any ``torch.optim``
optimizer's, or ``weights_changed()``: nn/fp8/weights.py) starts afresh. Calls without autograd
(evaluation) record nothing. A forward recomputed by ``torch.utils.checkpoint`` records its
operands again with the same values: they replace its first pass's, counted once.

Off by default (a few reductions per operand and call, one of them over the operand's 1-byte
codes, to tell all-zero runs from runs whose scale is 1); ``LlamaBlock.track_fp8_stats()`` turns it
on. The summaries stay on the device until ``stats()`` reads them (which waits for the GPU: call it
for logging, not every step)."""

from __future__ import annotations

from typing import Any

import torch

from ...dtypes import FP8_MAX, as_dtype
from . import weights


# per operand: (largest scale, smallest scale, non-finite runs, all-zero runs) on the device, and how
# many calls they combine
Summary = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]


def _generation() -> int:
    """Moved by every optimizer step and weights_changed() (nn/fp8/weights.py): a step's boundary."""
    return weights._generation


def _combine(a: Summary | None, b: Summary) -> Summary:
    if a is None:
        return b
    return (torch.maximum(a[0], b[0]), torch.minimum(a[1], b[1]), a[2] + b[2], a[3] + b[3], a[4] + b[4])


class BlockScaleStats:
    def __init__(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn):
        self.fmax = float(FP8_MAX[as_dtype(fp8_dtype)])
        self._done: dict[str, Summary] = {}    # the step's earlier calls, and this call's gradients
        self._call: dict[str, Summary] = {}    # this call's forward operands (a recompute replaces them)
        self._order: list[str] = []            # operands as first recorded (stats() lists them so)
        self._generation = _generation()

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_last" in state:        # pickled before the statistics spanned a step: its last call
            state = {"fmax": state["fmax"], "_done": {k: (*v, 1) for k, v in state["_last"].items()},
                     "_call": {}, "_order": list(state["_last"]), "_generation": _generation()}
        self.__dict__.update(state)

    def _same_step(self) -> None:
        """Forget the previous optimizer step's statistics once the weights' generation moved."""
        now = _generation()
        if now != self._generation:
            self._done, self._call, self._generation = {}, {}, now

    def begin_call(self) -> None:
        """A training call (micro-batch) begins: the previous call's forward operands join the step's."""
        self._same_step()
        for name, summary in self._call.items():
            self._done[name] = _combine(self._done.get(name), summary)
        self._call = {}

    def record(self, name: str, scales: torch.Tensor, codes: torch.Tensor | None = None, *,
               forward: bool = False) -> None:
        """The row-major 1 x 128 scales of operand ``name`` (this call's), and its codes (which tell
        the all-zero runs; without them every finite run counts). ``forward``: an operand of the
        forward, which a checkpoint's recompute records again (it replaces this call's entry)."""
        self._same_step()
        s = scales.detach().float()
        finite = torch.isfinite(s)
        if codes is None:
            zero = torch.zeros_like(finite)
        else:           # a run is all zero when every code's magnitude bits are (e4m3 / e5m2: sign in bit 7)
            mag = codes.detach().contiguous().view(torch.uint8).reshape(*s.shape, -1) & 0x7F
            zero = mag.amax(-1) == 0
        counted = finite & ~zero
        summary = (torch.where(counted, s, 0.0).amax(), torch.where(counted, s, float("inf")).amin(),
                   (~finite).sum(), (finite & zero).sum(), 1)
        if name not in self._order:
            self._order.append(name)
        if forward:
            self._call[name] = summary
        else:
            self._done[name] = _combine(self._done.get(name), summary)

    def stats(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name in sorted({*self._done, *self._call}, key=self._order.index):
            big, small, bad, zero, calls = _combine(self._done.get(name), self._call[name]) \
                if name in self._call else self._done[name]
            hi, lo = float(big), float(small)
            lo = 0.0 if hi == 0.0 else lo          # no finite nonzero run
            out[name] = {"max_scale": hi, "min_scale": lo, "amax_bound": hi * self.fmax, "nonfinite_runs": int(bad),
                         "zero_runs": int(zero), "micro_batches": calls}
        return out
