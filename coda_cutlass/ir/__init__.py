"""The epilogue IR: nodes, the op table and the printer."""

from .nodes import Kind, Node, Operand, Program, make_attrs, renumber
from .ops import OPS, OpDef, opdef
from .printer import format_program, node_line

__all__ = ["Kind", "Node", "Operand", "Program", "make_attrs", "renumber", "OPS", "OpDef", "opdef",
           "format_program", "node_line"]
