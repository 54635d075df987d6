"""Fixtures shared by the quantization tests: the native CPU ops (skipping where they do not build)."""

from __future__ import annotations

import pytest

from tokenmill.kernels.cpu_build import load_cpu_kernels


@pytest.fixture(scope="module")
def ops():
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the native CPU kernels do not build here")
    return kernels.ops
