"""Where the package's non-Python files live, in a source checkout and in an installed wheel."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def templates_dir() -> Path:
    """The Jinja templates and C++ headers: ``coda_cutlass/templates`` in a wheel (setup.py maps the
    repository's top-level ``templates/`` there), ``templates/`` beside the package in a checkout."""
    for candidate in (_PKG / "templates", _PKG.parent / "templates"):
        if (candidate / "kernel.cu.j2").is_file():
            return candidate
    raise FileNotFoundError(f"coda-cutlass templates not found next to {_PKG}")


def include_dir() -> Path:
    """The directory holding ``coda/*.hpp`` (passed to nvcc with -I)."""
    return templates_dir()
