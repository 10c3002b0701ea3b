"""Running nvcc so that nothing outlives the build: under supervise.py, which kills nvcc's whole
process group (cicc, ptxas, the host compiler) when nvcc exits, times out, is interrupted, or
when this process dies, however it dies. Output is captured as bytes and decoded with
replacement characters (a log in another encoding must not turn a build error into a
UnicodeDecodeError).

nvcc writes its intermediates (tmpxft_<pid>_*.cudafe1.cpp, .ptx, .cubin) under $TMPDIR with
predictable names and reads them back: in a shared /tmp another user can pre-create them or
append to them mid-build. So nvcc and everything it starts get TMPDIR, TMP and TEMP pointing at a
folder of their own, 0700, inside the build folder (itself private), removed when the command
is over. nvcc 13 hands that path to its host compiler through ``sh -c`` inside double quotes, so a
path with ` $ " or \\ in it breaks every build (a backquote even runs a command): such a folder is
refused (shell_unsafe; the cache refuses such a root before building in it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import BuildError
from .files import PRIVATE_DIR, PRIVATE_FILE

SUPERVISOR = Path(__file__).resolve().parent / "supervise.py"
EXIT_NOT_FOUND = 127
PRIVATE_TMP = ".tmp"         # the compiler's temp folder, inside the build folder
TEMP_VARS = ("TMPDIR", "TMP", "TEMP")
SHELL_UNSAFE = {"`": "backquote", "$": "dollar sign", '"': "double quote", "\\": "backslash"}


def shell_unsafe(path: str | Path) -> str | None:
    """What in ``path`` nvcc's ``sh -c "..."`` would interpret ("` (backquote), ..."), or None."""
    found = [f"{c} ({name})" for c, name in SHELL_UNSAFE.items() if c in str(path)]
    return ", ".join(found) or None


@dataclass(frozen=True)
class Ran:
    returncode: int
    output: str          # stdout and stderr, interleaved as written
    timed_out: bool


def run(cmd: list[str], cwd: Path, timeout: float | None) -> Ran:
    """Run ``cmd`` in ``cwd`` (a private folder of the build) with its own temp folder there."""
    tmp = cwd / PRIVATE_TMP
    unsafe = shell_unsafe(tmp)
    if unsafe:
        raise BuildError(f"cannot run nvcc in {cwd}: the path contains {unsafe}, which nvcc passes through a "
                         "shell (sh -c) with its temp folder; use a cache folder without ` $ \" or \\")
    os.mkdir(tmp, PRIVATE_DIR)      # fails if anything is already there: never one made by someone else
    os.chmod(tmp, PRIVATE_DIR)
    try:
        return _run(cmd, cwd, timeout, {**os.environ, **{var: str(tmp) for var in TEMP_VARS}})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(cmd: list[str], cwd: Path, timeout: float | None, env: dict[str, str]) -> Ran:
    out_path = cwd / ".output"
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE)
    with os.fdopen(fd, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-I", "-S", str(SUPERVISOR), str(os.getpid()), "--", *cmd],
                                cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
    timed_out = False
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop(proc)
    except BaseException:
        _stop(proc)
        raise
    output = out_path.read_bytes().decode("utf-8", errors="replace")
    out_path.unlink()
    return Ran(proc.returncode, output, timed_out)


def _stop(proc: subprocess.Popen) -> None:
    """Ask the supervisor to kill the build's process group; kill it too if it does not exit."""
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
