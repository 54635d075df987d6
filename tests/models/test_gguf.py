"""GGUF files load directly: logits equal transformers' on the same file for every tensor type, the
tokenizer equals the model folder's, `tokenmill convert` writes a folder both load, and a bad file
gives an error naming the file and the problem. The files are the bundled demo model written with
`gguf`'s writer (tests/gguf_files.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.gguf_files import reference_model, write_gguf
from tests.helpers import PagedRunner, assert_logits_close
from tokenmill import LLM, SamplingParams
from tokenmill.engine_args import DEMO_MODEL
from tokenmill.models.config import ModelLoadError
from tokenmill.models.gguf_checkpoint import GGUFCheckpoint, permute_rotary_rows, unpermute_rotary_rows
from tokenmill.models.loader import load_model
from tokenmill.text.tokenizer import Tokenizer
from tokenmill.tools.gguf_convert import convert_gguf

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS")
# ~2 s a type: the default run keeps one of each family (the rest: `make test-all`; every type's blocks
# against gguf's dequantizer: tests/quant). Q2_K, IQ4_XS: dequantized at load, no kernel of their own.
SLOW_TYPES = ("F32", "BF16", "Q4_0", "Q5_K", "Q2_K", "IQ4_XS")
TEXTS = (
    "Hello world, 12345 apples!",
    "  two spaces\n\nnewlines\ttabs",
    "café ünïcödé 😀",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x ** 2 + 10",
)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """type name -> the demo model written as a GGUF of that type (built on first request)."""
    folder = tmp_path_factory.mktemp("gguf")
    made: dict[str, Path] = {}

    def get(type_name: str) -> Path:
        if type_name not in made:
            made[type_name] = write_gguf(DEMO_MODEL, folder / f"demo-{type_name}.gguf", type_name)
        return made[type_name]

    return get


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    runner = PagedRunner(model, num_blocks=8, block_size=16, block_order=[3, 1, 7, 0, 5, 2, 6, 4])
    return runner.step({0: ids})[0]


IDS = torch.randint(0, 8192, (45,), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("type_name", [pytest.param(t, marks=[pytest.mark.slow] * (t in SLOW_TYPES)) for t in TYPES])
def test_logits_equal_transformers_on_the_same_file(gguf_file, type_name):
    path = gguf_file(type_name)
    with torch.no_grad():
        ref = reference_model(path)(IDS[None]).logits[0]
    assert_logits_close(logits(load_model(path, dtype="float32"), IDS), ref)


def test_f32_file_equals_the_folder_it_was_written_from(gguf_file):
    """The name map and the Q/K row order, checked without transformers' GGUF loader: the demo's
    bfloat16 weights are exact in float32, so the file's model is the folder's."""
    ours = logits(load_model(gguf_file("F32"), dtype="float32"), IDS)
    assert_logits_close(ours, logits(load_model(DEMO_MODEL, dtype="float32"), IDS), rel=1e-6)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_files_equal_the_folders_they_were_written_from(tiny_model_dir, tmp_path, arch):
    """qwen2 (q/k/v biases, yarn RoPE scaling) and qwen3 (q/k norms, head_dim 48 with hidden 128): their
    Q/K rows are not permuted by llama.cpp, and the metadata carries the rope scaling."""
    folder = tiny_model_dir(arch)
    path = write_gguf(folder, tmp_path / f"{arch}.gguf", "F32", arch=arch)
    ours, ref = load_model(path, dtype="float32"), load_model(folder, dtype="float32")
    assert ours.config.rope == ref.config.rope and ours.config.head_dim == ref.config.head_dim
    ids = torch.randint(0, 4096, (45,), generator=torch.Generator().manual_seed(5))
    assert_logits_close(logits(ours, ids), logits(ref, ids), rel=1e-6)


def test_rotary_row_order_round_trips():
    w = torch.randn(6 * 8, 5)
    assert torch.equal(unpermute_rotary_rows(permute_rotary_rows(w, 6), 6), w)
    b = torch.arange(2 * 4.0)  # one head of 8 rows: llama.cpp interleaves the two halves
    assert unpermute_rotary_rows(b, 1).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


def test_config_from_metadata(gguf_file):
    ckpt = GGUFCheckpoint(gguf_file("Q8_0"))
    folder = json.loads((DEMO_MODEL / "config.json").read_text())
    cfg = ckpt.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (4, 256, 768)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (8, 2, 32, 8192)
    assert cfg.tie_word_embeddings and cfg.rope.theta == folder["rope_parameters"]["rope_theta"]
    assert cfg.rms_norm_eps == pytest.approx(folder["rms_norm_eps"])
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (0, (1,))
    assert ckpt.native_dtype() == "float32" and GGUFCheckpoint(gguf_file("F16")).native_dtype() == "float16"


def test_tokenizer_equals_the_folders(gguf_file):
    ours, folder = Tokenizer(gguf_file("Q8_0")), Tokenizer(DEMO_MODEL)
    for text in TEXTS:
        assert ours.encode(text) == folder.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == folder.decode(
            folder.encode(text), skip_special_tokens=False
        )
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ours.apply_chat_template(chat) == folder.apply_chat_template(chat)
    assert ours.info.bos_token_id == folder.info.bos_token_id == 0
    # EOS from the metadata, and <|im_end|> (a control token that ends a turn), as the folder's generation_config
    assert set(ours.info.eos_token_ids) == set(folder.info.eos_token_ids) == {1, 4}


def test_smollm_pre_tokenizer_splits_digits_one_by_one(gguf_file, tmp_path):
    """llama.cpp's `smollm` tag: each digit alone, where GPT-2's split keeps ' 1234' whole for the merges."""
    smollm = Tokenizer(write_gguf(DEMO_MODEL, tmp_path / "smollm.gguf", "F16", pre="smollm"))
    gpt2 = Tokenizer(gguf_file("F16"))
    text = "I have 1234 apples and 56 pears"
    assert "Ġ1234" in gpt2.convert_ids_to_tokens(gpt2.encode(text))
    pieces = smollm.convert_ids_to_tokens(smollm.encode(text))
    assert pieces[pieces.index("Ġ") + 1 :][:4] == ["1", "2", "3", "4"]
    assert all(not any(c.isdigit() for c in p) or len(p) == 1 for p in pieces)
    assert smollm.decode(smollm.encode(text)) == text


def test_engine_on_the_file_generates_as_on_the_folder(gguf_file):
    prompts = ["def fibonacci(n):", "import os\n"]
    params = SamplingParams(temperature=0, max_tokens=16)
    kwargs = {"dtype": "float32", "kv_cache_memory": 16 * 2**20, "max_num_seqs": 4}
    on_file, on_folder = LLM(str(gguf_file("F32")), **kwargs), LLM(str(DEMO_MODEL), **kwargs)
    a = on_file.generate(prompts, params, use_tqdm=False)
    b = on_folder.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert [o.prompt_token_ids for o in a] == [o.prompt_token_ids for o in b]
    # LLM.chat: the chat template (from the GGUF's metadata), one conversation or several
    talks = [[{"role": "user", "content": "def add(a, b):"}], [{"role": "user", "content": "import sys"}]]
    chats = on_file.chat(talks, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in chats] == [on_folder.engine.tokenizer.apply_chat_template(t) for t in talks]
    assert [o.outputs[0].token_ids for o in chats] == [
        o.outputs[0].token_ids for o in on_folder.chat(talks, params, use_tqdm=False)
    ]
    assert on_file.chat(talks[0], params, use_tqdm=False)[0].outputs[0].token_ids == chats[0].outputs[0].token_ids


@pytest.mark.parametrize("type_name", ["Q4_K", "F16"])
def test_convert_writes_a_folder_transformers_and_tokenmill_load(gguf_file, tmp_path, type_name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_file(type_name)
    out = convert_gguf(path, tmp_path / "converted")
    written = json.loads((out / "config.json").read_text())
    assert written["dtype"] == ("float16" if type_name == "F16" else "float32")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [1, 4]
    with torch.no_grad():
        ref = reference_model(path)(IDS[None]).logits[0]
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(IDS[None]).logits[0]
    assert_logits_close(hf, ref)
    assert_logits_close(logits(load_model(out, dtype="float32"), IDS), ref)
    hf_tok, ours = AutoTokenizer.from_pretrained(out), Tokenizer(path)
    for text in TEXTS:
        assert hf_tok.encode(text) == ours.encode(text), text
    chat = [{"role": "user", "content": "hi"}]
    assert Tokenizer(out).apply_chat_template(chat) == ours.apply_chat_template(chat)
    with pytest.raises(ValueError, match="already exists"):
        convert_gguf(path, out)


# --- bad files: an error naming the file and the problem ---------------------------------------


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a GGUF file at all" * 10)
    with pytest.raises(ModelLoadError, match=r"junk\.gguf: not a readable GGUF file"):
        load_model(path)


def test_truncated_file(gguf_file, tmp_path):
    path = tmp_path / "cut.gguf"
    data = gguf_file("Q4_0").read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: not a readable GGUF file"):
        load_model(path)


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "absent.gguf")


def test_another_architecture(tmp_path):
    path = write_gguf(DEMO_MODEL, tmp_path / "falcon.gguf", "F16", arch="falcon")
    with pytest.raises(ModelLoadError, match=r"falcon\.gguf: GGUF key 'general.architecture' is 'falcon'"):
        load_model(path)


def test_unsupported_tensor_type(tmp_path):
    path = write_gguf(DEMO_MODEL, tmp_path / "tq1.gguf", "TQ1_0")
    with pytest.raises(ModelLoadError, match=r"tq1\.gguf: tensor 'token_embd.weight' has type TQ1_0; tokenmill reads"):
        load_model(path)


def test_a_type_without_a_kernel_is_dequantized_with_a_warning(gguf_file, caplog):
    """A Q2_K file (a Q2_K download) loads, its matrices dequantized at load, and the log says so and
    what it costs; the engine generates on it."""
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        llm = LLM(str(gguf_file("Q2_K")), max_model_len=128, enable_prefix_caching=False)
    assert "GGUF Q2_K: no kernel here reads these types as stored" in caplog.text
    model = llm.engine.core.worker.runner.model
    assert isinstance(model.embed_tokens, torch.nn.Embedding)  # (the table too: dense)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    assert llm.engine.core.scheduler.kv.num_free_blocks == llm.engine.core.scheduler.kv.num_blocks


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("llama.block_count", "GGUF key 'llama.block_count' is missing"),
        ("llama.attention.head_count", "GGUF key 'llama.attention.head_count' is missing"),
    ],
)
def test_missing_metadata_key(tmp_path, key, message):
    path = write_gguf(DEMO_MODEL, tmp_path / "nokey.gguf", "F16", drop_keys=(key,))
    with pytest.raises(ModelLoadError, match=rf"nokey\.gguf: {message}"):
        load_model(path)


def test_inconsistent_metadata_names_the_gguf_key(tmp_path):
    """A value parse_config rejects is reported under the GGUF key that gave it."""
    path = write_gguf(DEMO_MODEL, tmp_path / "kv3.gguf", "F16", set_keys={"llama.attention.head_count_kv": 3})
    with pytest.raises(ModelLoadError, match=r"kv3\.gguf: GGUF key 'llama.attention.head_count_kv' \(3\) must divide"):
        load_model(path)


def test_metadata_that_disagrees_with_the_tensors(tmp_path):
    path = write_gguf(DEMO_MODEL, tmp_path / "heads.gguf", "F16", drop_keys=("llama.attention.head_count_kv",))
    ckpt_cfg = GGUFCheckpoint(path).config  # absent KV head count: one per query head (MHA), as config.json
    assert ckpt_cfg.num_kv_heads == 8
    with pytest.raises(ModelLoadError, match=r"heads\.gguf: tensor 'model.layers.0.self_attn.k_proj.weight'"):
        load_model(path)  # the file's K rows are for 2 heads: the shape check names the tensor


def test_an_unknown_rope_scaling_names_its_gguf_key(tiny_model_dir, tmp_path):
    path = write_gguf(tiny_model_dir("qwen2"), tmp_path / "rope.gguf", "F32", arch="qwen2")
    import gguf

    reader = gguf.GGUFReader(str(path), "r+")  # overwrite the 4-byte scaling type string in place: yarn -> long
    field = reader.fields["qwen2.rope.scaling.type"]
    field.parts[field.data[0]][:] = np.frombuffer(b"long", dtype=np.uint8)
    del reader
    with pytest.raises(ModelLoadError, match=r"rope\.gguf: GGUF key 'qwen2.rope.scaling.type' is 'long'"):
        load_model(path)
