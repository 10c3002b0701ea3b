"""Progress output and warnings of long work, on stderr and on the ``coda_cutlass`` logger.

Progress lines go to stderr unless verbose=False or CODA_CUTLASS_QUIET=1, and always to the
logger at INFO; warnings are Python warnings (RuntimeWarning, "coda-cutlass: ..."), and go to the
logger at WARNING too. The logger has only a NullHandler of its own: nothing is printed twice
unless you attach a handler (then set CODA_CUTLASS_QUIET=1 to have the progress lines only there).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import warnings

from ..env import env_flag

LOGGER = logging.getLogger("coda_cutlass")
LOGGER.addHandler(logging.NullHandler())


def enabled(verbose: bool | None) -> bool:
    if verbose is not None:
        return verbose
    return not env_flag("CODA_CUTLASS_QUIET", False)


_SAY = threading.Lock()


def say(message: str, verbose: bool | None = None) -> None:
    LOGGER.info(message)
    if enabled(verbose):
        # one write per line under a lock: parallel build threads printed "...prebuiltcoda-cutlass: ..."
        # when print()'s separate writes of the text and the newline interleaved
        with _SAY:
            sys.stderr.write(f"coda-cutlass: {message}\n")
            sys.stderr.flush()


def seconds_text(s: float) -> str:
    """A duration for a message: whole seconds, but a short one that is not whole keeps two
    digits (a timeout of 0.001 s must not read "0 s")."""
    return f"{s:.0f}" if s >= 9.5 or (s >= 1 and abs(s - round(s)) < 0.05) else f"{s:.2g}"


def warn(message: str, stacklevel: int = 2) -> None:
    """A RuntimeWarning "coda-cutlass: <message>" (``stacklevel`` as for warnings.warn, counted
    from the caller), also logged at WARNING."""
    LOGGER.warning(message)
    warnings.warn(f"coda-cutlass: {message}", RuntimeWarning, stacklevel=stacklevel + 1)


class Ticker:
    """Prints 'still compiling' lines every `every` seconds while a build runs."""

    def __init__(self, what: str, verbose: bool | None, every: float = 15.0):
        self.what = what
        self.verbose = enabled(verbose)
        self.every = every
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Ticker":
        if self.verbose:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            say(f"  ... still compiling {self.what} ({self.elapsed:.0f} s)")
