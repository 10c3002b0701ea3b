#!/usr/bin/env bash
# The main job: set up, then trace, validate, generate, compile and check a fused kernel
# (on a Hopper GPU also run and time it). See README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m coda_cutlass demo "$@"
