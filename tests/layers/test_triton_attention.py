"""The Triton attention backend against the torch reference, on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1: no GPU, no timing; compiled, on CUDA tensors, where there is a GPU): decodes,
speculative verification rows, prompt chunks over a cached prefix, GQA and MQA, a sliding window,
block sizes 16 and 32, float32 within 1e-4. The device script (benchmarks/gpu/check.sh) runs this
file on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

# without CUDA, Triton's interpreter runs the kernels on CPU tensors (set before triton compiles anything);
# on a GPU (the device script runs this file) the same cases run compiled, on CUDA tensors
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tokenmill.layers.attention import allocate_kv_cache  # noqa: E402
from tokenmill.layers.backends.torch_ref import TorchReferenceBackend  # noqa: E402
from tokenmill.layers.backends.triton_paged import TritonPagedBackend  # noqa: E402

CASES = [
    # (query lens, cached lens before the step, heads, kv heads, block size, window)
    ([1, 1, 1], [5, 17, 40], 4, 2, 16, None),  # decodes, GQA
    ([4, 1], [9, 30], 4, 1, 16, None),  # a verification row of 1 + 3 drafts, MQA
    ([7, 12], [0, 20], 2, 2, 32, None),  # a fresh prompt and a chunk over a cached prefix
    ([1, 5], [50, 33], 4, 2, 16, 8),  # sliding window
    ([3, 1, 6], [31, 64, 1], 8, 2, 32, 20),
    ([9, 1, 5], [0, 20, 0], 4, 2, 16, None),  # fresh prompts (SDPA's, or the kernel's) around a decode
    ([6, 2], [0, 3], 4, 4, 16, 4),  # a fresh prompt in a windowed layer: the kernel's either way
]


@pytest.mark.parametrize("sdpa_prompts", [True, False])
@pytest.mark.parametrize(("query_lens", "cached", "heads", "kv_heads", "block", "window"), CASES)
def test_triton_paged_attention_matches_the_reference(query_lens, cached, heads, kv_heads, block, window, sdpa_prompts):
    torch.manual_seed(0)
    head_dim = 16
    seq_lens = [c + q for c, q in zip(cached, query_lens, strict=True)]
    blocks_each = [-(-s // block) for s in seq_lens]
    ids = torch.randperm(sum(blocks_each) + 3).tolist()  # scattered blocks
    tables, at = [], 0
    for n in blocks_each:
        tables.append(ids[at : at + n])
        at += n
    num_blocks = len(ids)
    ref_backend, tri_backend = TorchReferenceBackend(), TritonPagedBackend(sdpa_prompts)
    ref_cache = allocate_kv_cache(ref_backend, 1, num_blocks, block, kv_heads, head_dim, torch.float32, DEVICE)[0]
    tri_cache = allocate_kv_cache(tri_backend, 1, num_blocks, block, kv_heads, head_dim, torch.float32, DEVICE)[0]
    # the cached prefix: written by a reference step, copied to the other cache (same layout)
    prior = [c for c in cached if c]
    if prior:
        pq = [c for c in cached if c]
        pt = [t for t, c in zip(tables, cached, strict=True) if c]
        n = sum(pq)
        md = ref_backend.build_metadata(pq, pq, pt, block, DEVICE)
        ref_backend.forward(
            torch.randn(n, heads, head_dim, device=DEVICE), torch.randn(n, kv_heads, head_dim, device=DEVICE),
            torch.randn(n, kv_heads, head_dim, device=DEVICE),
            ref_cache, md, 0.25, window,
        )  # fmt: skip
        tri_cache.k.copy_(ref_cache.k)
        tri_cache.v.copy_(ref_cache.v)
    n = sum(query_lens)
    q = torch.randn(n + 2, heads, head_dim, device=DEVICE)  # two padding rows
    k, v = torch.randn(n + 2, kv_heads, head_dim, device=DEVICE), torch.randn(n + 2, kv_heads, head_dim, device=DEVICE)
    want = ref_backend.forward(
        q, k, v, ref_cache, ref_backend.build_metadata(query_lens, seq_lens, tables, block, DEVICE), 0.25, window
    )
    got = tri_backend.forward(
        q, k, v, tri_cache, tri_backend.build_metadata(query_lens, seq_lens, tables, block, DEVICE), 0.25, window
    )
    torch.testing.assert_close(got[:n], want[:n], rtol=1e-4, atol=1e-4)
    assert torch.equal(got[n:], torch.zeros_like(got[n:]))
    torch.testing.assert_close(tri_cache.k, ref_cache.k)  # the new keys went to the same slots
