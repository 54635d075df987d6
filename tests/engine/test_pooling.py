"""Pooling requests (embeddings, rerank and score) through the engine, against transformers.

Oracles: the embedding of a prompt is transformers' last hidden state (after the final norm,
`output_hidden_states`) pooled the same way (last token, mean, first token) and normalized, within
1e-4 in float32, on make-model folders of the Llama, Qwen2 and Qwen3 families with sentence-transformers'
pooling config; a reranker's score is the softmax over transformers' "yes" and "no" logits at the
prompt's last position, and its order the order of those. The engine's side: chunked prefill,
batching with generation, prefix-cache hits for last-token pooling, preemption, no leaked KV blocks.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tokenmill import LLM, SamplingParams
from tokenmill.engine.pooling import UnsupportedTask
from tokenmill.errors import ParamError
from tokenmill.pooling_params import PoolingParams
from tokenmill.tools.make_model import write_sentence_transformers

FAMILIES = ("llama", "qwen2", "qwen3")
TOL = 1e-4
TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2,
    "short",
    "The quick brown fox jumps over the lazy dog.",
    "import numpy as np\nx = np.zeros((3, 4))",
]
KV_BLOCK_BYTES = {"llama": 24576, "qwen2": 24576, "qwen3": 36864}  # one 16-token block, float32, all layers


def embedder_dir(tiny_model_dir, tmp_path_factory, arch: str, pooling: str) -> Path:
    out = tmp_path_factory.mktemp(f"{arch}-{pooling}-embedder") / "model"
    shutil.copytree(tiny_model_dir(arch), out)
    write_sentence_transformers(out, pooling)
    return out


@pytest.fixture(scope="module")
def hf_hidden():
    """(folder, token ids) -> transformers' last hidden state [L, hidden] (after the final norm), float32."""
    import transformers

    models: dict[Path, torch.nn.Module] = {}

    def run(folder: Path, ids: list[int]) -> torch.Tensor:
        if folder not in models:
            models[folder] = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            out = models[folder](torch.tensor([ids]), output_hidden_states=True)
        return out.hidden_states[-1][0].float()

    return run


def pooled(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    return {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]


def run_one(engine) -> Any:
    """Step until the one request added finishes; its output."""
    while True:
        for out in engine.step():
            if out.finished:
                return out


def no_leaks(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0, stats


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_model_dir, tmp_path_factory):
    """(arch, folder with mean pooling in its sentence-transformers config, an LLM on it)."""
    arch = request.param
    folder = embedder_dir(tiny_model_dir, tmp_path_factory, arch, "mean")
    blocks = 24  # 384 tokens: the batch below preempts
    llm = LLM(str(folder), max_model_len=256, kv_cache_memory=blocks * KV_BLOCK_BYTES[arch], max_num_batched_tokens=32)
    return arch, folder, llm


def test_embeddings_equal_transformers_pooled_hidden_states(family, hf_hidden):
    """Mean pooling from the folder's config, in chunks of 32 tokens (prompts of 1 to 66 tokens)."""
    _, folder, llm = family
    outs = llm.embed(TEXTS, use_tqdm=False)
    worst = 0.0
    for out in outs:
        ref = F.normalize(pooled(hf_hidden(folder, out.prompt_token_ids), "mean"), dim=-1)
        ours = torch.tensor(out.outputs.embedding)
        assert ours.shape == ref.shape
        worst = max(worst, (ours - ref).abs().max().item())
    assert worst <= TOL, worst
    assert max(len(o.prompt_token_ids) for o in outs) > 32  # (chunked)
    no_leaks(llm)


@pytest.mark.parametrize("pooling", ["last", "cls", "mean"])
def test_each_pooling_equals_transformers_batched_with_generation(family, hf_hidden, pooling):
    """Pooling requests of each type in the same steps as generating requests: the embeddings equal the
    oracle and the generated tokens equal those of the generation alone."""
    _, folder, llm = family
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0)
    alone = llm.generate(TEXTS[:2], params, use_tqdm=False)
    for i, text in enumerate(TEXTS[:2]):
        engine.add_request(f"gen-{pooling}-{i}", text, params)
    for i, text in enumerate(TEXTS):
        engine.add_pooling_request(f"pool-{pooling}-{i}", text, PoolingParams(pooling=pooling, normalize=False))
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    for i in range(2):
        assert done[f"gen-{pooling}-{i}"].outputs[0].token_ids == alone[i].outputs[0].token_ids
    for i in range(len(TEXTS)):
        out = done[f"pool-{pooling}-{i}"]
        ref = pooled(hf_hidden(folder, out.prompt_token_ids), pooling)
        assert (torch.tensor(out.pooled) - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item())
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "stop"
    no_leaks(llm)


def test_preempted_pooling_requests_count_each_position_once(family, hf_hidden):
    """Generating requests outgrow the 24 blocks while pooling requests compute their prompts: pooling
    requests are preempted mid-prompt and start over; their mean embeddings still equal the oracle."""
    _, folder, llm = family
    engine, scheduler = llm.engine, llm.engine.core.scheduler
    victims = []
    preempt = scheduler._preempt

    def recording(request):
        victims.append(request.pooling is not None and 0 < request.num_computed_tokens < request.num_prompt_tokens)
        preempt(request)

    scheduler._preempt = recording
    try:
        for i in range(3):
            engine.add_request(f"long-{i}", f"{i} once upon a time", SamplingParams(max_tokens=200, ignore_eos=True))
        done = {}
        while llm.stats().kv_blocks_free > 6:  # the generators hold most of the cache
            done |= {o.request_id: o for o in engine.step() if o.finished}
        long_texts = [f"{i} " + TEXTS[0] for i in range(8)]
        for i, text in enumerate(long_texts):
            engine.add_pooling_request(f"pre-{i}", text, PoolingParams(pooling="mean"))
        while engine.has_unfinished_requests():
            done |= {o.request_id: o for o in engine.step() if o.finished}
    finally:
        scheduler._preempt = preempt
    assert any(victims), victims  # a pooling request was preempted mid-prompt
    for i in range(len(long_texts)):
        out = done[f"pre-{i}"]
        ref = F.normalize(pooled(hf_hidden(folder, out.prompt_token_ids), "mean"), dim=-1)
        assert (torch.tensor(out.pooled) - ref).abs().max().item() <= TOL
    no_leaks(llm)


def test_last_token_pooling_reuses_the_prefix_cache(family, hf_hidden):
    """Last-token pooling may start at a cached prefix (only the last position is read); mean pooling
    computes every position however much is cached. Both give the oracle's vector again."""
    _, folder, llm = family
    engine = llm.engine
    text = TEXTS[0]
    for pooling, hit in (("last", True), ("mean", False)):
        outs = []
        for k in range(2):
            engine.add_pooling_request(f"cache-{pooling}-{k}", text, PoolingParams(pooling=pooling))
            while engine.has_unfinished_requests():
                outs += [o for o in engine.step() if o.finished]
        ref = F.normalize(pooled(hf_hidden(folder, outs[0].prompt_token_ids), pooling), dim=-1)
        for out in outs:
            assert (torch.tensor(out.pooled) - ref).abs().max().item() <= TOL
        assert (outs[1].num_cached_tokens > 0) is hit, (pooling, outs[1].num_cached_tokens)
    no_leaks(llm)


def test_dimensions_only_where_the_model_allows_truncation(family, hf_hidden):
    _, folder, llm = family
    with pytest.raises(ParamError, match="dimensions") as e:
        llm.embed("hello", dimensions=16, use_tqdm=False)
    assert e.value.param == "dimensions"
    engine = llm.engine
    engine.add_pooling_request("dims", "hello", PoolingParams(pooling="mean", dimensions=16))
    out = run_one(engine)
    ref = F.normalize(pooled(hf_hidden(folder, out.prompt_token_ids), "mean")[:16], dim=-1)  # truncate, renormalize
    assert len(out.pooled) == 16 and (torch.tensor(out.pooled) - ref).abs().max().item() <= TOL
    no_leaks(llm)


def test_prompt_length_is_checked_at_the_front_door(family):
    _, _, llm = family
    with pytest.raises(ParamError, match="maximum model length") as e:
        llm.embed([[5] * 257], use_tqdm=False)
    assert e.value.param == "prompt"
    assert len(llm.embed([[5] * 256], use_tqdm=False)[0].outputs.embedding) == 128  # exactly the length: fine
    no_leaks(llm)


def test_cosine_scores_of_an_embedding_model(family, hf_hidden):
    _, folder, llm = family
    scores = llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
    tok = llm.engine.tokenizer
    q = F.normalize(pooled(hf_hidden(folder, tok.encode(TEXTS[0])), "mean"), dim=-1)
    for text, s in zip(TEXTS[1:], scores, strict=True):
        d = F.normalize(pooled(hf_hidden(folder, tok.encode(text)), "mean"), dim=-1)
        assert abs(s.outputs.score - float(q @ d)) <= TOL
    no_leaks(llm)


def test_matryoshka_config_and_flags(tiny_model_dir, tmp_path, hf_hidden):
    """config.json's matryoshka_dimensions allow those dimensions only; --pooling overrides the folder."""
    import json

    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir("qwen3"), folder)
    write_sentence_transformers(folder, "cls")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [32, 64]}))
    llm = LLM(str(folder), max_model_len=128, kv_cache_memory=16 * KV_BLOCK_BYTES["qwen3"], pooling="last")
    out = llm.embed("a matryoshka doll", dimensions=32, use_tqdm=False)[0]
    ref = F.normalize(pooled(hf_hidden(folder, out.prompt_token_ids), "last")[:32], dim=-1)
    assert (torch.tensor(out.outputs.embedding) - ref).abs().max().item() <= TOL
    with pytest.raises(ParamError, match="supports 32, 64"):
        llm.embed("x", dimensions=48, use_tqdm=False)
    no_leaks(llm)


@pytest.mark.parametrize("arch", FAMILIES)
def test_rerank_scores_and_order_equal_transformers_yes_no(arch, tiny_model_dir, hf_hidden):
    """A causal LM reranker (task rerank, Qwen3-Reranker's template): p(yes) = softmax(yes, no logits)
    at the last position, as transformers' logits give it; the documents' order the same."""
    import transformers

    folder = tiny_model_dir(arch)
    llm = LLM(str(folder), max_model_len=256, kv_cache_memory=32 * KV_BLOCK_BYTES[arch], task="rerank")
    docs = [*TEXTS, "fibonacci numbers in python", "a fox and a dog"]
    query = "how do I compute fibonacci numbers?"
    scores = [s.outputs.score for s in llm.score(query, docs, use_tqdm=False)]
    pooling = llm.engine.pooling
    yes, no = pooling.score_token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = []
    for doc in docs:
        ids = pooling.rerank_prompt(query, doc)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        ref.append(torch.softmax(logits[[yes, no]], dim=-1)[0].item())
    assert max(abs(a - b) for a, b in zip(scores, ref, strict=True)) <= TOL
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    assert order == sorted(range(len(docs)), key=lambda i: -ref[i])
    with pytest.raises(UnsupportedTask):
        llm.embed("not an embedder", use_tqdm=False)
    no_leaks(llm)


def test_a_generating_model_refuses_pooling(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), max_model_len=64, kv_cache_memory=8 * KV_BLOCK_BYTES["llama"])
    assert llm.engine.pooling.task == "generate"
    with pytest.raises(UnsupportedTask, match="--task embed"):
        llm.embed("x", use_tqdm=False)
    with pytest.raises(UnsupportedTask, match="--task rerank"):
        llm.score("x", "y", use_tqdm=False)


@pytest.mark.parametrize("architecture", ["Qwen3Model", "Qwen3ForCausalLM"])
def test_a_base_model_checkpoint_embeds(tiny_model_dir, tmp_path, architecture):
    """An embedder saved as the base model (tensor names without `model.`, no output projection): as
    `Qwen3Model`, or as Qwen3-Embedding ships it, its config naming `Qwen3ForCausalLM` with tied embeddings.
    Its embeddings equal transformers' base model's last hidden state."""
    import json

    import transformers

    source = tiny_model_dir("qwen3")
    folder = tmp_path / "base"
    base = transformers.AutoModel.from_pretrained(source, dtype=torch.float32).eval()
    base.save_pretrained(folder)
    for file in source.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(file, folder / file.name)
    cfg = json.loads((folder / "config.json").read_text())
    cfg |= {"architectures": [architecture], "tie_word_embeddings": True}
    (folder / "config.json").write_text(json.dumps(cfg))
    write_sentence_transformers(folder, "last")
    llm = LLM(str(folder), max_model_len=128, kv_cache_memory=16 * KV_BLOCK_BYTES["qwen3"])
    for out in llm.embed(TEXTS[1:], use_tqdm=False):
        with torch.no_grad():
            hidden = base(torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
        ref = F.normalize(hidden[-1], dim=-1)
        assert (torch.tensor(out.outputs.embedding) - ref).abs().max().item() <= TOL
    no_leaks(llm)


def test_pooling_messages_cross_a_process_boundary():
    """A pooling request and its vector survive the core's JSON messages (Ray replicas send them)."""
    from tokenmill.engine.messages import EngineCoreOutput, EngineCoreRequest, decode, encode

    request = EngineCoreRequest(
        "r", [1, 2], SamplingParams(), 0, 0, [], 0.0, pooling=PoolingParams(task="score", score_token_ids=(5, 6))
    )
    assert decode(encode(request), EngineCoreRequest) == request
    output = EngineCoreOutput("r", finish_reason="stop", pooled=[0.25, -1.5])
    assert decode(encode(output), EngineCoreOutput) == output
