"""The native CPU kernels against the torch reference: the `cpu` attention backend's paged kernel
and KV write (shuffled block tables, query lengths 1 to 17 beside long prompt chunks, GQA/MQA,
sliding windows, block sizes that are and are not whole vector tiles, head sizes that are not
multiples of 16, float32 and bfloat16), the fused layer ops against `TorchOps`, the build cache's
key, and the fallback when nothing can be built."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tokenmill.kernels import cpu_build
from tokenmill.kernels.cpu_build import build_key, cpu_flags, load_cpu_kernels
from tokenmill.layers.attention import allocate_kv_cache
from tokenmill.layers.backends import get_attention_backend
from tokenmill.layers.backends.cpu_paged import MAX_KERNEL_QUERY, CpuPagedBackend
from tokenmill.layers.ops import get_layer_ops
from tokenmill.layers.rotary import RopeConfig, RotaryEmbedding

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the native CPU kernels did not build here")


def run_two_steps(heads, kv_heads, dim, block_size, window, dtype, prompt_attention="native"):
    """Prompt chunks, then a step of decodes and short multi-token queries, through both backends
    on their own caches (same shuffled block tables); both steps' outputs, reference then cpu.
    With `prompt_attention` = `sdpa`, the chunks of 20 and 17 take the SDPA path beside the kernel."""
    rng = random.Random(block_size * 31 + dim)
    history = [1, 9, 33, 60, 100, 5, 2]
    new = [1, 3, 1, 20, 1, 5, MAX_KERNEL_QUERY + 1]
    seq_lens = [h + n for h, n in zip(history, new, strict=True)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    order = list(range(num_blocks))
    rng.shuffle(order)
    tables, used = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append([*order[used : used + n], order[-1]])  # one spare block past what is needed
        used += n
    backends = [get_attention_backend("torch"), CpuPagedBackend(KERNELS, prompt_attention)]
    caches = [allocate_kv_cache(b, 1, num_blocks, block_size, kv_heads, dim, dtype)[0] for b in backends]
    gen = torch.Generator().manual_seed(dim)
    steps = []
    for query_lens, lens in ((history, history), (new, seq_lens)):
        qkv = torch.randn(sum(query_lens) + 2, heads + 2 * kv_heads, dim, generator=gen).to(dtype)  # 2 padding rows
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        outs = []
        for backend, cache in zip(backends, caches, strict=True):
            md = backend.build_metadata(query_lens, lens, tables, block_size)
            outs.append(backend.forward(q, k, v, cache, md, dim**-0.5, window)[: sum(query_lens)])
        steps.append(outs)
    return steps


@pytest.mark.parametrize("prompt_attention", ["native", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    # (head sizes 64 and 128 on a bfloat16 cache take bfloat16 dot products where the CPU has them:
    # whole tiles, and blocks cut into partial ones)
    [(8, 2, 64, 16), (6, 3, 40, 5), (4, 1, 32, 32), (8, 2, 64, 5), (4, 4, 128, 24)],
)
def test_paged_kernel_equals_the_reference(heads, kv_heads, dim, block_size, window, dtype, prompt_attention):
    tol = 2e-6 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output apart at most
    for ref, cpu in run_two_steps(heads, kv_heads, dim, block_size, window, dtype, prompt_attention):
        torch.testing.assert_close(cpu.float(), ref.float(), atol=tol, rtol=tol)


def test_the_kernels_refuse_bad_inputs_with_a_message():
    backend = get_attention_backend("cpu")
    cache = allocate_kv_cache(backend, 1, 4, 16, 2, 64, torch.float32)[0]
    md = backend.build_metadata([1], [3], [[0]], 16)
    q = torch.randn(1, 8, 64)
    with pytest.raises(RuntimeError, match="share a dtype"):
        backend.forward(q.bfloat16(), torch.randn(1, 2, 64), torch.randn(1, 2, 64), cache, md, 0.125, None)
    with pytest.raises(RuntimeError, match="multiple of the cache's KV heads"):
        backend.forward(torch.randn(1, 7, 64), torch.randn(1, 2, 64), torch.randn(1, 2, 64), cache, md, 0.125, None)


def test_the_build_is_keyed_by_the_cpu_and_the_sources(tmp_path, monkeypatch):
    source = Path(cpu_build.__file__).with_name("csrc")
    assert KERNELS is not None and KERNELS.build_dir.name == build_key(source)
    copy = tmp_path / "csrc"
    copy.mkdir()
    for f in source.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert build_key(copy) == build_key(source)
    (copy / "attention.cpp").write_text((copy / "attention.cpp").read_text() + "\n// changed\n")
    assert build_key(copy) != build_key(source)
    # the same sources on a CPU with other instructions: another build
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: cpu_flags() + " avx512_fp16")
    assert build_key(source) != KERNELS.build_dir.name


def test_a_failed_build_is_logged_and_auto_falls_back_to_the_reference(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cpu_build, "_ops_loaded", lambda: False)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level("WARNING", logger="tokenmill"):
        assert load_cpu_kernels() is None
        assert get_attention_backend("auto").name == "torch"
    assert "native CPU kernels unavailable" in caplog.text
    with pytest.raises(ValueError, match="attention_backend: 'cpu' needs the native CPU kernels"):
        get_attention_backend("cpu")


def test_a_failed_build_is_tried_once_a_process(tmp_path, monkeypatch, caplog):
    """A build that failed (a compile error can take a minute to reach) is not started again by each
    engine or layer that asks for the kernels; each still gets None and the reason in the log."""
    monkeypatch.setattr(cpu_build, "_ops_loaded", lambda: False)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    tries = []

    def failing_build(csrc, build_dir):
        tries.append(build_dir)
        raise RuntimeError("Error building extension 'tokenmill_cpu'")

    monkeypatch.setattr(cpu_build, "_build", failing_build)
    with caplog.at_level("WARNING", logger="tokenmill"):
        assert [load_cpu_kernels() for _ in range(3)] == [None, None, None]
    assert len(tries) == 1
    assert caplog.text.count("native CPU kernels unavailable (RuntimeError: Error building extension") == 3
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "elsewhere"))  # another folder: another try
    assert load_cpu_kernels() is None and len(tries) == 2


def test_a_build_a_killed_process_left_locked_is_redone_and_a_waiter_loads_the_result(tmp_path, monkeypatch):
    """cpp_extension's lock file, left by a build killed midway, would make every later build wait for
    ever: under the folder's own lock nobody else builds, so it goes. A process that waited for another's
    build loads that library instead of building again."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpu_build, "_ops_loaded", lambda: False)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_prelude_flags", lambda csrc, build_dir: [])
    csrc = Path(cpu_build.__file__).with_name("csrc")
    build_dir = cpu_build.cache_root() / build_key(csrc)
    build_dir.mkdir(parents=True)
    (build_dir / "lock").write_text("")  # the killed build's
    built, loaded = [], []

    def fake_load(**kwargs):
        assert not (build_dir / "lock").exists()
        (build_dir / f"{cpu_build.LIBRARY}.so").write_bytes(b"")
        built.append(kwargs["build_directory"])

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    assert load_cpu_kernels() is not None
    assert built == [str(build_dir)] and loaded == []  # (cpp_extension.load loads what it built)
    cpu_build._build(csrc, build_dir)  # as a process that waited on the folder's lock
    assert built == [str(build_dir)] and loaded == [str(build_dir / f"{cpu_build.LIBRARY}.so")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_ops_equal_the_torch_reference(dtype):
    ref, cpu = get_layer_ops("torch"), get_layer_ops("cpu")
    assert (ref.name, cpu.name) == ("torch", "cpu")
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    # float32: a few ulps apart (sums in another order); bfloat16: rounded at the same points
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}
    x, residual, weight = rand(5, 96), rand(5, 96), rand(96)
    torch.testing.assert_close(cpu.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6), **tol)
    heads = rand(5, 7, 32)[:, 2:]  # a strided 3-D view, as q/k norms see it
    torch.testing.assert_close(cpu.rms_norm(heads, weight[:32], 1e-5), ref.rms_norm(heads, weight[:32], 1e-5), **tol)
    expected = ref.add_rms_norm(x, residual, weight, 1e-6)
    got = cpu.add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **tol)
    gate_up = rand(5, 2 * 48)
    torch.testing.assert_close(cpu.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), **tol)

    rope = RotaryEmbedding(RopeConfig("default", 10000.0), 64, 256, torch.device("cpu"))
    positions = torch.tensor([0, 3, 17, 255, 100])
    qkv = rand(5, 10 * 64)
    qk = qkv[:, : 6 * 64].view(5, 6, 64)  # q and k heads inside the projection's output, as the model has them
    expected_qk = ref.rotate(qk, ref.rotary_inputs(rope, positions, dtype))
    got_qk = cpu.rotate(qk, cpu.rotary_inputs(rope, positions, dtype))
    assert got_qk.data_ptr() == qkv.data_ptr()  # in place, no copy
    torch.testing.assert_close(got_qk, expected_qk, **tol)
