"""How each recipe's block runs: its forward and backward functions with the per-block state they
need (the weights' FP8 copies; for per-tensor scaling the amax histories too), and how an operand
made under the other recipe is taken in (a model whose blocks mix recipes)."""

from __future__ import annotations

from typing import Any

import torch

from ...quantization import dequantize_blocks
from . import functional as blockwise
from .block_stats import BlockScaleStats
from . import tensorwise
from .delayed import DelayedScales
from .weights import Fp8Weights


class Path:
    """A recipe's block: ``forward`` -> (x2, h2, r2, saved), ``backward`` -> (dx, its FP8 copy, grads).
    ``wq``: where the weights' FP8 copies come from (the cache ``self.weights``, or the copies a
    forward used, for its backward: weights.PinnedWeights); ``record=False``: a call that changes no
    scale state (a forward without autograd: evaluation, inference; an empty batch). ``next_fp8``:
    h2 goes to the next block in FP8 (support.hands_fp8: True, or the next block's blockwise recipe),
    else in bf16."""

    _tracking = False

    def __init__(self, weights: Fp8Weights):
        self.weights = weights

    def forward(self, step: Any, x: torch.Tensor, h: Any, r: torch.Tensor, w: Any, g_next: Any,
                next_fp8: Any, *, wq: Any = None, record: bool = True) -> tuple:
        raise NotImplementedError

    def backward(self, step: Any, saved: tuple, w: Any, dx2: torch.Tensor, dx2q: Any, *, wq: Any = None,
                 record: bool = True) -> tuple:
        raise NotImplementedError

    def quantize_input(self, step: Any, h: Any, *, record: bool = True) -> Any:
        """The block's first operand h: as it comes when this recipe made it, else quantised here."""
        raise NotImplementedError

    def _wq(self, wq: Any) -> Any:
        return self.weights if wq is None else wq

    def begin_step(self, device: torch.device) -> None:
        """A training forward begins (the delayed scales move on)."""

    def reduces_amax(self) -> bool:
        """Whether the ranks reduce this block's amaxes together (per-tensor scaling, reduce_amax, a
        world of several processes: nn/fp8/amax_reduce.py); then every training forward and backward
        tells the scales (``recording``, ``backward_done``), whatever the batch."""
        return False

    def recording(self, device: torch.device) -> None:
        """A training forward runs through the block, where ``reduces_amax``."""

    def backward_done(self) -> None:
        """The block's backward of a training forward is done."""

    def track_stats(self, on: bool) -> None:
        """Keep per-step scale statistics while ``on`` (blockwise; per-tensor scaling keeps its amax
        histories anyway)."""
        self._tracking = on

    @property
    def tracking(self) -> bool:
        """``track_stats(True)`` is on (a block keeps it across a change of recipe: LlamaBlock.fp8)."""
        return self._tracking

    def stats(self) -> dict[str, Any]:
        """What LlamaBlock.fp8_stats returns (empty where nothing is kept)."""
        return {}


def _bf16(h: Any, dtype: torch.dtype) -> torch.Tensor:
    """An operand of either recipe (or a 16-bit tensor) back in ``dtype``."""
    if isinstance(h, torch.Tensor):
        return h
    if isinstance(h, blockwise.Fp8Operand):
        return dequantize_blocks(h.q, h.s).to(dtype)
    return (h.q.float() * h.s).to(dtype)


def _in_format(op: Any, fmt: torch.dtype) -> bool:
    """A per-tensor operand whose codes are in ``fmt`` (a block reads a neighbour's only then)."""
    return isinstance(op, tensorwise.TensorOperand) and op.qt.dtype == fmt


class BlockwisePath(Path):
    scale_stats: BlockScaleStats | None = None      # while LlamaBlock.track_fp8_stats() is on

    def _stats(self, record: bool) -> BlockScaleStats | None:
        # only training calls are a step's: an evaluation forward (or an empty batch) records nothing
        return self.scale_stats if record else None

    def forward(self, step, x, h, r, w, g_next, next_fp8, *, wq=None, record=True):
        return blockwise.block_forward_fp8(step, x, h, r, w, self._wq(wq), g_next, next_fp8,
                                           stats=self._stats(record))

    def backward(self, step, saved, w, dx2, dx2q, *, wq=None, record=True):
        # gradients travel in 1 x 128 runs (group 1) under every blockwise recipe
        q = dx2q if isinstance(dx2q, blockwise.Fp8Operand) and dx2q.group == 1 else None
        return blockwise.block_backward_fp8(step, saved, w, self._wq(wq), dx2, q, stats=self._stats(record))

    def begin_step(self, device):
        if self.scale_stats is not None:
            self.scale_stats.begin_call()

    def track_stats(self, on):
        self.scale_stats = BlockScaleStats() if on else None

    @property
    def tracking(self):
        return self.scale_stats is not None

    def stats(self):
        return {} if self.scale_stats is None else self.scale_stats.stats()

    def quantize_input(self, step, h, *, record=True):
        if isinstance(h, blockwise.Fp8Operand) and h.group == step.fp8.wgrad_group:
            return h
        return blockwise.quantize_operand(step, "h.quant", _bf16(h, step.dtype or torch.bfloat16), activation=True)


class TensorwisePath(Path):
    def __init__(self, weights: Fp8Weights, scales: DelayedScales):
        super().__init__(weights)
        self.scales = scales

    def forward(self, step, x, h, r, w, g_next, next_fp8, *, wq=None, record=True):
        return tensorwise.block_forward(step, x, h, r, w, self._wq(wq), self._scales(record), g_next, next_fp8)

    def backward(self, step, saved, w, dx2, dx2q, *, wq=None, record=True):
        if not _in_format(dx2q, step.fp8.gradient):     # another recipe's (or format's): quantised here
            dx2q = None
        return tensorwise.block_backward(step, saved, w, self._wq(wq), self._scales(record), dx2, dx2q)

    def _scales(self, record: bool) -> Any:
        return self.scales if record else self.scales.frozen()

    def begin_step(self, device):
        self.scales.begin_step(device)

    def reduces_amax(self):
        return self.scales.reduces()

    def recording(self, device):
        self.scales.recording(device)

    def backward_done(self):
        self.scales.reduce_after_backward()

    def stats(self):
        return self.scales.stats()

    def quantize_input(self, step, h, *, record=True):
        if _in_format(h, step.fp8.activation):
            return h
        h = _bf16(h, step.dtype or torch.bfloat16)
        return tensorwise.quantize_map(step, self._scales(record), "h", "h.quant", h)
