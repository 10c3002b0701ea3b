"""Reading coda-cutlass's environment variables: one parser per kind of value, so every variable
accepts the same spellings and a typo is an error that names the variable, never a silent default.

Booleans: 1/0, true/false, yes/no, on/off (any case, surrounding spaces ignored); unset or empty
means the default. Durations: seconds as a number; 0 (or none/off) means no limit.
"""

from __future__ import annotations

import math
import os

from .errors import ConfigError

_TRUE = frozenset({"1", "true", "yes", "on", "y", "t"})
_FALSE = frozenset({"0", "false", "no", "off", "n", "f"})
_NO_LIMIT = frozenset({"0", "none", "off", "inf", "infinity"})


def env_flag(name: str, default: bool) -> bool:
    """A boolean variable (CODA_CUTLASS_AUTOTUNE, CODA_CUTLASS_QUIET, ...)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    word = raw.lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean: use 1/0, true/false, yes/no or on/off")


def env_seconds(name: str, default: float | None) -> float | None:
    """A duration in seconds; None means no limit."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    return seconds(raw, name)


def seconds(value: object, what: str) -> float | None:
    """A timeout given as an argument or a variable: a positive number of seconds, or 0/None for no
    limit."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in _NO_LIMIT:
        return None
    try:
        s = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{what}={value!r} is not a number of seconds (0 or none: no limit)") from None
    if math.isnan(s) or s < 0:
        raise ConfigError(f"{what}={value!r} must be a positive number of seconds (0 or none: no limit)")
    return None if s == 0 or math.isinf(s) else s
