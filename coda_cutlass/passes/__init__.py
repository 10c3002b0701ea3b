"""Passes over the IR, each a function Program -> Program, run in a fixed order."""

from __future__ import annotations

from typing import Any, Mapping

from ..dtypes import DType
from ..ir.nodes import Program
from .bind import bind_types
from .cse import eliminate_common_subexpressions
from .dce import eliminate_dead_code
from .validate import validate


def run_passes(program: Program, dtype: DType, operand_dtypes: Mapping[str, Any] | None = None,
               output_dtypes: Mapping[str, Any] | None = None) -> Program:
    """bind types -> validate -> CSE -> DCE -> validate again (the passes must keep it valid)."""
    p = bind_types(program, dtype, operand_dtypes, output_dtypes)
    p = validate(p)
    p = eliminate_common_subexpressions(p)
    p = eliminate_dead_code(p)
    return validate(p)


__all__ = ["run_passes", "bind_types", "validate", "eliminate_common_subexpressions", "eliminate_dead_code"]
