"""Errors raised at the library's boundary.

Every rejection says what is wrong and where: the epilogue program and IR node for program errors,
the argument for call errors, the generated `.cu` and the nvcc log for build failures.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable, Iterable, Sequence, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])


class CodaError(Exception):
    """Base class of every error coda-cutlass raises on purpose."""


class EpilogueError(CodaError):
    """An epilogue program cannot be compiled: unsupported op, bad output, misuse of a value."""

    def __init__(self, reason: str, *, program: str | None = None, node: str | None = None):
        self.reason = reason
        self.program = program
        self.node = node
        where = []
        if program:
            where.append(f"epilogue '{program}'")
        if node:
            where.append(f"node {node}")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {reason}" if prefix else reason)


class ConfigError(CodaError):
    """A kernel configuration (tile, cluster, schedule, dtypes, layouts) is not supported."""


class ArgumentError(CodaError, TypeError):
    """An option of the wrong kind (a config that is not a KernelConfig, a weight layout that is not
    a string, options that do not exist): a TypeError, as Python's own for a bad argument."""


class CallError(CodaError, ValueError):
    """A compiled kernel was called with arguments it cannot run on (checked before any launch)."""


class ToolchainError(CodaError):
    """nvcc or the CUTLASS headers are missing or unusable."""


class BuildError(CodaError):
    """nvcc failed. Carries the paths of the generated source and of the compiler log."""

    def __init__(self, message: str, *, source_path: str | None = None, log_path: str | None = None,
                 log_tail: str = ""):
        self.source_path = source_path
        self.log_path = log_path
        self.log_tail = log_tail
        parts = [message]
        if source_path:
            parts.append(f"  source: {source_path}")
        if log_path:
            parts.append(f"  nvcc log: {log_path}")
        if log_tail:
            parts.append("  last lines of the log:\n" + "\n".join("    " + l for l in log_tail.splitlines()))
        super().__init__("\n".join(parts))


class DeviceError(CodaError, RuntimeError):
    """No usable GPU (none present, not sm_90), or the kernel reported a launch failure."""


def check_options(given: Iterable[str], known: Sequence[str], call: str = "") -> None:
    """Keyword options not in ``known`` -> ArgumentError naming them and the closest known names
    (Python's own TypeError for an unexpected keyword suggests nothing)."""
    unknown = sorted(set(given) - set(known))
    if not unknown:
        return
    close = [c for u in unknown for c in difflib.get_close_matches(u, known, n=1)]
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else f"; known: {', '.join(known)}"
    raise ArgumentError(f"{call + ': ' if call else ''}unknown options {unknown}{hint}")


def checked_options(fn: F) -> F:
    """A public ``cc.<fn>`` whose misspelt keyword options raise check_options' error."""
    known = tuple(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        check_options(kwargs, known, f"cc.{fn.__name__}")
        return fn(*args, **kwargs)
    return cast(F, checked)
