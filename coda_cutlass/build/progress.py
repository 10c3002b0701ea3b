"""Progress output for long builds (stderr; silence with verbose=False or CODA_CUTLASS_QUIET=1)."""

from __future__ import annotations

import sys
import threading
import time

from ..env import env_flag


def enabled(verbose: bool | None) -> bool:
    if verbose is not None:
        return verbose
    return not env_flag("CODA_CUTLASS_QUIET", False)


_SAY = threading.Lock()


def say(message: str, verbose: bool | None = None) -> None:
    if enabled(verbose):
        # one write per line under a lock: parallel build threads printed "...prebuiltcoda-cutlass: ..."
        # when print()'s separate writes of the text and the newline interleaved
        with _SAY:
            sys.stderr.write(f"coda-cutlass: {message}\n")
            sys.stderr.flush()


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
