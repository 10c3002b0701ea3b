# Sourced at the start of every device call (the device tool's run, carrying [".whl", ".ab4"]):
#   source scripts/device_env.sh > $OUT/env.txt || exit 1
# .whl (ignored): python3 -m pip download --no-deps -d .whl nvidia-cutlass==4.2.0.0 liger-kernel==0.8.5 torchao==0.18.0
# .ab4 (ignored): prebuilt kernels built on the build machine, so a device call compiles (almost) nothing:
#   CODA_CUTLASS_CACHE_DIR=/work/kcache python scripts/plan_prebuild.py --widths 1b 3b 8b --bf16 \
#       --fp8 tensorwise blockwise blockwise_g16 --gpu-tests          # 46 GEMM + 20 map kernels, ~17 min on 2 cores
#   CODA_CUTLASS_CACHE_DIR=/work/kcache python -m coda_cutlass cache --export /tmp/pb
#   tar -cf - -C /tmp/pb . | xz -6 > .ab4/prebuilt1.tar.xz                          # ~4 MB
# Neither folder survives a fresh checkout (the thirty-second session rebuilt both this way).
# .ab4/prebuilt2.tar.xz (35th session): the kernels of the 70B plans (--widths 70b --fp8 tensorwise blockwise_g16
# --bf16) and every 8B "tensorwise" tuning candidate (--widths 8b --fp8 tensorwise --candidates), built the same way
# with prebuilt1's kernels on CODA_CUTLASS_PREBUILT_PATH (only the missing ones built: 72 kernels, ~30 min on 2 cores).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1 || return 1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/prebuilt && for a in .ab4/prebuilt*.tar.xz; do [ -e "$a" ] && tar -xJf "$a" -C /tmp/prebuilt; done
export CODA_CUTLASS_PREBUILT_PATH=/tmp/prebuilt CODA_CUTLASS_CACHE_DIR=$PWD/.kcache
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
