"""`TOKENMILL_MAX_ISA`: the flags the defaults see and the build's target under a cap, a bad value named,
and (slow) a whole build under the AVX2 cap: no AVX-512 instruction in it, its products equal to the
torch reference, and the kernels' and GGUF blocks' tests passing on it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tokenmill.kernels import cpu_build
from tokenmill.kernels.cpu_build import (
    build_key,
    capped_flags,
    compile_flags,
    cpu_flags,
    isa_cap_settings,
    load_cpu_kernels,
    max_isa,
)
from tokenmill.kernels.defaults import CpuKind

AMX_FLAGS = "avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8 avx_vnni"


def test_the_avx2_cap_leaves_an_avx2_machine():
    flags = capped_flags(AMX_FLAGS, "avx2").split()
    assert flags == sorted(["avx2", "fma", "f16c"])
    kind = CpuKind.from_flags(" ".join(flags))
    assert (kind.avx512, kind.vnni, kind.bf16, kind.amx) == (False, False, False, False)


def test_the_avx512_cap_takes_amx_away_and_keeps_the_rest():
    kind = CpuKind.from_flags(capped_flags(AMX_FLAGS, "avx512"))
    assert (kind.avx512, kind.vnni, kind.bf16, kind.amx) == (True, True, True, False)
    assert CpuKind.from_flags(capped_flags(AMX_FLAGS, None)).amx


def test_the_cap_sets_the_target_and_its_own_build(monkeypatch):
    monkeypatch.delenv("TOKENMILL_MAX_ISA", raising=False)
    assert max_isa() is None and "-march=native" in compile_flags()
    csrc = Path(cpu_build.__file__).with_name("csrc")
    native_key = build_key(csrc)
    monkeypatch.setenv("TOKENMILL_MAX_ISA", "AVX2")
    assert max_isa() == "avx2" and isa_cap_settings()["TOKENMILL_MAX_ISA"] == "AVX2"
    assert "-march=x86-64-v3" in compile_flags() and "-march=native" not in compile_flags()
    assert not any(f.startswith(("avx512", "amx")) for f in cpu_flags().split())
    assert set(cpu_flags().split()) <= set(cpu_flags(capped=False).split())
    monkeypatch.delenv("TOKENMILL_MAX_ISA")
    assert cpu_flags(capped=False) == cpu_flags()
    monkeypatch.setenv("TOKENMILL_MAX_ISA", "avx2")
    assert build_key(csrc) != native_key
    monkeypatch.setenv("TOKENMILL_MAX_ISA", "avx512")
    assert "-mno-amx-tile" in compile_flags()


def test_an_unknown_cap_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("TOKENMILL_MAX_ISA", "sse2")
    with pytest.raises(ValueError, match=r"TOKENMILL_MAX_ISA: expected one of avx2, avx512 .* got 'sse2'"):
        cpu_flags()
    with pytest.raises(ValueError, match="TOKENMILL_MAX_ISA"):
        load_cpu_kernels()


CHECK = textwrap.dedent(
    """
    import torch
    from tokenmill.kernels.cpu_build import cpu_flags, load_cpu_kernels
    kernels = load_cpu_kernels()
    assert kernels is not None
    assert "avx512f" not in cpu_flags().split()
    torch.manual_seed(0)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    w = torch.randn(40, 256, dtype=torch.bfloat16)
    out = torch.empty(3, 40, dtype=torch.bfloat16)
    kernels.ops.linear(out, x, w, None)
    ref = x.float() @ w.float().T
    assert (out.float() - ref).abs().max().item() <= 0.02 * ref.abs().max().item(), "linear"
    print(kernels.build_dir)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("objdump"), reason="needs objdump to read the build's instructions")
def test_a_build_under_the_avx2_cap_has_no_avx512_and_computes_right(tmp_path):
    if "avx2" not in cpu_flags().split():
        pytest.skip("the CPU has no AVX2")
    env = {**os.environ, "TOKENMILL_MAX_ISA": "avx2", "TOKENMILL_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    library = Path(done.stdout.strip().splitlines()[-1]) / "tokenmill_cpu.so"
    text = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    assert "vpdpbusd" not in text and "%zmm" not in text and "%ymm" in text
    # the kernels' and GGUF blocks' own tests on that build, as an AVX2-only machine runs them
    root = Path(__file__).resolve().parents[2]
    suites = [
        "tests/layers/test_cpu_kernels.py",
        "tests/layers/test_kv_int8.py",  # (the paged kernel on an int8 cache, prompts included)
        "tests/quant/test_gguf_blocks.py",
        "tests/quant/test_gguf_kquant_models.py",
        "tests/quant/test_gguf_x16.py",  # (the 16-row products' AVX2 form, gguf_x16_avx2.h)
    ]
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *suites],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert tests.returncode == 0, tests.stdout[-3000:]
