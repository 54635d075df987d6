"""What a GGUF start reads once and caches: the file's header (metadata and tensor records) and the
tokenizer it describes. A cached read equals a fresh parse exactly and parses nothing; a cache that
does not read back is a warning and a fresh parse; a file rewritten in place (its size and
modification time kept) is a new key. Float tensors are handed over as stored, and load into every
dtype as the float32 route did, bit for bit."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import gguf
import pytest
import torch

from tests.gguf_files import write_gguf
from tests.models.test_gguf import TEXTS
from tokenmill.engine_args import DEMO_MODEL
from tokenmill.model_files import cache_dir
from tokenmill.models import gguf_checkpoint, gguf_header
from tokenmill.models.gguf_checkpoint import GGUFCheckpoint
from tokenmill.models.loader import load_model
from tokenmill.text import gguf_tokenizer
from tokenmill.text.tokenizer import Tokenizer


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_GGUF_CACHE_DIR", str(tmp_path / "gguf-cache"))
    return tmp_path / "gguf-cache"


def no_parse(*args, **kwargs):
    raise AssertionError("the file was parsed again")


def same_checkpoint(a: GGUFCheckpoint, b: GGUFCheckpoint) -> None:
    assert a.metadata == b.metadata
    assert a.infos == b.infos and a.raw_config == b.raw_config and a.config == b.config
    assert a._stored == b._stored


def test_a_cached_header_equals_the_parse_and_parses_nothing(tmp_path, own_cache, monkeypatch):
    path = write_gguf(DEMO_MODEL, tmp_path / "demo.gguf", "Q8_0")
    first = GGUFCheckpoint(path)
    (written,) = own_cache.glob("*.json")
    monkeypatch.setattr(gguf_header, "parse_header", no_parse)
    again = GGUFCheckpoint(path)
    same_checkpoint(again, first)
    assert isinstance(again.metadata["tokenizer.ggml.tokens"], list) and written.is_file()
    # every tensor reads back the same through the cached records
    for (n1, t1), (n2, t2) in zip(first.tensors(), again.tensors(), strict=True):
        assert n1 == n2 and t1.dtype == t2.dtype and torch.equal(t1, t2), n1


def test_a_bad_header_cache_is_parsed_again_and_rewritten(tmp_path, own_cache, caplog):
    path = write_gguf(DEMO_MODEL, tmp_path / "demo.gguf", "F16")
    first = GGUFCheckpoint(path)
    (written,) = own_cache.glob("*.json")
    written.write_text(written.read_text()[:1000])  # cut short
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        again = GGUFCheckpoint(path)
    assert "unusable" in caplog.text
    same_checkpoint(again, first)
    assert GGUFCheckpoint(path).metadata == first.metadata  # rewritten whole


def test_a_file_rewritten_in_place_is_a_new_key(tmp_path, own_cache):
    path = write_gguf(DEMO_MODEL, tmp_path / "demo.gguf", "F16")
    stat = path.stat()
    assert GGUFCheckpoint(path).config.max_position_embeddings != 777
    reader = gguf.GGUFReader(str(path), "r+")  # one value overwritten: the same size
    field = reader.fields["llama.context_length"]
    field.parts[field.data[0]][...] = 777
    del reader
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same modification time
    assert path.stat().st_size == stat.st_size
    assert GGUFCheckpoint(path).config.max_position_embeddings == 777
    assert len(list(own_cache.glob("*.json"))) == 2


@pytest.mark.parametrize("type_name", ["F16", "BF16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float_tensors_load_as_through_float32(tmp_path, monkeypatch, type_name, dtype):
    """F16 / BF16 handed over as stored: every parameter equals a load through the `gguf` package's
    float32 dequantization, bit for bit."""
    path = write_gguf(DEMO_MODEL, tmp_path / f"demo-{type_name}.gguf", type_name)
    direct = dict(load_model(path, dtype=dtype).named_parameters())
    monkeypatch.setattr(gguf_checkpoint, "FLOAT_TYPES", {})  # every type through gguf.quants.dequantize
    through = dict(load_model(path, dtype=dtype).named_parameters())
    assert direct.keys() == through.keys()
    for name, param in direct.items():
        assert param.dtype == dtype and torch.equal(param, through[name]), name


def test_a_cached_tokenizer_equals_the_built_one_and_builds_nothing(tmp_path, own_cache, monkeypatch):
    path = write_gguf(DEMO_MODEL, tmp_path / "smollm.gguf", "F16", pre="smollm")
    built = Tokenizer(path)
    (folder,) = own_cache.glob("*-tokenizer")
    monkeypatch.setattr(gguf_tokenizer, "load_gguf_tokenizer", no_parse)
    cached = Tokenizer(path)
    assert cached.info == built.info
    for text in (*TEXTS, "I have 1234 apples and 56 pears"):
        for special in (True, False):
            ids = built.encode(text, add_special_tokens=special)
            assert cached.encode(text, add_special_tokens=special) == ids, text
            assert cached.decode(ids, skip_special_tokens=False) == built.decode(ids, skip_special_tokens=False)
    chat = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]
    assert cached.apply_chat_template(chat) == built.apply_chat_template(chat)
    assert len(cached.hf) == len(built.hf) and cached.hf.all_special_ids == built.hf.all_special_ids
    # a cached folder that does not load: a warning, built from the file again, rewritten
    (folder / "tokenizer.json").write_text("{")
    monkeypatch.undo()
    monkeypatch.setenv("TOKENMILL_GGUF_CACHE_DIR", str(own_cache))
    again = Tokenizer(path)
    assert again.encode(TEXTS[0]) == built.encode(TEXTS[0])
    assert (folder / "tokenizer.json").stat().st_size > 1000


def test_the_caches_go_where_the_environment_says(tmp_path, monkeypatch):
    monkeypatch.delenv("TOKENMILL_GGUF_CACHE_DIR", raising=False)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "all"))
    assert cache_dir("gguf") == tmp_path / "all" / "gguf"
    monkeypatch.setenv("TOKENMILL_GGUF_CACHE_DIR", str(tmp_path / "own"))
    assert cache_dir("gguf") == tmp_path / "own"


def test_an_empty_cache_variable_means_the_default_not_the_working_folder(monkeypatch):
    from tokenmill.kernels.autotune import default_cache_path
    from tokenmill.kernels.cpu_build import cache_root

    home = Path.home() / ".cache" / "tokenmill"
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", "")
    monkeypatch.setenv("TOKENMILL_GGUF_CACHE_DIR", "")
    monkeypatch.setenv("TOKENMILL_AUTOTUNE_CACHE_DIR", "")
    assert cache_dir("gguf") == home / "gguf"
    assert cache_root() == home / "kernels"
    assert default_cache_path() == home / "autotune.json"
