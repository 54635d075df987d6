"""Weights on 2 MB pages (runner/huge_pages.py): the memory it hands out (zeroed, aligned
to a huge page, shaped), the model's large tensors moved with their values and their sharing kept (the
quantized layers' and GGUF blocks' held outside parameters too), and an engine with and without it
generating the same tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill import LLM, SamplingParams
from tokenmill.layers.linear import Linear
from tokenmill.quant.gguf_method import GGUFBlocksMethod, GGUFEmbedding, GGUFMatrix, row_bytes
from tokenmill.quant.int_methods import Int8LinearMethod
from tokenmill.quant.quantize import QuantSpec
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
    model.register_buffer("head_rows", model.table[:16])  # a view starting where a moved tensor starts
    before = {name: t.clone() for name, t in model.state_dict().items()}
    small_ptr, part_ptr = model[1].weight.data_ptr(), model.part.data_ptr()
    moved = move_to_huge_pages(model)
    assert moved == 4096 * 256 * 4 + 1024 * 1024 * 4
    assert model[0].weight is model[2].weight and model[0].weight.data_ptr() % HUGE_PAGE == 0
    assert model.table.data_ptr() % HUGE_PAGE == 0
    assert model[1].weight.data_ptr() == small_ptr and model.part.data_ptr() == part_ptr
    assert model.head_rows.shape == (16, 1024)  # (not taken for the whole table's copy)
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


def test_a_quantized_layers_weights_move_and_compute_the_same():
    torch.manual_seed(0)
    layer = Linear(1024, 4096, linear_method=Int8LinearMethod(QuantSpec("int8"), None))
    with torch.no_grad():
        layer.weight.copy_(torch.randn(4096, 1024))
    layer.process_weights_after_loading()  # the weight goes; `layer.quantized` holds int8 [4096, 1024]: 4 MiB
    x = torch.randn(3, 1024)
    expected, q = layer(x), layer.quantized.q
    assert move_to_huge_pages(nn.Sequential(layer)) == 4096 * 1024  # (its scales and sums: under a huge page)
    assert layer.quantized.q.data_ptr() % HUGE_PAGE == 0 and q.data_ptr() % HUGE_PAGE != 0
    assert torch.equal(layer.quantized.q, q) and torch.equal(layer(x), expected)


def test_a_gguf_table_and_its_tied_head_move_as_one_copy():
    method = GGUFBlocksMethod(None)
    data = torch.randint(0, 256, (4096, row_bytes("Q8_0", 1024)), dtype=torch.uint8)  # 4096 rows of 34 x 32 bytes
    matrix = GGUFMatrix("Q8_0", data, 1024)
    table = GGUFEmbedding(4096, 1024, method, torch.float32)
    table.matrix = matrix
    head = Linear(1024, 4096, linear_method=method)
    head.gguf_parts = [(0, matrix)]  # as `finish_loading` leaves a tied pair: one matrix for both
    model = nn.ModuleDict({"table": table, "head": head})
    assert move_to_huge_pages(model) == data.numel()
    moved = table.matrix.data
    assert moved.data_ptr() % HUGE_PAGE == 0 and head.gguf_parts[0][1].data is moved
    assert torch.equal(moved, data) and table.matrix.type_name == "Q8_0" and table.matrix.cols == 1024


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
