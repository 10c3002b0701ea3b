"""Helpers for the wheel tests: build the wheel from a copy of the repository (optionally with
prebuilt kernels inside), and install it into a fresh virtual environment that looks like a
prebuilt-only install.

The fresh environment reuses the packages of the interpreter running the tests (torch is large)
through read-only "views" of its site-packages folders: symlinks to every entry except this
package (its editable install) and what only the ``[jit]`` extra brings (nvidia-cutlass). The
repository is not on its ``sys.path``, nvcc is not on its ``PATH``.
"""

from __future__ import annotations

import email
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Iterable

REPO = Path(__file__).resolve().parent.parent
# What setup.py reads: the package, the folders it maps into it, and the metadata files.
BUILD_INPUTS = ("setup.py", "pyproject.toml", "README.md", "LICENSE", "coda_cutlass", "epilogues", "templates")
# Hidden from the fresh environment: this package, and the distributions of the [jit] extra.
HIDDEN = re.compile(r"^(__editable__|coda_cutlass|nvidia_cutlass|cutlass_library|cutlass_cppgen|pycute)"
                    r"([-_.].*)?$", re.IGNORECASE)


def source_copy(dest: Path, prebuilt: Iterable[Path] = ()) -> Path:
    """The build inputs copied to `dest` (links kept, so coda_cutlass/templates still points at the
    copy's templates/), with exactly the given files in coda_cutlass/prebuilt."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in BUILD_INPUTS:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True, ignore=_ignore)
        else:
            shutil.copy2(src, dest / name)
    for f in prebuilt:
        shutil.copy2(f, dest / "coda_cutlass" / "prebuilt" / Path(f).name)
    return dest


def _ignore(folder: str, names: list[str]) -> set[str]:
    """Bytecode, and the checkout's own prebuilt kernels (the caller chooses those)."""
    prebuilt = Path(folder).name == "prebuilt"
    return {n for n in names if n == "__pycache__" or n.endswith(".pyc") or prebuilt and n.endswith((".so", ".json"))}


def build_wheel(src: Path) -> Path:
    """The README's command, run in `src`."""
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", "dist", "."], cwd=src,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wheels = list((src / "dist").glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def wheel_files(whl: Path) -> set[str]:
    with zipfile.ZipFile(whl) as z:
        return set(z.namelist())


def wheel_metadata(whl: Path, name: str = "METADATA") -> email.message.Message:
    with zipfile.ZipFile(whl) as z:
        path = next(n for n in z.namelist() if n.endswith(f".dist-info/{name}"))
        return email.message_from_bytes(z.read(path))


def expected_package_files(src: Path) -> set[str]:
    """Every file of the package in the source tree (modules, templates, headers, data), as its
    path inside the wheel."""
    out = set()
    for root, dirs, files in os.walk(src / "coda_cutlass", followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out.update((Path(root) / f).relative_to(src).as_posix() for f in files if not f.endswith(".pyc"))
    return out


def platform_tag() -> str:
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


def expected_manylinux_tag(libraries: Iterable[Path]) -> str:
    """The tag a wheel carrying these libraries should have, from binutils' readelf (not from the
    package's own ELF reader): the oldest baseline providing their newest symbol versions."""
    from coda_cutlass.build.manylinux import tag_for
    needs: dict[str, tuple[int, ...]] = {}
    for lib in libraries:
        for names in readelf_needs(lib)[1].values():
            for name in names:
                family, _, version = name.partition("_")
                if family in ("GLIBC", "GLIBCXX", "CXXABI", "GCC") and re.fullmatch(r"[0-9.]+", version):
                    v = tuple(int(x) for x in version.split("."))
                    needs[family] = max(needs.get(family, v), v)
    tag = tag_for(needs, "x86_64")[0]
    assert tag is not None, needs
    return tag


def system_library(name: str) -> Path:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    m = re.search(rf"^\s*{re.escape(name)} \(libc6,x86-64\) => (\S+)$", out, re.M)
    assert m, f"{name} not found by ldconfig"
    return Path(m.group(1))


def readelf_needs(path: Path) -> tuple[set[str], dict[str, set[str]]]:
    """(DT_NEEDED libraries, library -> version names) as binutils' readelf prints them."""
    dyn = subprocess.run(["readelf", "-d", "-W", str(path)], capture_output=True, text=True, check=True).stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn))
    ver = subprocess.run(["readelf", "-V", "-W", str(path)], capture_output=True, text=True, check=True).stdout
    versions: dict[str, set[str]] = {}
    current = None
    for line in ver[ver.find("Version needs"):].splitlines():
        if m := re.search(r"File: (\S+)", line):
            current = versions.setdefault(m.group(1), set())
        elif (m := re.search(r"Name: (\S+)", line)) and current is not None:
            current.add(m.group(1))
    return needed, versions


def _site_dirs() -> list[Path]:
    """The site-packages folders of the running interpreter, as on its sys.path."""
    return [Path(p) for p in sys.path if p and Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]


def fresh_venv(root: Path) -> Path:
    """A new virtual environment under `root` seeing views of this interpreter's site-packages;
    returns its python."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    views = []
    for i, d in enumerate(_site_dirs()):
        view = root / f"site-view-{i}"
        view.mkdir()
        for entry in d.iterdir():
            if not HIDDEN.match(entry.name) and entry.suffix != ".pth":
                (view / entry.name).symlink_to(entry)
        views.append(str(view))
    (site / "zz_test_views.pth").write_text("\n".join(views) + "\n")
    return python


def install_wheel(python: Path, whl: Path) -> None:
    r = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed",
                        str(whl)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def env_without_toolchain(cache: Path) -> dict[str, str]:
    """This environment minus nvcc (dropped from PATH), CUDA_HOME and every coda-cutlass setting;
    an empty kernel cache."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CODA_CUTLASS_", "PYTHON")) and k not in ("CUDA_HOME", "CUDA_PATH", "CUTLASS_DIR")}
    env["PATH"] = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                  if p and not os.access(os.path.join(p, "nvcc"), os.X_OK))
    env["CODA_CUTLASS_CACHE_DIR"] = str(cache)
    env["CODA_CUTLASS_QUIET"] = "1"
    return env


def run_python(python: Path, code: str, env: dict[str, str], cwd: Path) -> dict:
    """Runs `code` isolated (-I: no script folder, no PYTHONPATH, no user site) in `cwd`; the code
    prints one JSON object last."""
    r = subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True, env=env, cwd=cwd,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# Run inside the fresh environment: where things come from, a prebuilt kernel's lookup (and its
# .so loaded through ctypes, which needs no GPU), the error for a kernel that was not prebuilt, and
# the command line (emit works; prebuild without a toolchain fails without a traceback).
PREBUILT_CHECK = r'''
import contextlib, importlib.metadata, importlib.util, io, json, shutil, sys, torch
import coda_cutlass as cc
from coda_cutlass.cli import main
from coda_cutlass.epilogues import residual_add, residual_norm_stats
out = {"package": cc.__file__, "sys_path": sys.path, "nvcc": shutil.which("nvcc"),
       "cutlass": importlib.util.find_spec("cutlass_library") is not None,
       "requires": importlib.metadata.requires("coda-cutlass")}
k = cc.compile_epilogue(residual_norm_stats, dtype=torch.bfloat16)
# k.library loads the .so through ctypes and checks that it describes this program (no GPU needed)
out.update(origin=k.origin, path=str(k.path), described=bool(k.library.description))
try:
    cc.compile_epilogue(residual_add, dtype=torch.float16)
    out["missing"] = None
except cc.CodaError as e:
    out["missing"] = {"type": type(e).__name__, "message": str(e)}
for name, argv in (("emit", ["emit", "coda_cutlass.epilogues:swiglu"]),
                   ("prebuild", ["prebuild", "coda_cutlass.epilogues", "--out", "kernels"])):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(argv)
    out[name] = {"rc": rc, "stdout": stdout.getvalue()[:2000], "stderr": stderr.getvalue()}
print(json.dumps(out))
'''
