"""Rendering the lowered epilogue into CUDA C++ through the Jinja templates."""

from .cuda import render_kernel

__all__ = ["render_kernel"]
