"""Decode steps through DecodeGraphs' static buffers equal eager steps: on the CPU the buffers run
eagerly (capture=False) under Triton's interpreter, which checks the padding rows, the scratch
block and the buffer copies; on a GPU (`gpu`) the graphs are captured and replayed, through the
runner and through the whole engine (against --enforce-eager)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton compiles anything: the kernels run on the CPU, interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tokenmill.layers.attention import allocate_kv_cache
from tokenmill.layers.backends.triton_paged import TritonPagedBackend
from tokenmill.models.loader import load_model
from tokenmill.outputs import NewRequestData, ScheduledChunk, SchedulerOutput
from tokenmill.runner.cuda_graphs import DecodeGraphs, graph_batch_sizes
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.sampling_params import SamplingParams

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BLOCK = 8


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(64) == [1, 2, 4, *range(8, 65, 8)]


def test_on_a_cuda_device_auto_means_triton_and_a_float32_checkpoint_runs_in_bfloat16(tiny_model_dir):
    from tokenmill.models.loader import read_model_config
    from tokenmill.runner.model_builder import attention_backend_name, default_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    cfg = read_model_config(tiny_model_dir("llama"))  # a float32 checkpoint
    assert default_dtype("auto", cfg, cuda) == torch.bfloat16
    assert default_dtype("float32", cfg, cuda) == torch.float32  # asked for: kept
    assert default_dtype("auto", cfg, cpu) == torch.float32
    assert attention_backend_name("auto", cuda, torch.bfloat16) == "triton"
    assert attention_backend_name("auto", cuda, torch.bfloat16, "int8") == "torch"  # (triton reads no int8 cache)
    assert attention_backend_name("torch", cuda, torch.bfloat16) == "torch"
    assert attention_backend_name("auto", cpu, torch.float32) == "auto"  # (the registry picks cpu or torch)


def test_padded_metadata_points_padding_rows_at_the_scratch_block():
    md = TritonPagedBackend().padded_metadata([3, 9], [[5], [2, 7]], BLOCK, "cpu", rows=4, width=6, scratch_block=11)
    assert md.num_actual_tokens == 4
    assert md.slot_mapping.tolist() == [5 * BLOCK + 2, 7 * BLOCK + 0, 11 * BLOCK, 11 * BLOCK]
    assert md.token_pos.tolist() == [2, 8, 0, 0]
    assert md.token_seq.tolist() == [0, 1, 2, 3]
    assert md.block_tables.shape == (4, 2)  # as wide as the longest sequence needs (a graph's buffer: up to 6)
    assert md.block_tables[2].tolist() == [11, 11]
    assert md.fresh == [] and md.paged_rows.tolist() == md.all_rows.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="exceed 4 rows x 1 blocks"):
        TritonPagedBackend().padded_metadata([3, 9], [[5], [2, 7]], BLOCK, "cpu", rows=4, width=1, scratch_block=11)


NUM_BLOCKS = 48


def run_requests(model, graphs: bool, device: torch.device, steps: int, capture: bool) -> tuple[dict, list]:
    """`drive` through a ModelRunner over NUM_BLOCKS blocks (+ the graphs' scratch block) -> its
    results, and the caches."""
    cfg = model.config
    backend = TritonPagedBackend()
    caches = allocate_kv_cache(backend, cfg.num_layers, NUM_BLOCKS + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim,
                               model.dtype, device)  # fmt: skip
    runner = ModelRunner(model, caches, backend, BLOCK)
    if graphs:
        runner.graphs = DecodeGraphs(model, caches, backend, BLOCK, 128, NUM_BLOCKS, [1, 2, 4], capture=capture)
    return drive(runner.execute, steps), caches


def drive(execute, steps: int) -> dict:
    """Three requests' prompts (one eager step), then `steps` decode steps of all three (padded to 4),
    one of them after a 1-token step of a fourth request mixed in; -> each request's tokens and
    chosen-token logprobs. Block ids below 40 (of BLOCK tokens each)."""
    params = SamplingParams(temperature=0, max_tokens=64, logprobs=2)
    prompts = {"a": [5, 9, 13, 2, 7], "b": [3] * 11, "c": [8, 1]}
    tables = {"a": [3], "b": [0, 7], "c": [12], "d": [20]}
    ids, logprobs = {r: [] for r in prompts}, {r: [] for r in prompts}

    def record(out) -> None:
        for r, toks in out.sampled.items():
            ids.setdefault(r, []).extend(toks)
            logprobs.setdefault(r, []).extend(out.logprobs[r])

    record(execute(SchedulerOutput(
        [NewRequestData(r, p, params, 0) for r, p in prompts.items()],
        [ScheduledChunk(r, p, 0, tables[r], True, True) for r, p in prompts.items()], [],
    )))  # fmt: skip
    for step in range(steps):
        chunks = []
        for r, p in prompts.items():
            position = len(p) + step
            grown = [24 + 5 * "abc".index(r) + position // BLOCK] if position % BLOCK == 0 else []
            tables[r] += grown
            chunks.append(ScheduledChunk(r, [ids[r][-1]], position, grown, True))
        new = [NewRequestData("d", [4], params, 0)] if step == 1 else []
        if step == 1:  # a 1-token prompt joins: a decode-shaped chunk, through the graph too
            chunks.append(ScheduledChunk("d", [4], 0, tables["d"], True, True))
        record(execute(SchedulerOutput(new, chunks, [])))
    return {"ids": ids, "logprobs": logprobs}


def same_tokens(a: dict, b: dict) -> None:
    """Equal greedy tokens, except where the top two logprobs of a row are within 1e-4 (a near-tie:
    other batch sizes take other float32 paths); the chosen tokens' logprobs within 1e-4."""
    for r in a["ids"]:
        for i, (x, y) in enumerate(zip(a["ids"][r], b["ids"][r], strict=True)):
            la, lb = a["logprobs"][r][i], b["logprobs"][r][i]
            if x != y:
                top = la.top
                assert abs(top[0][1] - top[1][1]) < 1e-4, f"{r} token {i}: {x} vs {y}"
                return
            assert abs(la.logprob - lb.logprob) < 1e-4


def test_decode_steps_through_the_static_buffers_equal_eager_steps(tiny_model_dir):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (interpreted on a CPU)
    model = load_model(tiny_model_dir("llama"), dtype="float32", backend=TritonPagedBackend(), device=device)
    eager, eager_caches = run_requests(model, False, device, 4, capture=False)
    padded, padded_caches = run_requests(model, True, device, 4, capture=False)
    same_tokens(eager, padded)
    for e, p in zip(eager_caches, padded_caches, strict=True):  # the real blocks alike; padding in the scratch one
        torch.testing.assert_close(p.k[:NUM_BLOCKS], e.k[:NUM_BLOCKS], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(p.v[:NUM_BLOCKS], e.v[:NUM_BLOCKS], atol=1e-5, rtol=1e-5)
    scratch = padded_caches[0].k[NUM_BLOCKS]
    assert bool(scratch.abs().sum() > 0) and not bool(eager_caches[0].k[NUM_BLOCKS].abs().sum() > 0)


def test_graphs_refuse_steps_they_do_not_cover(tiny_model_dir):
    model = load_model(tiny_model_dir("llama"), dtype="float32", backend=TritonPagedBackend())
    cfg, backend = model.config, TritonPagedBackend()
    caches = allocate_kv_cache(backend, cfg.num_layers, 5, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    graphs = DecodeGraphs(model, caches, backend, BLOCK, 32, 4, [1, 2], capture=False)
    assert graphs.covers([1, 1]) and not graphs.covers([1, 1, 1]) and not graphs.covers([2]) and not graphs.covers([])
    with pytest.raises(ValueError, match="not a graphed decode step"):
        graphs.build_metadata([3], [3], [[0]], BLOCK)
    with pytest.raises(ValueError, match="build_metadata first"):
        graphs.forward(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))


@pytest.mark.gpu
@NEEDS_CUDA
def test_captured_graphs_replay_what_eager_steps_compute(tiny_model_dir):
    cuda = torch.device("cuda")
    model = load_model(tiny_model_dir("llama"), dtype="float32", backend=TritonPagedBackend(), device=cuda)
    eager, _ = run_requests(model, False, cuda, 12, capture=False)
    graphed, _ = run_requests(model, True, cuda, 12, capture=True)
    same_tokens(eager, graphed)


@pytest.mark.gpu
@NEEDS_CUDA
def test_the_worker_on_a_gpu_captures_graphs_and_equals_its_eager_self(tiny_model_dir):
    from tokenmill.config import EngineConfig
    from tokenmill.runner.worker import Worker

    results = {}
    for eager in (True, False):
        config = EngineConfig(model=str(tiny_model_dir("llama")), device="cuda", dtype="float32",
                              enforce_eager=eager, max_num_seqs=4, block_size=BLOCK, kv_cache_memory=2**26)  # fmt: skip
        worker = Worker(config)
        assert worker.backend.name == "triton"  # auto on CUDA
        assert (worker.runner.graphs is None) == eager
        if not eager:
            assert worker.runner.graphs.sizes == [1, 2, 4]
            assert worker.runner.kv_caches[0].k.shape[0] == worker.num_blocks + 1  # the scratch block
        results[eager] = drive(worker.execute, 20)
        del worker  # (its cache freed before the next one is sized)
        torch.cuda.empty_cache()
    same_tokens(results[True], results[False])
