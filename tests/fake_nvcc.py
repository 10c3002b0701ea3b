#!/usr/bin/env python3
"""A stand-in for nvcc used by the cache tests: fast, observable, and able to fail on request.

--version prints $FAKE_NVCC_VERSION. A compile writes the source bytes to the -o file after
$FAKE_NVCC_SLEEP seconds and appends one line to $FAKE_NVCC_LOG; a source containing
FAKE_NVCC_FAIL makes it exit 1 with an error message.
"""
import os
import sys
import time

args = sys.argv[1:]
if "--version" in args:
    print("nvcc: NVIDIA (R) Cuda compiler driver")
    print(f"Cuda compilation tools, release 99.0, V{os.environ.get('FAKE_NVCC_VERSION', '99.0.1')}")
    sys.exit(0)
out = args[args.index("-o") + 1]
src = args[-1]
text = open(src).read()
time.sleep(float(os.environ.get("FAKE_NVCC_SLEEP", "0")))
if "FAKE_NVCC_FAIL" in text:
    print(f"{src}(1): error: identifier \"FAKE_NVCC_FAIL\" is undefined", file=sys.stderr)
    sys.exit(1)
with open(os.environ["FAKE_NVCC_LOG"], "a") as f:
    f.write(f"{os.getpid()} {len(text)}\n")
with open(out, "wb") as f:
    f.write(text.encode())
