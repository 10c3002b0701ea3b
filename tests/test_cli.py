"""The command line: emit, prebuild (sources only and with a fake nvcc), cache export, and the
demo's CPU path."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import coda_cutlass as cc

from coda_cutlass.cli import main, parser

HERE = Path(__file__).resolve().parent


def test_emit_prints_the_kernel(capsys):
    assert main(["emit", str(HERE / "catalog.py") + ":residual_norm_stats"]) == 0
    out = capsys.readouterr().out
    assert "coda-cutlass generated kernel: residual_norm_stats" in out and "coda_run" in out


def test_emit_unknown_program(capsys):
    assert main(["emit", str(HERE / "catalog.py") + ":nope"]) == 2
    assert "no program 'nope'" in capsys.readouterr().err


def library_programs() -> int:
    import coda_cutlass.epilogues as lib
    return sum(isinstance(getattr(lib, n), cc.EpilogueProgram) for n in lib.__all__)


def test_prebuild_sources_only(tmp_path, capsys):
    assert main(["prebuild", "coda_cutlass.epilogues", "--sources-only", "--out", str(tmp_path)]) == 0
    cus = list(tmp_path.glob("*.cu"))
    assert len(cus) == library_programs() and (tmp_path / "include" / "coda" / "functors.hpp").is_file()


def test_help_prints_plain_literals_and_jobs_must_be_positive(tmp_path, capsys):
    """--help showed the docstring's reST ``literals``; --jobs 0 was taken (and ignored with
    --sources-only)."""
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["prebuild", "coda_cutlass.epilogues", "--sources-only", "--jobs", "0", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--jobs: must be at least 1, got 0" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_every_argument_of_every_command_has_help():
    """prebuild's FILE and --out and emit's FILE:PROGRAM printed no help at all, and cache's
    --help did not say which folder it shows."""
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        for action in command._actions:
            if action.help != argparse.SUPPRESS:
                assert action.help, f"{name} {action.dest}: no help text"
    assert "CODA_CUTLASS_CACHE_DIR" in sub.choices["cache"].format_help()


def test_prebuild_and_cache_export(fake_nvcc, tmp_path, capsys):
    out = tmp_path / "pre"
    assert main(["prebuild", "coda_cutlass.epilogues", "--out", str(out)]) == 0
    metas = [json.loads(p.read_text()) for p in out.glob("*.json")]
    n = library_programs()
    assert len(metas) == n and all(m["so_sha256"] for m in metas)
    exported = tmp_path / "exported"
    assert main(["cache", "--export", str(exported)]) == 0
    assert len(list(exported.glob("*.so"))) == n
    assert f"kernels: {n}" in capsys.readouterr().out


def test_demo_runs_on_cpu(fake_nvcc, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("with a GPU the demo runs the real kernel (tests/gpu covers it)")
    assert main(["demo"]) == 0
    text = capsys.readouterr().out
    assert "-> OK" in text and "no Hopper GPU here" in text and "all checks passed" in text


# Errors a user can make: one line on stderr, status 2, no traceback.

USER_FILE = '''
import coda_cutlass as cc

@cc.epilogue
def scaled(acc, s: cc.Scalar):
    return acc * s

@cc.epilogue
def uses_missing_name(acc):
    return acc + not_defined_anywhere

@cc.epilogue
def branches(acc):
    if acc > 0:
        return acc
    return -acc
'''


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def math_py(tmp_path):
    """A user file named math.py, as a user might call it."""
    path = tmp_path / "math.py"
    path.write_text(USER_FILE)
    return path


def test_user_file_named_math_py_does_not_shadow_math(math_py, capsys, monkeypatch):
    import math
    import sys
    monkeypatch.setattr(sys, "path", list(sys.path))
    real = sys.modules["math"]
    assert main(["emit", f"{math_py}:scaled"]) == 0
    assert "coda-cutlass generated kernel: scaled" in capsys.readouterr().out
    assert sys.modules["math"] is real and math.gcd(12, 18) == 6
    loaded_as = [n for n, m in sys.modules.items() if getattr(m, "__file__", None) == str(math_py)]
    assert len(loaded_as) == 1 and loaded_as[0].startswith("_coda_cutlass_user_math_")
    assert sys.path[-1] == str(math_py.parent)      # siblings importable, searched after everything else


@pytest.mark.parametrize("argv, expect", [
    (["emit", "no/such/file.py:f"], "no such file: no/such/file.py"),
    (["emit", "no_such_module_xyz:f"], "no such file or module: no_such_module_xyz"),
    (["emit", "coda_cutlass.epilogues"], "expected FILE:PROGRAM"),
    (["emit", "coda_cutlass.epilogues:swiglu_bakward"], "did you mean 'swiglu_backward'"),
    (["prebuild", "missing.py", "--out", "x"], "no such file: missing.py"),
])
def test_bad_paths_and_names_are_one_line(argv, expect, capsys):
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert line.startswith("error: ") and expect in line, line


def test_misspelt_command_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["emti", "x"])
    assert e.value.code == 2
    line = one_error_line(capsys)
    assert "invalid choice: 'emti'" in line and "did you mean 'emit'?" in line


def test_rejected_program_is_one_line_with_its_location(math_py, capsys):
    assert main(["emit", f"{math_py}:branches"]) == 2
    line = one_error_line(capsys)
    assert "epilogue 'branches'" in line and "cc.where" in line and f"{math_py}:" in line


def test_error_in_user_code_names_the_line(math_py, capsys):
    assert main(["emit", f"{math_py}:uses_missing_name"]) == 2
    line = one_error_line(capsys)
    assert "NameError" in line and "not_defined_anywhere" in line and f"{math_py}:10" in line


def test_file_that_fails_to_load(tmp_path, capsys):
    (tmp_path / "syntax.py").write_text("def f(:\n")
    (tmp_path / "dep.py").write_text("import a_module_nobody_has\n")
    assert main(["emit", f"{tmp_path / 'syntax.py'}:f"]) == 2
    assert "SyntaxError" in one_error_line(capsys)
    assert main(["emit", f"{tmp_path / 'dep.py'}:f"]) == 2
    assert "No module named 'a_module_nobody_has'" in one_error_line(capsys)


def test_bad_prebuild_list(tmp_path, capsys):
    (tmp_path / "pre.py").write_text("import coda_cutlass.epilogues as e\nPREBUILD = [(e.identity, {'dtyp': 1})]\n")
    assert main(["prebuild", str(tmp_path / "pre.py"), "--out", str(tmp_path / "o")]) == 2
    assert "unknown options ['dtyp']" in one_error_line(capsys)


@pytest.mark.parametrize("options,says", [
    ("{'config': 'fast'}", "config must be a KernelConfig"), ("{'config': 'tune'}", "config must be a KernelConfig"),
    ("{'weight_layout': 3}", "weight_layout must be 'nk' or 'kn'"), ("{'input_dtypes': 5}", "input_dtypes must be a dict")])
@pytest.mark.parametrize("command", ["prebuild", "emit"])
def test_a_bad_option_value_in_prebuild_is_one_line_naming_the_entry(tmp_path, capsys, options, says, command):
    (tmp_path / "pre.py").write_text("import coda_cutlass.epilogues as e\n"
                                     f"PREBUILD = [(e.identity, {{}}), (e.bias_relu, {options})]\n")
    args = [str(tmp_path / "pre.py"), "--out", str(tmp_path / "o"), "--sources-only"] if command == "prebuild" \
        else [f"{tmp_path / 'pre.py'}:bias_relu"]
    assert main([command, *args]) == 2
    line = one_error_line(capsys)
    assert "PREBUILD[1] (bias_relu): " in line and says in line, line


@pytest.mark.parametrize("kernels", [0, 1])
def test_cache_export_to_a_folder_that_cannot_be_made_is_one_line(fake_nvcc, tmp_path, capsys, kernels):
    if kernels:
        assert main(["prebuild", str(HERE / "catalog.py"), "--out", str(tmp_path / "pb")]) == 0
    capsys.readouterr()
    assert main(["cache", "--export", "/proc/coda-cutlass-test/out"]) == 2   # no one, root included, makes it
    line = one_error_line(capsys)
    assert line.startswith("error: --export ") and "cannot write there" in line and "Errno" not in line, line


def test_debug_shows_the_traceback(math_py, capsys, monkeypatch):
    assert main(["emit", f"{math_py}:branches", "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("CODA_CUTLASS_DEBUG", "1")
    assert main(["emit", f"{math_py}:branches"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_a_bug_in_coda_cutlass_keeps_its_traceback(monkeypatch):
    import coda_cutlass.api
    monkeypatch.setattr(coda_cutlass.api, "emit", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        main(["emit", "coda_cutlass.epilogues:identity"])


def test_missing_toolchain_is_reported_without_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CODA_CUTLASS_NVCC", str(tmp_path / "no-nvcc"))
    monkeypatch.setenv("CODA_CUTLASS_PREBUILT_PATH", str(tmp_path / "prebuilt"))
    monkeypatch.setenv("CODA_CUTLASS_QUIET", "1")
    assert main(["prebuild", "coda_cutlass.epilogues", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot build epilogue kernel") and "Traceback" not in err
    assert str(tmp_path / "prebuilt") in err        # the error's own lines: where it looked


def test_python_m_reports_without_traceback(tmp_path):
    """The real entry point, in a folder that is not the repository."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "coda_cutlass", "emit", "nowhere.py:f"], capture_output=True,
                       text=True, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == "error: no such file: nowhere.py", r.stderr


# ---------------------------------------------------------------- issue 23 (LOW)
def test_a_file_that_is_not_python_is_refused_without_importing_its_namesake(tmp_path, capsys, monkeypatch):
    """`emit notpy.txt:x` used to import notpy.py (running it) and then fail on its 'txt'."""
    (tmp_path / "notpy.py").write_text("raise SystemExit('notpy.py was run')\n")
    (tmp_path / "notpy.txt").write_text("not python\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["emit", "notpy.txt:x"]) == 2
    assert "notpy.txt is not a Python file" in one_error_line(capsys)
    (tmp_path / "notpy.txt").unlink()
    assert main(["emit", "notpy.txt:x"]) == 2        # no such file: the dotted name is no module either
    assert "no such file or module: notpy.txt (notpy is a module, not a package)" in one_error_line(capsys)
    assert main(["emit", "not-a-module:x"]) == 2
    assert "no such file or module: not-a-module" in one_error_line(capsys)


@pytest.mark.parametrize("value", ["5", "None", "'identity'", "{'a': 1}"])
def test_a_prebuild_that_is_not_a_list_is_one_line(tmp_path, capsys, value):
    (tmp_path / "pre.py").write_text(f"import coda_cutlass.epilogues as e\nPREBUILD = {value}\n")
    assert main(["prebuild", str(tmp_path / "pre.py"), "--out", str(tmp_path / "o")]) == 2
    line = one_error_line(capsys)
    assert "PREBUILD" in line and "(program, options dict)" in line, line
    # the file is named by its path, not by the private module name it is loaded under
    assert f"PREBUILD of {tmp_path / 'pre.py'} " in line and "_coda_cutlass_user_" not in line, line


def test_a_bad_prebuild_item_names_its_file(tmp_path, capsys):
    (tmp_path / "pre.py").write_text("import coda_cutlass.epilogues as e\nPREBUILD = [e.identity]\n")
    assert main(["emit", str(tmp_path / "pre.py") + ":identity"]) == 2
    line = one_error_line(capsys)
    assert f"PREBUILD[0] of {tmp_path / 'pre.py'} must be a (program, options dict) pair" in line, line


@pytest.mark.parametrize("word", ["off", "0", "false", "No"])
def test_debug_variable_off_shows_no_traceback(math_py, capsys, monkeypatch, word):
    monkeypatch.setenv("CODA_CUTLASS_DEBUG", word)
    assert main(["emit", f"{math_py}:branches"]) == 2
    assert "epilogue 'branches'" in one_error_line(capsys)


def test_a_malformed_debug_variable_is_one_line(math_py, capsys, monkeypatch):
    monkeypatch.setenv("CODA_CUTLASS_DEBUG", "loud")
    assert main(["emit", f"{math_py}:branches"]) == 2
    assert "CODA_CUTLASS_DEBUG='loud' is not a boolean" in one_error_line(capsys)


def test_an_unwritable_out_is_found_before_any_build(fake_nvcc, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out in (blocker, blocker / "sub"):
        assert main(["prebuild", "coda_cutlass.epilogues", "--out", str(out)]) == 2
        assert f"--out {out}: cannot write there" in one_error_line(capsys)
    assert fake_nvcc["log"].read_text() == ""        # nvcc never ran


def test_emit_names_a_program_by_its_variable(tmp_path, capsys):
    f = tmp_path / "progs.py"
    f.write_text("import coda_cutlass as cc\n"
                 "my_relu = cc.epilogue(lambda acc: cc.relu(acc))\n"
                 "neg = cc.epilogue(lambda acc: -acc)\n"
                 "@cc.epilogue(name='fancy')\n"
                 "def plain(acc):\n    return acc * 2\n")
    assert main(["emit", f"{f}:my_relu"]) == 0 and "relu %0" in capsys.readouterr().out
    assert main(["emit", f"{f}:plain"]) == 0 and "generated kernel: fancy" in capsys.readouterr().out
    assert main(["emit", f"{f}:fancy"]) == 0 and "generated kernel: fancy" in capsys.readouterr().out
    assert main(["emit", f"{f}:<lambda>"]) == 2
    err = capsys.readouterr().err
    assert "'<lambda>' is the name of 2 programs" in err and "my_relu, neg" in err


def test_emit_takes_a_prebuild_entrys_options_unless_flags_say_otherwise(tmp_path, capsys):
    f = tmp_path / "mod.py"
    f.write_text("import torch, coda_cutlass as cc\n"
                 "@cc.epilogue\ndef bias(acc):\n    return acc + 1.0\n"
                 "@cc.epilogue\ndef helper_only(acc):\n    return acc\n"
                 "PREBUILD = [(bias, {'dtype': torch.float16, 'weight_layout': 'kn'})]\n")
    assert main(["emit", f"{f}:bias"]) == 0
    out = capsys.readouterr().out
    assert "f16 operands" in out and "W: [K, N] row-major" in out
    assert main(["emit", f"{f}:bias", "--dtype", "bfloat16", "--weight-layout", "nk"]) == 0
    out = capsys.readouterr().out
    assert "bf16 operands" in out and "W: [N, K] row-major" in out
    assert main(["emit", f"{f}:helper_only"]) == 0     # not listed, still in the file


def test_cache_on_a_regular_file_is_an_error(tmp_path, monkeypatch, capsys):
    f = tmp_path / "not-a-cache"
    f.write_text("x")
    monkeypatch.setenv("CODA_CUTLASS_CACHE_DIR", str(f))
    assert main(["cache"]) == 2
    assert "is not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["cache"], ["emit", str(HERE / "catalog.py") + ":residual_norm_stats"]])
def test_a_malformed_quiet_variable_is_one_line_whatever_the_command_prints(capsys, monkeypatch, tmp_path, command):
    monkeypatch.setenv("CODA_CUTLASS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CODA_CUTLASS_QUIET", "maybe")
    assert main(command) == 2
    assert "CODA_CUTLASS_QUIET='maybe' is not a boolean" in one_error_line(capsys)
