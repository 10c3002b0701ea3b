"""Lowering the IR to CUTLASS epilogue visitor graphs (config-free), and planning a graph with a
kernel configuration."""

from .evt import lower
from .graph import EvtGraph, TensorSlot, VisitorNode
from .kinds import KINDS, NodeKind
from .plan import KernelPlan, default_config, plan

__all__ = ["EvtGraph", "TensorSlot", "VisitorNode", "lower", "KINDS", "NodeKind", "KernelPlan", "plan",
           "default_config"]
