"""What a block's autograd.Function saves for its backward: ``save_for_backward`` takes tensors, the
block's saved state is nested tuples (the attention context among them), so it is split into its
tensor leaves and the structure that puts them back."""

from __future__ import annotations

from typing import Any

import torch


class _Kept:
    """A leaf of the saved structure that is not a tensor: kept on the ctx as it is."""
    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def flatten(obj: Any, tensors: list[Any]) -> Any:
    """Nested tuples -> their tensor (or None) leaves appended to ``tensors``, and the structure
    (None where a tensor was)."""
    if isinstance(obj, tuple):
        return tuple(flatten(o, tensors) for o in obj)
    if obj is None or isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return None
    return _Kept(obj)


def unflatten(spec: Any, tensors: Any) -> Any:
    if spec is None:
        return next(tensors)
    if isinstance(spec, _Kept):
        return spec.value
    return tuple(unflatten(s, tensors) for s in spec)
