#!/usr/bin/env bash
# The tests: set up, then run the whole suite. GPU tests run on a Hopper GPU and skip elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -q tests "$@"
