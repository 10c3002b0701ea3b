"""Small torch functions of the FP8 recipes (weight copies, the delayed scales' amax fold) run as one
torch.compile graph on a GPU, so each is one or a few fused kernels instead of a launch per tensor op;
elsewhere (the CPU tests, the reference path) they run eagerly, with the same results: they use
integer and comparison ops only where rounding could differ (no division, nothing to reorder)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...build.progress import say

_COMPILED: dict[tuple[Callable[..., Any], Any], Callable[..., Any]] = {}


def on_device(fn: Callable[..., Any], t: torch.Tensor, key: Any, what: str) -> Callable[..., Any]:
    """``fn`` compiled (once per function and ``key``; shapes dynamic: one graph serves every size)
    when ``t`` is on a GPU; ``fn`` itself elsewhere. ``what`` names it in the one-time notice. Should
    compiling fail (a torch or Triton that cannot build the graph), ``fn`` runs eagerly from then on,
    with a notice: the same results, more launches."""
    if not t.is_cuda:
        return fn
    k = (fn, key)
    if k not in _COMPILED:
        say(f"{what} is compiled by torch.compile on its first call, once per process (seconds)")
        _COMPILED[k] = _or_eager(torch.compile(fn, fullgraph=True, dynamic=True), fn, k, what)
    return _COMPILED[k]


def _or_eager(compiled: Callable[..., Any], fn: Callable[..., Any], k: Any, what: str) -> Callable[..., Any]:
    failed = False

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal failed
        if not failed:
            try:
                return compiled(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - any compiler failure: the eager function is the same math
                say(f"{what}: torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                    "running it eagerly from now on")
                failed, _COMPILED[k] = True, fn
        return fn(*args, **kwargs)
    return call
