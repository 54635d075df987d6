"""The forward over a paged KV cache equals transformers' logits, for every family, tied and untied."""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers import PagedRunner, assert_logits_close
from tokenmill.models.loader import load_model
from tokenmill.tools.make_model import ARCHS

CASES = [(arch, tied) for arch in ARCHS for tied in (False, True)]
IDS = [f"{a}-{'tied' if t else 'untied'}" for a, t in CASES]


def prompt(seed: int, length: int, vocab: int = 4096) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("arch", "tied"), CASES, ids=IDS)
def test_whole_prompt_one_pass(tiny_model_dir, hf_logits, arch, tied):
    folder = tiny_model_dir(arch, tied)
    model = load_model(folder, dtype="float32")
    ids = prompt(0, 77)
    runner = PagedRunner(model, num_blocks=8, block_size=16, block_order=[5, 2, 7, 0, 3, 6, 1, 4])
    ours = runner.step({0: ids})[0]
    assert_logits_close(ours, hf_logits(folder, ids))


@pytest.mark.parametrize(("arch", "tied"), CASES, ids=IDS)
def test_chunked_prefill_then_decode(tiny_model_dir, hf_logits, arch, tied):
    """Odd-sized chunks carry the cache between passes; then one token at a time."""
    folder = tiny_model_dir(arch, tied)
    model = load_model(folder, dtype="float32")
    ids = prompt(1, 90)
    runner = PagedRunner(model, num_blocks=12, block_size=8, block_order=list(range(11, -1, -1)))
    pieces, start = [], 0
    for size in (7, 1, 13, 29, 5):  # 55 prompt tokens in odd chunks ...
        pieces.append(runner.step({0: ids[start : start + size]})[0])
        start += size
    while start < len(ids):  # ... then 35 decode steps
        pieces.append(runner.step({0: ids[start : start + 1]})[0])
        start += 1
    assert_logits_close(torch.cat(pieces), hf_logits(folder, ids))


@pytest.mark.parametrize(("arch", "tied"), CASES, ids=IDS)
def test_flat_batch_of_several_sequences(tiny_model_dir, hf_logits, arch, tied):
    """Prefill, chunk continuation and decode in one flat batch, with shuffled, interleaved blocks
    and padding at the end of the batch."""
    folder = tiny_model_dir(arch, tied)
    model = load_model(folder, dtype="float32")
    order = list(range(40))
    random.Random(7).shuffle(order)
    runner = PagedRunner(model, num_blocks=40, block_size=4, block_order=order)
    seqs = {0: prompt(2, 37), 1: prompt(3, 26), 2: prompt(4, 50), 3: prompt(5, 3)}
    first = runner.step({1: seqs[1][:20], 2: seqs[2][:49]})
    second = runner.step({0: seqs[0], 1: seqs[1][20:25], 2: seqs[2][49:], 3: seqs[3][:1]}, pad_to=64)
    third = runner.step({3: seqs[3][1:], 1: seqs[1][25:]})
    assert sorted(runner.tables[0]) != runner.tables[0], "blocks should be used out of order"
    assert_logits_close(second[0], hf_logits(folder, seqs[0]))
    assert_logits_close(torch.cat([first[1], second[1], third[1]]), hf_logits(folder, seqs[1]))
    assert_logits_close(torch.cat([first[2], second[2]]), hf_logits(folder, seqs[2]))
    assert_logits_close(torch.cat([second[3], third[3]]), hf_logits(folder, seqs[3]))


def test_padding_is_computed_but_never_cached(tiny_model_dir):
    model = load_model(tiny_model_dir("llama"), dtype="float32")
    plain = PagedRunner(model, num_blocks=8, block_size=16, block_order=list(range(8)))
    padded = PagedRunner(model, num_blocks=8, block_size=16, block_order=list(range(8)))
    ids = prompt(6, 21)
    a = plain.step({0: ids})[0]
    b = padded.step({0: ids}, pad_to=48)[0]
    assert torch.equal(a, b)
    for pc, qc in zip(plain.caches, padded.caches, strict=True):
        assert torch.equal(pc.k, qc.k) and torch.equal(pc.v, qc.v)
    # only the two blocks the sequence owns were written
    written = {int(i) for i in (padded.caches[0].k.abs().sum(dim=(1, 2, 3)) > 0).nonzero()}
    assert written == set(padded.tables[0]) == {0, 1}


def test_a_wrong_block_table_is_caught(tiny_model_dir, hf_logits):
    """The tolerance is strict enough to fail: decoding with one stale block in the table (a block
    the sequence never wrote) gives logits far from the reference. (Swapping two of its own blocks
    would not: keys carry their rotary positions, and attention does not care where they sit.)"""
    folder = tiny_model_dir("llama")
    model = load_model(folder, dtype="float32")
    ids = prompt(8, 40)
    runner = PagedRunner(model, num_blocks=8, block_size=8, block_order=list(range(8)))
    runner.step({0: ids[:39]})
    table = runner.tables[0]
    table[1] = runner.free[-1]
    last = runner.step({0: ids[39:]})[0]
    with pytest.raises(AssertionError, match="max abs diff"):
        assert_logits_close(last, hf_logits(folder, ids)[39:])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_tracks_float32(tiny_model_dir, dtype):
    folder = tiny_model_dir("qwen3")
    ids = prompt(9, 33)
    full = PagedRunner(load_model(folder, dtype="float32"), 4, 16, [0, 1, 2, 3]).step({0: ids})[0]
    model = load_model(folder, dtype=dtype)
    assert model.embed_tokens.weight.dtype == getattr(torch, dtype)
    half = PagedRunner(model, 4, 16, [3, 2, 1, 0]).step({0: ids})[0]
    assert half.dtype == torch.float32  # logits are always returned in float32
    assert_logits_close(half, full, rel=0.05)
    assert (half.argmax(-1) == full.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_many_decodes_of_mixed_lengths_in_one_step(tiny_model_dir, hf_logits, arch):
    """Eleven sequences decode together: they are attended in groups of similar context length."""
    folder = tiny_model_dir(arch)
    model = load_model(folder, dtype="float32")
    order = list(range(120))
    random.Random(11).shuffle(order)
    runner = PagedRunner(model, num_blocks=120, block_size=4, block_order=order)
    seqs = {i: prompt(20 + i, 5 + 7 * ((i * 5) % 11)) for i in range(11)}
    for i, ids in seqs.items():
        runner.step({i: ids[:-1]})
    last = runner.step({i: ids[-1:] for i, ids in seqs.items()})
    for i, ids in seqs.items():
        assert_logits_close(last[i], hf_logits(folder, ids)[-1:])
