"""Content keys stay stable: the generated source and content key (build/keys.py, the key prebuilt
kernels are found by) of a committed set of programs, tests/data/source_keys.json: every catalogue
case, every library epilogue at the default and at every candidate config, the map kernels.

A refactor must not change them. A change that means to (new code in a kernel, an edited coda
header, a new generator version) invalidates prebuilt kernels and cached builds: regenerate the
file with ``python scripts/source_snapshot.py --keys tests/data/source_keys.json`` and say so in
the commit. New programs are reported but do not fail."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import source_snapshot  # noqa: E402

COMMITTED = ROOT / "tests" / "data" / "source_keys.json"


def test_content_keys_of_the_committed_programs_are_unchanged():
    want = json.loads(COMMITTED.read_text())
    got = source_snapshot.content_keys()
    missing = sorted(set(want) - set(got))
    changed = sorted(k for k in want if k in got and got[k] != want[k])
    new = sorted(set(got) - set(want))
    if new:
        warnings.warn(f"{len(new)} programs are not in {COMMITTED.name} yet: {new[:5]}")
    source_changed = [k for k in changed if got[k]["source"] != want[k]["source"]]
    assert not missing, f"programs that no longer generate a kernel: {missing}"
    assert not changed, (f"{len(changed)} content keys changed ({len(source_changed)} with a changed source, the "
                         f"others through included headers or the key's inputs), e.g. {changed[:5]}; if intended, "
                         "regenerate with: python scripts/source_snapshot.py --keys tests/data/source_keys.json")
