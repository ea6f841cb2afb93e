"""Packaging glue that pyproject.toml cannot express: ship the top-level csrc/ as ``lq._csrc``.

The C++/CUDA sources are compiled on first use (lq/_ext.py), so an installed wheel needs
them next to the Python code; everything else about the package is in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["lq", "lq.*"]) + ["lq._csrc", "lq._csrc.cuda"],
    package_dir={"lq._csrc": "csrc"},
    package_data={
        "lq._csrc": ["*.cpp", "*.h", "cuda/*.cu", "cuda/*.cuh", "cuda/*.md"],
        "lq._csrc.cuda": ["*.cu", "*.cuh", "*.md"],
        "lq.conf": ["*.yaml", "*/*.yaml"],
    },
)
