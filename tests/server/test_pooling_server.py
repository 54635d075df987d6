"""/v1/embeddings, /v1/rerank and /v1/score over HTTP: the official openai client, raw httpx, and
transformers as the oracle (last hidden state pooled; a reranker's yes/no logits)."""

from __future__ import annotations

import base64
import json
import shutil
import struct
import threading

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from tests.server_harness import RunningServer, start_server
from tokenmill.server.validation import RequestCaps
from tokenmill.tools.make_model import write_sentence_transformers

API_KEY = "test-key"
TIMEOUT = httpx.Timeout(30.0)
TOL = 1e-4
LIMITS = RequestCaps(max_n=4, max_pooling_inputs=8)
DOCS = ["def fibonacci(n): return n", "the quick brown fox", "fibonacci numbers", "import numpy as np"]


def post(srv: RunningServer, path: str, body: object, key: str | None = API_KEY) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(f"{srv.base_url}{path}", content=json.dumps(body).encode(), headers=headers, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def embedder(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("embedder") / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    write_sentence_transformers(folder, "last")
    return folder


@pytest.fixture(scope="module")
def srv(embedder) -> RunningServer:
    running = start_server(str(embedder), api_key=API_KEY, limits=LIMITS)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def rerank_srv(tiny_model_dir) -> RunningServer:
    running = start_server(str(tiny_model_dir("qwen3")), api_key=API_KEY, limits=LIMITS, task="rerank")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def hf():
    import transformers

    models: dict = {}

    def model(folder):
        if folder not in models:
            models[folder] = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        return models[folder]

    return model


@pytest.fixture
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30.0)


def check_no_leaks(*servers: RunningServer) -> None:
    for s in servers:
        stats = s.wait_all_free()
        assert stats.kv_blocks_free == stats.kv_blocks_total, stats


@pytest.fixture(autouse=True)
def no_leaks(srv):
    yield
    check_no_leaks(srv)


def oracle(hf, folder, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf(folder)(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    return F.normalize(hidden[-1].float(), dim=-1)


def test_openai_client_embeddings_equal_transformers(srv, client, embedder, hf):
    """The client asks for base64 by default (little-endian float32, decoded with numpy); float too."""
    tok = srv.server.tokenizer
    texts = ["hello world", "def fibonacci(n):\n    return n"]
    by_default = client.embeddings.create(model="tiny", input=texts)
    as_floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    assert by_default.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts) == as_floats.usage.total_tokens
    for i, text in enumerate(texts):
        ref = oracle(hf, embedder, tok.encode(text))
        for response in (by_default, as_floats):
            assert response.data[i].index == i
            got = torch.tensor(response.data[i].embedding)
            assert got.shape == (128,) and (got - ref).abs().max().item() <= TOL


def test_every_input_shape_and_base64_bytes(srv):
    tok = srv.server.tokenizer
    ids = tok.encode("hello world")
    shapes = ["hello world", ["hello world", "x"], ids, [ids, [5, 6, 7]]]
    vectors = []
    for value in shapes:
        body = post(srv, "/v1/embeddings", {"input": value, "encoding_format": "float"}).json()
        vectors.append(body["data"][0]["embedding"])
        assert len(body["data"]) == (2 if isinstance(value, list) and not isinstance(value[0], int) else 1)
    for v in vectors:  # text and its token ids: one embedding (up to float noise of other batch shapes)
        assert v == pytest.approx(vectors[0], abs=1e-6)
    raw = post(srv, "/v1/embeddings", {"input": "hello world", "encoding_format": "base64"}).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(vectors[0], abs=1e-6)
    assert raw["object"] == "list" and raw["model"] == "tiny" and raw["data"][0]["object"] == "embedding"


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"input": ["a"] * 9}, 400, "input", "invalid_value"),  # past max_pooling_inputs (8)
        ({"input": ["a", [3] * 300]}, 400, "input[1]", "invalid_value"),  # mixed shapes
        ({"input": [[3] * 10, [3] * 300]}, 400, "input[1]", "context_length_exceeded"),
        ({"input": [[3], [5000]]}, 400, "input[1]", "invalid_value"),  # outside the vocabulary
        ({"input": "a", "dimensions": 8}, 400, "dimensions", "invalid_value"),  # no Matryoshka config
        ({"input": "a", "encoding_format": "hex"}, 400, "encoding_format", "invalid_value"),
        ({"input": ""}, 400, "input", "invalid_value"),
        ({"input": "a", "model": "other"}, 400, "model", "model_not_found"),
    ],
)
def test_refusals_name_the_field(srv, body, status, param, code):
    r = post(srv, "/v1/embeddings", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error


def test_truncate_prompt_tokens_keeps_the_last_tokens(srv):
    long = post(srv, "/v1/embeddings", {"input": [[3] * 10 + [7] * 300], "truncate_prompt_tokens": 200}).json()
    short = post(srv, "/v1/embeddings", {"input": [[7] * 200]}).json()
    assert long["usage"]["prompt_tokens"] == 200
    assert long["data"][0]["embedding"] == pytest.approx(short["data"][0]["embedding"], abs=1e-6)


def test_every_pooling_endpoint_needs_the_key(srv):
    for path, body in (
        ("/v1/embeddings", {"input": "a"}),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
    ):
        assert post(srv, path, body, key=None).status_code == 401
        assert post(srv, path, body, key="wrong").status_code == 401


def test_embeddings_batched_with_a_stream(srv, client):
    """An embeddings request while a completion streams: both answered, the stream unchanged."""
    alone = client.completions.create(model="tiny", prompt="once upon", max_tokens=24, temperature=0).choices[0].text
    texts: list[str] = []

    def stream() -> None:
        chunks = client.completions.create(model="tiny", prompt="once upon", max_tokens=24, temperature=0, stream=True)
        texts.append("".join(c.choices[0].text for c in chunks))

    thread = threading.Thread(target=stream)
    thread.start()
    for _ in range(3):
        assert len(client.embeddings.create(model="tiny", input=DOCS).data) == len(DOCS)
    thread.join(30)
    assert texts == [alone]


def test_rerank_and_score_by_cosine_on_an_embedding_model(srv, embedder, hf):
    tok = srv.server.tokenizer
    query = "fibonacci"
    q = oracle(hf, embedder, tok.encode(query))
    ref = [float(q @ oracle(hf, embedder, tok.encode(d))) for d in DOCS]
    body = post(srv, "/v1/rerank", {"query": query, "documents": [{"text": d} for d in DOCS], "top_n": 3}).json()
    order = sorted(range(len(DOCS)), key=lambda i: -ref[i])[:3]
    assert [r["index"] for r in body["results"]] == order
    for r in body["results"]:
        assert abs(r["relevance_score"] - ref[r["index"]]) <= TOL and r["document"]["text"] == DOCS[r["index"]]
    bare = post(srv, "/rerank", {"query": query, "documents": DOCS, "return_documents": False}).json()
    assert len(bare["results"]) == len(DOCS) and all("document" not in r for r in bare["results"])
    scores = post(srv, "/v1/score", {"text_1": query, "text_2": DOCS}).json()
    assert [d["index"] for d in scores["data"]] == list(range(len(DOCS)))
    assert max(abs(d["score"] - ref[d["index"]]) for d in scores["data"]) <= TOL
    pairwise = post(srv, "/v1/score", {"text_1": [query, query], "text_2": DOCS[:2]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(ref[:2], abs=TOL)
    mismatch = post(srv, "/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert mismatch.status_code == 400 and mismatch.json()["error"]["param"] == "text_2"


def test_reranker_scores_are_p_yes_in_transformers_order(rerank_srv, tiny_model_dir, hf):
    folder = tiny_model_dir("qwen3")
    pooling = rerank_srv.server.engine.processor.pooling
    yes, no = pooling.score_token_ids
    query = "how do I compute fibonacci numbers?"
    ref = []
    for doc in DOCS:
        with torch.no_grad():
            logits = hf(folder)(torch.tensor([pooling.rerank_prompt(query, doc)])).logits[0, -1]
        ref.append(torch.softmax(logits[[yes, no]], dim=-1)[0].item())
    body = post(rerank_srv, "/v1/rerank", {"query": query, "documents": DOCS}).json()
    assert [r["index"] for r in body["results"]] == sorted(range(len(DOCS)), key=lambda i: -ref[i])
    assert max(abs(r["relevance_score"] - ref[r["index"]]) for r in body["results"]) <= TOL
    scores = post(rerank_srv, "/v1/score", {"text_1": query, "text_2": DOCS}).json()
    assert [d["score"] for d in scores["data"]] == pytest.approx(ref, abs=TOL)
    refused = post(rerank_srv, "/v1/embeddings", {"input": "a"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_task"
    check_no_leaks(rerank_srv)


def test_openapi_documents_the_pooling_endpoints(srv):
    spec = httpx.get(f"{srv.base_url}/openapi.json", headers={"authorization": f"Bearer {API_KEY}"}).json()
    for path in ("/v1/embeddings", "/v1/rerank", "/v1/score"):
        assert "post" in spec["paths"][path]
    schemas = spec["components"]["schemas"]
    embed = schemas["EmbeddingRequest"]["properties"]
    arrays = [o for o in embed["input"]["anyOf"] if o.get("type") == "array"]
    assert [o.get("maxItems") for o in arrays if o["items"].get("type") != "integer"] == [8, 8]
    assert schemas["RerankRequest"]["properties"]["documents"]["maxItems"] == 8
