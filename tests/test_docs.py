"""The documentation: every ``python`` block of docs/WRITING_EPILOGUES.md runs (in order, in one
namespace; on a CPU the GPU-only lines are skipped by the guide's own ``if on_hopper:``), and every
Markdown file the code, the scripts or the docs cite exists where the citation says."""

from __future__ import annotations

import logging
import os
import re
import textwrap
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "WRITING_EPILOGUES.md"
SKIP_DIRS = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", "results"}
SOURCE_SUFFIXES = (".py", ".sh", ".j2", ".hpp", ".cu", ".h", ".toml", ".cfg", ".cmake", ".txt")
CITATION = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[A-Z][A-Z0-9_]*\.md)\b")
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line number, code) of every ```python block."""
    blocks, lines = [], path.read_text().splitlines()
    start = None
    for i, line in enumerate(lines):
        if start is None and line.strip() == "```python":
            start = i + 1
        elif start is not None and line.strip() == "```":
            blocks.append((start + 1, "\n".join(lines[start:i])))
            start = None
    assert start is None, f"{path}: unterminated code block from line {start}"
    return blocks


def test_guide_examples_run():
    blocks = python_blocks(GUIDE)
    assert len(blocks) >= 8
    namespace: dict = {"__name__": "writing_epilogues_guide"}
    for line, code in blocks:
        # Compiled with the guide's line numbers, so a failure points into the Markdown file.
        exec(compile("\n" * (line - 1) + code, str(GUIDE), "exec"), namespace)
    assert namespace["on_hopper"] in (True, False)


@pytest.mark.parametrize("doc", ["README.md", "docs/NN.md", "docs/DISTRIBUTED.md", "docs/FP8.md"])
def test_readme_and_nn_examples_run(doc, tmp_path, monkeypatch):
    """Every python block of the README and the other docs runs (in order, one namespace per file;
    the GPU-only lines are skipped by the snippets' own checks). What a snippet changes in the
    process (environment variables, warning filters, the coda_cutlass logger) is put back."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    logger = logging.getLogger("coda_cutlass")
    handlers, level = list(logger.handlers), logger.level
    path = REPO / doc
    blocks = python_blocks(path)
    assert blocks
    namespace: dict = {"__name__": "doc_example"}
    try:
        with warnings.catch_warnings():
            for line, code in blocks:
                exec(compile("\n" * (line - 1) + textwrap.dedent(code), str(path), "exec"), namespace)
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
        from coda_cutlass.nn.fp8 import set_amax_group
        set_amax_group(None)        # DISTRIBUTED.md names a group of its world of one


def test_every_doc_with_python_blocks_is_run():
    run = {GUIDE, REPO / "README.md", REPO / "docs" / "NN.md", REPO / "docs" / "DISTRIBUTED.md", REPO / "docs" / "FP8.md"}
    with_code = {p for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")] if python_blocks(p)}
    assert with_code <= run, f"python blocks that no test runs: {sorted(str(p) for p in with_code - run)}"


def repo_files():
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info") and not d.startswith(".")]
        for f in files:
            yield Path(root) / f


def citations() -> list[tuple[Path, int, str, list[Path]]]:
    """(file, line, cited name, places it may be) for every *.md citation in code and docs."""
    out = []
    for path in repo_files():
        if path == Path(__file__).resolve():    # this file names the docs as data
            continue
        is_md = path.suffix == ".md"
        if not (is_md or path.suffix in SOURCE_SUFFIXES or path.name == "CMakeLists.txt"):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            links = set(LINK.findall(line)) if is_md else set()
            for name in links:      # a Markdown link is relative to its file
                out.append((path, n, name, [path.parent / name]))
            for name in set(CITATION.findall(line)) - links:
                # In code a citation is a path from the repository root (docs/NAME.md); in a
                # Markdown file, prose may also name a file beside it.
                out.append((path, n, name, [REPO / name] + ([path.parent / name] if is_md else [])))
    return out


def test_cited_docs_exist():
    found = citations()
    cited = {c[2] for c in found}
    assert {"docs/DESIGN.md", "docs/CUTLASS_EVT.md", "docs/GPU.md", "docs/TRANSFORMER_MATH.md"} <= cited, cited
    missing = [f"{p.relative_to(REPO)}:{n}: {name}" for p, n, name, places in found
               if not any(q.is_file() for q in places)]
    assert not missing, "cited but not there (cite docs as docs/NAME.md):\n" + "\n".join(missing)


def test_every_doc_is_linked_from_the_readme_or_another_doc():
    docs = {p.name for p in (REPO / "docs").glob("*.md")}
    linked = {Path(name).name for p, _, name, _ in citations() if p.suffix == ".md"}
    assert docs - linked == set()


@pytest.mark.parametrize("name", ["DESIGN.md", "CUTLASS_EVT.md", "GPU.md", "TRANSFORMER_MATH.md", "STYLE.md",
                                  "WRITING_EPILOGUES.md"])
def test_docs_are_there(name):
    assert (REPO / "docs" / name).stat().st_size > 1000


def test_the_guides_train_llama_commands_name_the_required_out_folder():
    """A `examples/train_llama.py --...` command quoted in the user guides runs as written: --out is
    required (NN.md and FP8.md quoted --fp8 commands without it; RESULTS.md's are records of runs)."""
    command = re.compile(r"`(?:python )?examples/train_llama\.py(\s[^`]*)`")
    bad = []
    for doc in ("README.md", "docs/NN.md", "docs/FP8.md"):
        text = (REPO / doc).read_text()
        for m in command.finditer(text):
            args = m.group(1).split()
            if args and "--out" not in args:
                bad.append(f"{doc}:{text.count(chr(10), 0, m.start()) + 1}: {' '.join(args)}")
    assert not bad, "train_llama.py commands without --out:\n" + "\n".join(bad)
