"""Delayed per-tensor scaling (recipe "tensorwise"): the scales of the tensors one FP8 block quantises,
from a history of their amaxes, kept on the GPU (nothing waits for the host).

Each quantising kernel takes its tensor's scale as a ``cc.DeviceScalar`` and reports the tensor's
amax beside the codes. A training step's amaxes are recorded as they come and folded into the
history when the next training forward begins; the scales are then
``pow2_up(max(finite, positive history) * 2^margin / fp8_max)`` (or without the rounding,
``pow2=False``), one small batch of tensor ops per block and step. As in Transformer Engine, an inf,
NaN or zero amax stays in the history (``stats`` shows it) but makes no scale: where a history holds
no finite, positive amax the scale stays what it was, so one bad batch neither poisons nor freezes
the scales (the step that met it shows it in its own outputs).

A tensor without a finite, positive amax yet (its first step, after ``reset``, or after steps that
saw only zeros, e.g. the gradients of zero-initialised output projections) is quantised with a
current scale instead: its producing kernel runs once for the amax (codes discarded), then again with
the scale that amax gives, so no step quantises with a guessed scale (Transformer Engine starts from
scale 1, which flushes small gradients to zero). Later, a tensor that outgrows its history's range
saturates at fp8_max for that step (as in Transformer Engine) and its amax moves the next step's
scale. Forwards without autograd (evaluation, inference) use the scales as they are and record
nothing (``FrozenScales``).

With several data-parallel ranks (``Fp8Recipe.reduce_amax``, nn/fp8/amax_reduce.py) a step's
amaxes are reduced (MAX) over the ranks before they are folded, so every rank folds the same amaxes
and keeps the same histories, amaxes and scales: each rank sends a vector of one amax per tensor,
-1 where it recorded none (so the tensors folded are those any rank recorded; a tensor no rank
recorded gets 0 in its history, as in one process), and folds the result as one part per tensor.
Every rank must reduce as often as the others, whatever its batch: the collectives follow the
training backwards, which every rank runs alike (an empty batch's too; DDP and FSDP need it anyway),
never the forwards alone nor the amaxes recorded. A training forward opens the block's step
(``recording``); the end of the backward that follows closes it with the reduction
(``reduce_after_backward``: one collective for all the blocks of that backward), so the amaxes not
yet folded are the same on every rank by the time a checkpoint is taken (a later backward of the
step reduces again what it recorded). A step that begins with amaxes its predecessor left
unreduced (a forward without a backward, perhaps on one rank only, such as a validation loss with
autograd; the first of two forwards) folds what was reduced and sets those aside to join the
next backward's reduction, so that forward counts into the next step, where one process would fold
it as a step of its own. Such a forward on one rank
between the two backwards of a step (two forwards, then a backward each) folds the first backward's
reduction there alone: the second backward's reduction tells the other ranks (a flag beside each
block's amaxes), which fold it then, so the ranks' histories stay one. A checkpoint's recompute,
whose fold ends its own backward, reduces there, as every rank runs that backward. In one process,
or with ``reduce_amax=False``, nothing of this runs.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, Sequence

import torch

from ...dtypes import FP8_MAX, as_dtype
from ...errors import ConfigError
from .amax_reduce import at_backward_end, drop_failed_backwards, in_backward, max_over_ranks, ranks_reduce
from .compiled import on_device
from .recipe import Fp8Recipe

# a launch's amax: a tensor, or several, whose largest element is the amax (a 0-dim amax, a kernel's
# per-tile partials, the parts of a tensor several kernels made); finished in the step's fold
Amax = torch.Tensor | Sequence[torch.Tensor]
# a kernel launch given its tensor's scale -> (its outputs, the tensor's amax)
Launch = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], Amax]]


def _parts(a: Amax) -> list[torch.Tensor]:
    return [a] if isinstance(a, torch.Tensor) else list(a)


def amax_of(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 0-dim fp32 amax of a launch's parts (NaN if any is NaN)."""
    return torch.stack([p.float().amax() for p in parts]).amax()


def _maxes(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each part's largest element (0-dim fp32, NaN where it holds a NaN, as amax) in one multi-tensor
    launch on a GPU, so the compiled fold reduces scalars: given the parts themselves (per-tile
    partials of several shapes), its graph ran about 14 Triton reductions a block and step
    (twenty-seventh session's profile). The same values: a maximum is exact. Eagerly: torch.compile
    need not trace the multi-tensor op (a torch without it keeps the parts as they are)."""
    if not parts or not hasattr(torch, "_foreach_max"):
        return parts
    return list(torch._foreach_max([p.float() for p in parts]))


def _fold(history: torch.Tensor, amax: torch.Tensor, slot: torch.Tensor, fmax: torch.Tensor,
          parts: list[torch.Tensor], owners: tuple[int, ...], pow2: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's amaxes into the histories, and the amaxes and scales of the next step: ``parts[k]``
    belongs to tensor ``owners[k]`` (a tensor with none gets amax 0); ``slot`` is the (history,)
    one-hot mask of the column they go to; ``amax`` the amax behind each current scale
    (``_kept_amax``); ``fmax`` the formats' largest values over 2^margin (the same scales as the
    margin applied to the amax, and no int argument: compiled with dynamic shapes, an int would
    become a 64-bit kernel argument and widen the exponent arithmetic). One compiled graph on a GPU
    (compiled.py): elementwise ops and reductions over fixed shapes, nothing read on the host."""
    zero = history.new_zeros(())
    per: list[list[torch.Tensor]] = [[] for _ in range(history.shape[0])]
    for p, i in zip(parts, owners):
        per[i].append(p)
    col = torch.stack([amax_of(v) if v else zero for v in per])
    history = torch.where(slot, col[:, None], history)
    amax = _kept_amax(history, amax)
    return history, amax, tensor_scales(amax, fmax, 0, pow2)


def _folds(histories: list[torch.Tensor], amaxes: list[torch.Tensor], slots: list[torch.Tensor],
           fmaxes: list[torch.Tensor], parts: list[list[torch.Tensor]], owners: tuple[tuple[int, ...], ...]
           ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``_fold`` of several blocks' scales in one graph (begin_steps_together)."""
    return [_fold(*args) for args in zip(histories, amaxes, slots, fmaxes, parts, owners)]


def _kept_amax(history: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The amax behind each tensor's delayed scale: the largest finite, positive amax of its
    history; where there is none (every entry 0, inf or NaN) the previous ``amax`` stays, and with it
    the scale (0: no finite positive amax seen yet, the tensor still calibrates: DelayedScales.
    quantize). A non-finite or zero amax thus neither poisons nor freezes a scale."""
    seen = torch.where(torch.isfinite(history) & (history > 0), history, torch.zeros_like(history)).amax(1)
    return torch.where(seen > 0, seen, amax)


def tensor_scales(amax: torch.Tensor, fmax: torch.Tensor | float, margin: int, pow2: bool) -> torch.Tensor:
    """fp32 scales for amaxes: v = amax * 2^margin / fmax, rounded up to a power of two (>= 2^-126)
    with ``pow2``; 1 for amax 0, NaN for inf or NaN. At margin 0 the block scales' rule
    (quantization.scales_from_amax, tested equal); apart from it for the per-tensor fmax vector (a
    block's tensors mix formats) and the margin. The power of two comes from the exponents and
    mantissas alone, without the division (the same result: for amax = a * 2^e and fmax = f * 2^E,
    1 <= a, f < 2, it is 2^(e - E + margin), doubled when a > f), so a compiled graph
    (compiled.py) cannot round it differently from the eager one. ``fmax`` (over 2^margin, where the
    margin is folded into it) an FP8 format's largest value (>= 2^8) and a margin <= 8 (the recipes'
    bound) keep the power of two at most 2^128 (inf), which only an amax near fp32's largest gives.
    Without ``pow2`` the division is by a tensor of amax's shape and device, never by a Python float:
    CUDA divides a tensor by a host scalar as a multiplication by its fp32 reciprocal
    (BinaryDivTrueKernel.cu, "may lose one bit of precision"; 1 / 448 is inexact), the CPU divides, so
    the GPU's scales would differ from the CPU's (and from quantization.scales_from_amax) in the last
    bit."""
    amax = amax.float()
    f = fmax if isinstance(fmax, torch.Tensor) else torch.full_like(amax, fmax)
    if pow2:
        f = f.float().view(torch.int32)
        a = amax.view(torch.int32)
        up = ((a & 0x7FFFFF) > (f & 0x7FFFFF)).to(torch.int32)
        e = (((a >> 23) & 0xFF) - ((f >> 23) & 0xFF) + margin + up).clamp(min=-126)
        v = ((e + 127) << 23).view(torch.float32)
    else:
        v = amax * float(2 ** margin) / f
    ok = torch.isfinite(amax)
    return torch.where(ok, torch.where(amax == 0, torch.ones_like(v), v), torch.full_like(v, float("nan")))


class DelayedScales:
    """The amax histories and scales of one block's quantised tensors, by name; each name has its
    FP8 format (activation or gradient).

    On the device: ``_history`` (tensors, history) the amaxes as observed (0 where a tensor was not
    quantised, inf / NaN kept as they came), ``_amax`` (tensors,) the amax behind each delayed
    scale (0: none yet) and ``_scales``. On the host: ``_known``, the tensors the host knows to have
    a delayed scale (they skip the calibrating launch; learnt without waiting, ``_learn``)."""

    _folded_reduction = False      # (pickles of scales made before the attribute existed)

    def __init__(self, recipe: Fp8Recipe, formats: dict[str, torch.dtype]):
        self.recipe = recipe
        self.names = tuple(formats)
        self._index = {n: i for i, n in enumerate(self.names)}
        self._fmax = [float(FP8_MAX[as_dtype(formats[n])]) for n in self.names]
        self.formats = dict(formats)
        self._device: torch.device | None = None
        self.reset()

    def reset(self) -> None:
        """Forget every history (the next step quantises each tensor with its current amax)."""
        self._history: torch.Tensor | None = None      # (names, history) fp32
        self._amax: torch.Tensor | None = None         # (names,) fp32: the amax behind each scale, 0: none
        self._scales: torch.Tensor | None = None       # (names,) fp32
        self._filled = [False] * len(self.names)       # a history entry was recorded
        self._known = [False] * len(self.names)        # the host knows _amax > 0 (no calibrating launch)
        self._probe: Any = None                        # a GPU copy of _amax on its way to the host
        self._pending: dict[int, list[torch.Tensor]] = {}   # this step's amaxes (parts), not yet folded
        # reducing over ranks (amax_reduce): the step's amaxes may still differ from the other ranks'
        # (a training forward ran since the last reduction); after one, the (names,) reduced vector,
        # -1 where no rank recorded the tensor (_pending then holds every tensor's amax, one part each)
        self._unreduced = False
        self._reduced: torch.Tensor | None = None
        # a reduction this rank folded at a step it began outside a backward, none reduced since: the
        # other ranks may still hold it for a second backward of its step (reduce_after_backward)
        self._folded_reduction = False
        self._slot = 0
        self.steps = 0

    def __getstate__(self) -> dict[str, Any]:
        # copies and pickles keep the histories, scales and this step's amaxes (one per tensor: the
        # fold takes their largest anyway); the device-side helpers are made again on first use
        state = dict(self.__dict__)
        state["_pending"] = {i: [amax_of(a).detach()] for i, a in self._pending.items()}
        state["_probe"] = None
        state["_device"] = None
        for k in ("_fmax_t", "_slots"):
            state.pop(k, None)
        return state

    def _ensure(self, device: torch.device) -> None:
        if self._history is None:
            n = len(self.names)
            self._history = torch.zeros(n, self.recipe.history, dtype=torch.float32, device=device)
            self._amax = torch.zeros(n, dtype=torch.float32, device=device)
            self._scales = torch.ones(n, dtype=torch.float32, device=device)
            self._filled = [False] * n
            self._known = [False] * n
            self._pending.clear()
        elif self._device != device:         # the block moved (or was copied): its histories move with it
            self._history, self._amax, self._scales = (t.to(device) for t in (self._history, self._amax, self._scales))
            self._pending = {i: [amax_of(a).to(device)] for i, a in self._pending.items()}
            self._reduced = None if self._reduced is None else self._reduced.to(device)
            self._probe = None
        if self._device != device:
            self._device = device
            # fmax / 2^margin: the scales of amax * 2^margin / fmax (exact: a power of two)
            self._fmax_t = torch.tensor([f * 2.0 ** -self.recipe.margin for f in self._fmax], dtype=torch.float32,
                                        device=device)
            self._slots = torch.eye(self.recipe.history, dtype=torch.bool, device=device)   # one-hot columns

    def state(self) -> dict[str, Any]:
        """The histories as plain data (tensors on the CPU), for a checkpoint: ``load_state`` takes
        it back, so a resumed run continues with the same scales instead of calibrating again."""
        # The same entries and shapes at every step: a distributed checkpoint loads into the state
        # dict's structure as it stands (before the first step, or with other tensors pending), so
        # this step's amaxes are a tensor with a flag per tensor, not a dict of those pending.
        # Reducing over ranks, they are the same on every rank once the step's backward has reduced
        # them (a checkpoint taken between a training forward and its backward keeps one rank's).
        n = len(self.names)
        pending = torch.zeros(n)
        if self._pending:
            idx = sorted(self._pending)
            pending[idx] = torch.stack([amax_of(self._pending[i]) for i in idx]).cpu()
        flags = [i in self._pending for i in range(n)] if self._reduced is None else (self._reduced >= 0).tolist()
        common = {"names": list(self.names), "pending": pending, "pending_set": flags}
        if self._history is None:
            return {**common, "history": torch.zeros(n, self.recipe.history), "slot": 0, "amax": torch.zeros(n),
                    "filled": [False] * n, "steps": 0}
        return {**common, "history": self._history.cpu().clone(), "slot": self._slot, "amax": self._amax.cpu().clone(),
                "filled": list(self._filled), "steps": self.steps}

    def load_state(self, state: dict[str, Any]) -> None:
        """Take back what ``state`` returned (the same tensor names). A history of another length
        (a recipe with another ``history``) keeps its most recent entries; the scales are made for
        this recipe (formats, margin) from the amaxes."""
        if list(state.get("names", ())) != list(self.names):
            raise ConfigError(f"FP8 scale state: tensor names {state.get('names')} do not match this block's "
                              f"{list(self.names)}")
        history = state["history"]
        if history is not None and (history.dim() != 2 or history.shape[0] != len(self.names)
                                    or history.shape[1] < 1):
            raise ConfigError(f"FP8 scale state: history of shape {tuple(history.shape)}, expected "
                              f"({len(self.names)}, steps)")
        device = self._device
        self.reset()
        if history is None:
            return
        history = history.detach().to("cpu", torch.float32)
        old, length = history.shape[1], self.recipe.history
        kept = min(old, length)
        newest_first = [(int(state["slot"]) - 1 - k) % old for k in range(kept)]
        hist = torch.zeros(len(self.names), length, dtype=torch.float32)
        hist[:, :kept] = history[:, newest_first].flip(1)          # oldest kept first, the newest last
        before = state.get("amax")      # checkpoints before it kept no amax: every scale from the history
        before = torch.zeros(len(self.names)) if before is None else before.detach().to("cpu", torch.float32)
        amax = _kept_amax(hist, before)
        device = device or torch.device("cpu")
        self._history, self._amax = hist.to(device), amax.to(device)
        self._scales = torch.ones(len(self.names), dtype=torch.float32, device=device)
        self._device = None
        self._ensure(device)
        self._scales = self._scale_of(self._amax, self._fmax_t)
        self._slot, self.steps = kept % length, int(state["steps"])
        self._filled = [bool(f) for f in state["filled"]]
        self._known = [a > 0 for a in amax.tolist()]              # host values: no device read
        pending = state["pending"]
        if isinstance(pending, dict):       # checkpoints before the flags: {name: amax} of those pending
            self._pending = {self._index[n]: [torch.tensor(a, dtype=torch.float32, device=device)]
                             for n, a in pending.items()}
        else:
            amaxes = pending.detach().to(device=device, dtype=torch.float32, copy=True)
            self._pending = {i: [amaxes[i]] for i, on in enumerate(state["pending_set"]) if on}

    def _scale_of(self, amax: torch.Tensor, fmax: torch.Tensor) -> torch.Tensor:
        """Scales for amaxes; ``fmax`` already over 2^margin (self._fmax_t)."""
        return tensor_scales(amax, fmax, 0, self.recipe.pow2)

    def reduces(self) -> bool:
        """Whether the amaxes are reduced over ranks now (the recipe's ``reduce_amax`` in a world of
        several processes: amax_reduce.ranks_reduce)."""
        return ranks_reduce(self.recipe.reduce_amax)

    def recording(self, device: torch.device) -> None:
        """A training forward through the block (its step's first, or a checkpoint's recompute),
        empty batch or not, where the amaxes are reduced: the step's amaxes now differ between ranks
        until the backward's end reduces them (``reduce_after_backward``)."""
        self._ensure(device)
        self._unreduced = True

    def reduce_after_backward(self) -> None:
        """The block's backward is done (every rank runs it, empty batch or not): its step's amaxes
        are reduced over the ranks when the whole backward ends, with the other blocks' of that
        backward in one collective (amax_reduce.at_backward_end). A later backward of the same step
        (two forwards, then a backward each) recorded amaxes of this rank's own after that reduction:
        they are reduced again, with it (every rank alike: ``_reduced`` follows the reductions)."""
        if self._reduced is not None or self._folded_reduction:
            # a second backward of the step: its amaxes join the reduction; also on a rank that
            # folded the first backward's reduction already, at a forward that stopped before this
            # block (folds_together folds every block first), as the others still hold it
            self._unreduced = True
        if self._unreduced:
            at_backward_end(self, DelayedScales.reduce_together)

    @staticmethod
    def reduce_together(scales: list["DelayedScales"]) -> None:
        """The unreduced amaxes of these blocks' scales reduced over the ranks, in one collective (a
        device); every rank calls it alike (the same blocks, unreduced alike: the flag follows the
        training backwards, never the amaxes recorded). Nothing waits for the host, but where a
        second backward of a step ends (below)."""
        todo = list({id(sc): sc for sc in scales if sc._unreduced}.values())
        if not todo:
            return
        vecs = max_over_ranks([sc._local_amaxes() for sc in todo])
        # A block still holding an earlier reduction of its step unfolded (a second backward of the
        # step) learns whether another rank folded that reduction since, at a step it began alone (a
        # forward with autograd on that rank only, between the two backwards): it then folds it too,
        # before this reduction, as that rank did; else the ranks' histories part for good. The only
        # host read of the reduction (a sync on a GPU), and only where a second backward of a step
        # ends, one for all its blocks.
        holding = [k for k, sc in enumerate(todo) if sc._reduced is not None]
        folded = dict(zip(holding, torch.stack([vecs[k][-1] for k in holding]).gt(0).tolist())) if holding else {}
        for k, (sc, vec) in enumerate(zip(todo, vecs)):
            sc._take_reduced(vec[:-1], fold_first=folded.get(k, False))

    def _local_amaxes(self) -> torch.Tensor:
        """(names + 1,) fp32: each tensor's amax on this rank since the step's last reduction (all
        of the step before the first; NaN as it came), -1 where none, a launch or two (a tensor of
        one part takes its maximum as it is); then 1 where this rank holds no earlier reduction of
        the step unfolded, 0 where it does (``_reduced``). The earlier reduction itself is not sent:
        a rank that folded it at a step it began alone no longer holds it (``reduce_together``), and
        the ranks that do hold the same one, merged after the reduction (``_take_reduced``)."""
        _, parts, owners = self._fold_inputs(skip=int(self._reduced is not None))
        none = torch.full((), -1.0, dtype=torch.float32, device=self._device)
        per: list[list[torch.Tensor]] = [[] for _ in self.names]
        for p, i in zip(_maxes(parts), owners):
            per[i].append(p)
        vec = torch.stack([none if not v else v[0].float() if len(v) == 1 and v[0].dim() == 0 else amax_of(v)
                           for v in per])
        holds_none = torch.full((1,), float(self._reduced is None), dtype=torch.float32, device=self._device)
        return torch.cat([vec, holds_none])

    def _take_reduced(self, vec: torch.Tensor, fold_first: bool = False) -> None:
        """The amaxes recorded since the step's last reduction over every rank (``vec``: -1 where no
        rank recorded one), with that reduction's (if this rank holds it) as this step's, one part
        per tensor: a tensor no rank recorded gets 0, as the fold gives a tensor without parts.
        ``fold_first``: another rank folded the earlier reduction at a step it began alone, so this
        rank folds it now, as a step of its own as there, and the step's amaxes are ``vec``'s alone.
        The host's ``_filled`` learns only this rank's (it steers launches, never numbers)."""
        skip = int(self._reduced is not None)      # an earlier reduction's part leads each pending tensor's
        for i, v in self._pending.items():
            if len(v) > skip:
                self._filled[i] = True
        if self._reduced is not None:
            if fold_first:
                self._pending = self._reduced_parts()
                self._fold_pending()
            else:
                vec = torch.maximum(vec, self._reduced)
        self._reduced = vec
        amaxes = vec.clamp(min=0)
        self._pending = {i: [amaxes[i]] for i in range(len(self.names))}
        self._unreduced = self._folded_reduction = False

    def begin_step(self, device: torch.device) -> None:
        """Fold the previous step's amaxes into the histories and make this step's scales (a
        training forward calls it once; the backward uses the forward's scales). Where the ranks
        reduce, amaxes not yet reduced join the next reduction (``_set_aside_unreduced``), or, at a
        checkpoint's recompute, are reduced first."""
        self._ensure(device)
        aside = self._set_aside_unreduced()
        if self._unreduced:
            DelayedScales.reduce_together([self])
        self._fold_pending()
        self._take_back(aside)

    def _set_aside_unreduced(self) -> dict[int, list[torch.Tensor]] | None:
        """Where the ranks reduce and a training step begins outside any backward with amaxes
        recorded since the last reduction, those came from a forward whose backward has not ended (a
        forward without a backward, a first of two forwards, a backward that raised), and such a
        forward may have run on this rank alone (a validation loss with autograd on rank 0). So they
        are not reduced here, a collective the other ranks would not join: they are set aside, each
        tensor's as one part, to join the next backward's reduction, and only what the ranks reduced
        (if anything) folds now. Inside a backward (a checkpoint's recompute ending its step) every
        rank runs the same collectives: None, they are reduced there as they come."""
        if not self._unreduced or in_backward():
            return None
        drop_failed_backwards()
        skip = int(self._reduced is not None)      # an earlier reduction's part leads each tensor's
        aside = {i: [amax_of(v[skip:])] for i, v in self._pending.items() if len(v) > skip}
        self._pending = self._reduced_parts() if skip else {}
        self._unreduced = False
        return aside

    def _reduced_parts(self) -> dict[int, list[torch.Tensor]]:
        """The pending amaxes of the step's last reduction alone (each tensor's first part while
        ``_reduced`` is held), without this rank's own recorded since."""
        return {i: v[:1] for i, v in self._pending.items()}

    def _take_back(self, aside: dict[int, list[torch.Tensor]] | None) -> None:
        """The amaxes ``_set_aside_unreduced`` took, pending again (after the reduced part, if it did
        not fold), to be reduced when the next backward ends."""
        if aside is None:
            return
        for i, parts in aside.items():
            self._pending.setdefault(i, []).extend(parts)
        self._unreduced = True

    def _fold_pending(self) -> None:
        if not self._pending:
            return
        idx, parts, owners = self._fold_inputs()
        # every tensor's amax parts go to the device fold as their maxima, from one launch for all
        # (no index tensor from host values, whose copy would wait for the stream once per block and
        # step: a 16-layer "tensorwise" model was host-bound on it; no launch per tensor)
        parts = _maxes(parts)
        # pow2=False folds eagerly: a compiled division could round differently
        fold = (on_device(_fold, self._history, None, "FP8 scales: the amax fold") if self.recipe.pow2
                else partial(_fold, pow2=False))
        self._folded(idx, fold(self._history, self._amax, self._slots[self._slot], self._fmax_t, parts, owners))

    def _fold_inputs(self, skip: int = 0) -> tuple[list[int], list[torch.Tensor], tuple[int, ...]]:
        """(the tensors with amaxes this step, their parts, each part's tensor); ``skip``: leave out
        each tensor's first parts (1 after an earlier reduction of this step: its reduced amax, which
        ``_reduced`` holds with its -1s; the rest are this rank's own)."""
        idx = sorted(self._pending)
        return (idx, [p for i in idx for p in self._pending[i][skip:]],
                tuple(i for i in idx for _ in self._pending[i][skip:]))

    def _folded(self, idx: list[int], made: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """The fold's results in place, the step's bookkeeping done."""
        self._history, self._amax, self._scales = made
        self._slot = (self._slot + 1) % self.recipe.history
        if self._reduced is None:       # (reduced: this rank's were marked by _take_reduced)
            for i in idx:
                self._filled[i] = True
        else:
            self._folded_reduction = not in_backward()
        self._pending.clear()
        self._reduced = None
        self.steps += 1
        self._learn()

    @staticmethod
    def begin_steps_together(scales: list["DelayedScales"], device: torch.device) -> None:
        """``begin_step`` of several blocks' scales (a model's, before its first block), with one
        multi-tensor max over all their amax parts and one compiled fold: the same histories, amaxes
        and scales as a ``begin_step`` each (a launch and a compiled call a block), whose own calls
        then find nothing to fold. Recipes without power-of-two scales fold eagerly, one by one.
        Amaxes not yet reduced over the ranks are set aside for the next reduction, as there."""
        for sc in scales:
            sc._ensure(device)
        aside = [sc._set_aside_unreduced() for sc in scales]
        DelayedScales.reduce_together(scales)
        DelayedScales._fold_together(scales)
        for sc, parts in zip(scales, aside):
            sc._take_back(parts)

    @staticmethod
    def _fold_together(scales: list["DelayedScales"]) -> None:
        ready = [(sc, *sc._fold_inputs()) for sc in scales if sc._pending and sc.recipe.pow2]
        if not ready:
            return
        counts = [len(parts) for *_, parts, _ in ready]
        maxes = iter(_maxes([p for *_, parts, _ in ready for p in parts]))
        parts_of = [[next(maxes) for _ in range(n)] for n in counts]
        fold = on_device(_folds, ready[0][0]._history, None, "FP8 scales: several blocks' amax folds")
        made = fold([sc._history for sc, *_ in ready], [sc._amax for sc, *_ in ready],
                    [sc._slots[sc._slot] for sc, *_ in ready], [sc._fmax_t for sc, *_ in ready], parts_of,
                    tuple(owners for *_, owners in ready))
        for (sc, idx, _, _), out in zip(ready, made):
            sc._folded(idx, out)

    def _learn(self, start: bool = True) -> None:
        """Which tensors have a delayed scale, as far as the host can tell without waiting: on the
        CPU at once; on a GPU from a copy of the amaxes started at an earlier fold, once it has
        landed (polled, never waited for; ``start=False``: poll only, start no copy). Only launches
        depend on it: a tensor the host does not know about runs its calibrating launch, and the
        device still takes its delayed scale where it has one (quantize), so the numbers are the
        same either way. An amax never goes back to 0 (until reset), so what the host learnt stays
        true."""
        if all(k or not f for k, f in zip(self._known, self._filled)):
            return
        if self._amax.device.type != "cuda":
            self._known = [a > 0 for a in self._amax.tolist()]
            return
        if self._probe is not None:
            buf, landed = self._probe
            if not landed.query():
                return
            self._known = [k or a > 0 for k, a in zip(self._known, buf.tolist())]
            self._probe = None
            if all(k or not f for k, f in zip(self._known, self._filled)):
                return
        if not start:
            return
        buf = torch.empty(self._amax.shape, dtype=torch.float32, pin_memory=True)
        buf.copy_(self._amax, non_blocking=True)
        # the copy runs on the amaxes' device's current stream: the event goes there too, not on the
        # current device's (a block on another GPU than the current one would read the buffer early)
        landed = torch.cuda.Event()
        landed.record(torch.cuda.current_stream(self._amax.device))
        self._probe = (buf, landed)

    def scale(self, name: str) -> torch.Tensor:
        """The tensor's scale this step: a 0-dim fp32 device tensor."""
        return self._scales[self._index[name]]

    def quantize(self, name: str, launch: Launch, device: torch.device, record: bool = True
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Run ``launch`` with the tensor's scale and record its amax; a tensor without a delayed
        scale yet (no finite, positive amax seen) is launched first for the amax alone, then with
        the scale that amax gives. ``launch`` makes the whole tensor (all of its kernels, e.g. q, k
        and v's parts) and returns their largest amax. Returns (the outputs, the scale they were
        quantised with). ``device``: the tensor's. ``record=False`` (a forward without autograd:
        evaluation, inference): the current scales, nothing recorded, nothing changed."""
        self._ensure(device)
        i = self._index[name]
        scale = self.scale(name)
        if not self._known[i] and self._filled[i]:
            # the amax copy of an earlier fold may have landed since: only training forwards polled
            # it, so evaluation forwards after the first steps ran every calibrating launch (the
            # 8B block's no-grad forward took 6.7 ms against 3.7 of kernels, thirtieth session).
            # Poll only: a tensor seen only as zero would otherwise start a copy at every launch
            self._learn(start=False)
        if not self._known[i] and not (record and i in self._pending):
            _, amax = launch(torch.ones((), dtype=torch.float32, device=self._device))
            parts = [p for p in _parts(amax) if p.numel()]
            now = amax_of(parts).reshape(1) if parts else torch.zeros(1, dtype=torch.float32, device=self._device)
            # the delayed scale where the device has one (the host may not know yet: _learn)
            scale = torch.where(self._amax[i] > 0, scale, self._scale_of(now, self._fmax_t[i:i + 1])[0])
            if record:
                self._scales = self._scales.clone()          # a step's earlier launches keep their scales
                self._scales[i] = scale
        out, amax = launch(scale)
        if record:
            parts = [p for p in _parts(amax) if p.numel()]   # an empty batch has no amax
            if parts:
                self._pending.setdefault(i, []).extend(parts)
        return out, scale

    def frozen(self) -> "FrozenScales":
        """These scales for a forward that records nothing (``quantize(record=False)``)."""
        return FrozenScales(self)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tensor: the amax history (newest first, unfilled entries 0; the last step's amax joins
        it when the next forward begins, until then it is ``last_amax``), the scale the last step
        used, its FP8 format, whether it is calibrated (a finite, positive amax seen: its next step
        runs on a delayed scale) and whether the last step saturated it (its amax past scale *
        fp8_max, or NaN), as host values (this syncs: for logging, not for every step)."""
        if self._history is None:
            return {}
        order = [(self._slot - 1 - k) % self.recipe.history for k in range(self.recipe.history)]
        hist = self._history[:, order].tolist()
        scales = self._scales.tolist()
        known = self._amax.tolist()
        anywhere = None if self._reduced is None else (self._reduced >= 0).tolist()
        last = {i: float(amax_of(a)) for i, a in self._pending.items() if anywhere is None or anywhere[i]}

        def saturated(i: int) -> bool | None:     # the last step's values outgrew the scale it used
            # past fp8_max by more than rounding to it: a pow2=False scale is amax / fp8_max rounded to
            # fp32, so a steady amax lands a hair past scale * fp8_max with its code fp8_max all the same
            if i not in last:
                return None
            fmax = float(self._fmax[i])
            half_step = 2.0 ** math.floor(math.log2(fmax)) * torch.finfo(self.formats[self.names[i]]).eps / 2
            return not last[i] <= scales[i] * (fmax + half_step)

        def calibrated(i: int) -> bool:
            return known[i] > 0 or (i in last and math.isfinite(last[i]) and last[i] > 0)

        return {n: {"amax_history": hist[i], "last_amax": last.get(i), "scale": scales[i],
                    "format": str(self.formats[n]), "calibrated": calibrated(i),
                    "saturated": saturated(i)} for i, n in enumerate(self.names)}


class FrozenScales:
    """A block's delayed scales for a forward that records nothing (no grad: evaluation,
    inference): the scales as they are, a tensor without one calibrated for this call only."""

    def __init__(self, scales: DelayedScales):
        self.scales = scales

    def quantize(self, name: str, launch: Launch, device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return self.scales.quantize(name, launch, device, record=False)
