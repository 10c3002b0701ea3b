"""coda-cutlass: fused GEMM + epilogue kernels for Hopper, compiled from small Python programs."""

import re
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
version = re.search(r'__version__ = "([^"]+)"', (HERE / "coda_cutlass" / "__init__.py").read_text()).group(1)

setup(
    name="coda-cutlass",
    version=version,
    description="Fused GEMM + epilogue kernels (CUTLASS sm90 epilogue visitor trees) from Python programs",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=[
        "coda_cutlass", "coda_cutlass.ir", "coda_cutlass.frontend", "coda_cutlass.passes",
        "coda_cutlass.lower", "coda_cutlass.render", "coda_cutlass.build", "coda_cutlass.runtime",
        "coda_cutlass.epilogues",
    ],
    # templates/ and epilogues/ live at the top of the repository (coda_cutlass/ links to them);
    # the wheel carries real copies.
    package_dir={"coda_cutlass.epilogues": "epilogues"},
    package_data={"coda_cutlass": ["templates/*.j2", "templates/coda/*.hpp", "prebuilt/*.so", "prebuilt/*.json"]},
    install_requires=["torch>=2.4", "jinja2>=3.0", "nvidia-cutlass>=4.2,<5"],
    extras_require={"test": ["pytest>=7"]},
    entry_points={"console_scripts": ["coda-cutlass=coda_cutlass.cli:main"]},
)
