#!/usr/bin/env python3
"""A stand-in for nvcc used by the cache tests: fast, observable, and able to misbehave on request.

--version prints $FAKE_NVCC_VERSION (and raw non-UTF-8 bytes if $FAKE_NVCC_BAD_BYTES is set). A
compile writes a minimal ELF shared-object header followed by the source bytes (and
$FAKE_NVCC_SALT) to the -o file after $FAKE_NVCC_SLEEP seconds, and appends one line to
$FAKE_NVCC_LOG. On request it misbehaves:
- a source containing FAKE_NVCC_FAIL, or $FAKE_NVCC_FAIL set: exit 1 with an error message;
- $FAKE_NVCC_BAD_BYTES: non-UTF-8 bytes in its output;
- $FAKE_NVCC_NOT_ELF: exit 0 but write a file that is not a shared library;
- with -Xptxas -v it prints a ptxas resource report on stderr as nvcc does: 168 registers and
  $FAKE_NVCC_SPILL bytes of spill stores and loads (default 0);
- $FAKE_NVCC_PIDS=FILE: start a child (as nvcc starts cicc) that sleeps, and write
  "<own pid> <child pid>" to FILE before sleeping;
- $FAKE_NVCC_ENV=FILE: write to FILE (JSON) the working folder, TMPDIR/TMP/TEMP and the owner and
  mode of the temp folder it got, and leave an intermediate there as nvcc does
  (tmpxft_<pid>_00000000-6_kernel.cudafe1.cpp).
"""
import json
import os
import tempfile
import subprocess
import sys
import time

ELF_HEADER = b"\x7fELF\x02\x01\x01" + bytes(9) + (3).to_bytes(2, "little")   # 64-bit LSB, ET_DYN


def payload(so) -> str:
    """What this fake compiled into a kernel.so (the text after its ELF header); for the tests."""
    with open(so, "rb") as f:
        data = f.read()
    assert data.startswith(ELF_HEADER), so
    return data[len(ELF_HEADER):].decode()


if __name__ == "__main__":
    args = sys.argv[1:]
    bad = os.environ.get("FAKE_NVCC_BAD_BYTES")
    if "--version" in args:
        print("nvcc: NVIDIA (R) Cuda compiler driver", flush=True)
        if bad:
            sys.stdout.buffer.write(b"Copyright \xa9 NVIDIA \xff\xfe\n")
        print(f"Cuda compilation tools, release 99.0, V{os.environ.get('FAKE_NVCC_VERSION', '99.0.1')}")
        sys.exit(0)
    out = args[args.index("-o") + 1]
    src = args[-1]
    text = open(src, encoding="utf-8").read()
    pids = os.environ.get("FAKE_NVCC_PIDS")
    if pids:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(pids, "w") as f:
            f.write(f"{os.getpid()} {child.pid}\n")
    seen = os.environ.get("FAKE_NVCC_ENV")
    if seen:
        tmp = tempfile.gettempdir()
        st = os.stat(tmp)
        intermediate = os.path.join(tmp, f"tmpxft_{os.getpid():08x}_00000000-6_kernel.cudafe1.cpp")
        with open(intermediate, "w") as f:
            f.write("// host code nvcc would compile next\n")
        with open(seen, "w") as f:
            json.dump({"cwd": os.getcwd(), "gettempdir": tmp, "mode": st.st_mode & 0o7777, "uid": st.st_uid,
                       "intermediate": intermediate,
                       **{v: os.environ.get(v) for v in ("TMPDIR", "TMP", "TEMP")}}, f)
    time.sleep(float(os.environ.get("FAKE_NVCC_SLEEP", "0")))
    if bad:
        sys.stderr.buffer.write(b"warning: caf\xe9 \xff\xfe in a Latin-1 locale\n")
        sys.stderr.flush()
    if "FAKE_NVCC_FAIL" in text or os.environ.get("FAKE_NVCC_FAIL"):
        print(f"{src}(1): error: identifier \"FAKE_NVCC_FAIL\" is undefined", file=sys.stderr)
        sys.exit(1)
    if "-Xptxas" in args and args[args.index("-Xptxas") + 1] == "-v":
        spill = int(os.environ.get("FAKE_NVCC_SPILL", "0"))
        print("ptxas info    : 11 bytes gmem\n"
              "ptxas info    : Compiling entry function '_Z6kernelv' for 'sm_90a'\n"
              "ptxas info    : Function properties for _Z6kernelv\n"
              f"    {spill and spill + 8} bytes stack frame, {spill} bytes spill stores, {spill} bytes spill loads\n"
              "ptxas info    : Used 168 registers, used 2 barriers", file=sys.stderr)
    with open(os.environ["FAKE_NVCC_LOG"], "a") as f:
        f.write(f"{os.getpid()} {len(text)}\n")
    with open(out, "wb") as f:
        if os.environ.get("FAKE_NVCC_NOT_ELF"):
            f.write(b"<html>not a library</html>\n")
        else:
            f.write(ELF_HEADER + text.encode() + os.environ.get("FAKE_NVCC_SALT", "").encode())
