"""Runs one compiler command and takes its whole process tree down with it (stdlib only: it is
started as a script, ``python -I -S supervise.py PARENT_PID -- CMD...``).

nvcc is a driver: it starts cicc, ptxas, fatbinary and the host compiler as children. Killing
nvcc alone leaves those running, and when the Python process that started the build is killed
outright (SIGKILL, OOM killer) nothing in it can clean up. So the builder starts this supervisor
in a session of its own; the supervisor puts the command in a new process group, asks the kernel
to send it SIGTERM when the builder dies (PR_SET_PDEATHSIG), and on SIGTERM/SIGINT/SIGHUP, or when
the command exits, kills that whole group. The command's group id stays reserved until the
supervisor reaps the command, so the kill can never reach an unrelated group.
"""

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str]) -> int:
    parent = int(argv[0])
    cmd = argv[2:] if argv[1:2] == ["--"] else argv[1:]
    state = {"child": None, "stop": False}

    def stop(signum: int, frame: object) -> None:
        state["stop"] = True
        if state["child"] is not None:
            _kill_group(state["child"].pid)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:      # the builder died before the request took effect
        return 128 + signal.SIGTERM
    try:
        state["child"] = child = subprocess.Popen(cmd, process_group=0)
    except OSError as e:
        print(f"coda-cutlass: cannot run {cmd[0]}: {e}", file=sys.stderr)
        return 127
    if state["stop"]:
        _kill_group(child.pid)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)   # exited, not yet reaped
    _kill_group(child.pid)          # whatever it left behind
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
