"""coda-cutlass: fused GEMM + epilogue kernels for Hopper, compiled from small Python programs.

Packaging rules (tests/test_packaging.py and tests/test_nvcc_build.py check them on built wheels):
- every package under ``coda_cutlass/`` is found automatically (a folder with an ``__init__.py``),
  and every other file in it is package data; the repository's top-level ``epilogues/`` is
  ``coda_cutlass.epilogues`` and ``templates/`` is data (``coda_cutlass/templates`` links to it;
  the wheel carries real copies);
- a wheel with prebuilt kernels (``coda_cutlass/prebuilt/*.so``) is tagged ``py3-none-manylinux_2_X_<arch>``:
  the kernels are host-specific shared libraries but use no Python ABI (ctypes), and X is the glibc
  they need, read from the .so files being shipped when the wheel is built
  (``coda_cutlass/build/manylinux.py``), so PyPI takes the wheel and pip installs it only where glibc is
  new enough. If a kernel meets no manylinux tag (it links a library no manylinux platform has), the
  tag is this platform's (``linux_x86_64``) with a warning. Without kernels the wheel is pure
  (``py3-none-any``);
- what only JIT builds need (the CUTLASS headers from nvidia-cutlass, with its own dependencies such
  as cuda-python) is the ``[jit]`` extra, so a prebuilt-only install does not pull it.
"""

import importlib.util
import re
import shutil
import warnings
from pathlib import Path

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_py import build_py

try:                                   # setuptools >= 70.1 carries bdist_wheel itself
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:                    # older setuptools: the wheel package's
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
version = re.search(r'__version__ = "([^"]+)"', (HERE / "coda_cutlass" / "__init__.py").read_text()).group(1)

CUTLASS = "nvidia-cutlass>=4.2,<5"


def prebuilt_kernels() -> list[Path]:
    return sorted((HERE / "coda_cutlass" / "prebuilt").glob("*.so"))


def has_prebuilt_kernels() -> bool:
    return bool(prebuilt_kernels())


def manylinux_tag(kernels: list[Path]) -> tuple[str | None, str]:
    """The manylinux tag the kernels meet (coda_cutlass/build/manylinux.py, loaded on its own: the
    package needs torch, the build does not)."""
    spec = importlib.util.spec_from_file_location("_coda_cutlass_manylinux",
                                                  HERE / "coda_cutlass" / "build" / "manylinux.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.manylinux_tag(kernels)


class BuildPy(build_py):
    """Starts from an empty ``build/lib/coda_cutlass``: setuptools never removes files from it, so a
    module or prebuilt kernel deleted from the source would otherwise still ship."""

    def run(self):
        if not getattr(self, "editable_mode", False):
            shutil.rmtree(Path(self.build_lib) / "coda_cutlass", ignore_errors=True)
        super().run()


class KernelDistribution(Distribution):
    """With prebuilt kernels the package holds platform binaries: like extension modules, they make
    the wheel impure (installed to platlib, tagged for this platform)."""

    def has_ext_modules(self):
        return super().has_ext_modules() or has_prebuilt_kernels()


class BdistWheel(bdist_wheel):
    """``py3-none-manylinux_2_X_<arch>``: the kernels are called through ctypes, so any Python 3 will
    do; X is the glibc the kernels need."""

    def get_tag(self):
        python, abi, plat = super().get_tag()
        if not self.root_is_pure:
            python, abi = "py3", "none"
            tag, why = manylinux_tag(prebuilt_kernels())
            if tag is None:
                warnings.warn(f"prebuilt kernels meet no manylinux tag ({why}): the wheel is tagged {plat}, "
                              "which PyPI does not accept")
            else:
                plat = tag
        return python, abi, plat


setup(
    name="coda-cutlass",
    version=version,
    description="Fused GEMM + epilogue kernels (CUTLASS sm90 epilogue visitor trees) from Python programs",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    url="https://github.com/coda-cutlass/coda-cutlass",
    project_urls={
        "Source": "https://github.com/coda-cutlass/coda-cutlass",
        "Documentation": "https://github.com/coda-cutlass/coda-cutlass/blob/main/docs/WRITING_EPILOGUES.md",
        "Issues": "https://github.com/coda-cutlass/coda-cutlass/issues",
    },
    license="MIT",
    license_files=["LICENSE"],
    classifiers=[
        "Programming Language :: Python :: 3",
        "Operating System :: POSIX :: Linux",
        "Environment :: GPU :: NVIDIA CUDA",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    python_requires=">=3.11",
    packages=find_packages(include=["coda_cutlass", "coda_cutlass.*"]),
    package_dir={"coda_cutlass.epilogues": "epilogues"},
    # Every other file under coda_cutlass/ ships too: templates and headers, prebuilt kernels,
    # data such as nn/plans/*.json.
    package_data={"coda_cutlass": ["**/*"]},
    exclude_package_data={"coda_cutlass": ["*.pyc", "*.pyo"]},
    install_requires=["torch>=2.4", "jinja2>=3.0"],
    extras_require={"jit": [CUTLASS], "test": ["pytest>=7", CUTLASS, "transformers>=4.45", "accelerate>=1.1"]},
    entry_points={"console_scripts": ["coda-cutlass=coda_cutlass.cli:main"]},
    cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel},
    distclass=KernelDistribution,
)
