"""Weights on 2 MB pages (runner/huge_pages.py): the memory it hands out (zeroed, aligned
to a huge page, shaped), the model's large tensors moved with their values and their sharing kept, and
an engine with and without it generating the same tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill import LLM, SamplingParams
from tokenmill.runner.huge_pages import HUGE_PAGE, huge_zeros, move_to_huge_pages, place_on_huge_pages, thp_mode


def test_huge_zeros_are_zero_aligned_and_writable():
    t = huge_zeros((3, 1024, 1024), torch.bfloat16)
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.bfloat16
    assert t.data_ptr() % HUGE_PAGE == 0 and t.is_contiguous()
    assert not t.any()
    t[1, 2, 3] = 5
    assert t.sum().item() == 5


def test_the_models_large_tensors_move_with_their_values_and_sharing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4096, 256), nn.Linear(256, 8), nn.Linear(256, 4096, bias=False))
    model[2].weight = model[0].weight  # tied: one parameter in two modules
    model.register_buffer("table", torch.randn(1024, 1024))
    fused = torch.randn(2048, 512)
    model.register_buffer("part", fused[:1024])  # a view into a larger tensor: left where it is
    before = {name: t.clone() for name, t in model.state_dict().items()}
    small_ptr, part_ptr = model[1].weight.data_ptr(), model.part.data_ptr()
    moved = move_to_huge_pages(model)
    assert moved == 4096 * 256 * 4 + 1024 * 1024 * 4
    assert model[0].weight is model[2].weight and model[0].weight.data_ptr() % HUGE_PAGE == 0
    assert model.table.data_ptr() % HUGE_PAGE == 0
    assert model[1].weight.data_ptr() == small_ptr and model.part.data_ptr() == part_ptr
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name


def test_placing_before_the_load_gives_huge_pages_that_a_move_then_leaves_alone():
    model = nn.Sequential(nn.Embedding(4096, 256), nn.Linear(256, 8))
    small_ptr = model[1].weight.data_ptr()
    assert place_on_huge_pages(model) == 4096 * 256 * 4
    table = model[0].weight
    assert table.data_ptr() % HUGE_PAGE == 0 and not table.any()  # fresh, zeroed: the load fills it
    assert model[1].weight.data_ptr() == small_ptr
    values = torch.randn(4096, 256)
    with torch.no_grad():
        table.copy_(values)
    assert move_to_huge_pages(model) == 0  # placed already: no second copy
    assert model[0].weight.data_ptr() == table.data_ptr() and torch.equal(model[0].weight, values)


def test_thp_mode_reads_the_kernels_setting():
    assert thp_mode() in (None, "always", "madvise", "never")


@pytest.mark.timeout(120)
def test_an_engine_generates_the_same_tokens_on_either_page_size(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    prompts = [{"prompt_token_ids": [5, 17, 300, 42, 9, 11]}, {"prompt_token_ids": [7, 8, 9, 10]}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = []
    for huge in (True, False):
        llm = LLM(model, dtype="float32", cpu_huge_pages=huge, kv_cache_memory=8 << 20)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]
