"""Lowering the IR to CUTLASS epilogue visitor graphs."""

from .evt import EvtGraph, TensorSlot, VisitorNode, lower

__all__ = ["EvtGraph", "TensorSlot", "VisitorNode", "lower"]
