"""Builds, in one parallel wave, every kernel the GPU test suite and the pairwise benchmark need
that is not prebuilt or cached yet (used on the GPU machine before a test or benchmark run)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

import coda_cutlass as cc  # noqa: E402
from catalog import PREBUILD as CATALOG  # noqa: E402
from pairwise import PREBUILD as BENCH  # noqa: E402
from coda_cutlass.api import with_candidate_configs  # noqa: E402

items = list(CATALOG) + with_candidate_configs(BENCH)
cc.compile_many(items, jobs=int(sys.argv[1]) if len(sys.argv) > 1 else None, skip_failed=True)
