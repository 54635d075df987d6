"""The native kernels build wherever a C++ compiler is (CI's machines have one). Every native test
skips where they do not build, so without this a compile error would hide behind a green run (it
did once: GCC takes only literal tile numbers in its AMX intrinsics)."""

from __future__ import annotations

import logging
import os
import platform
import shutil

import pytest

from tokenmill.kernels.cpu_build import load_cpu_kernels


def test_the_native_kernels_build_where_a_compiler_is(caplog):
    if shutil.which(os.environ.get("CXX", "c++")) is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("no C++ compiler here, or not an x86-64 CPU (the kernels' target)")
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        kernels = load_cpu_kernels()
    assert kernels is not None, caplog.text[-4000:]
