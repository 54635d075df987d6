"""`make compat`'s client scripts (compat/run.py) run here with the main venv's openai client, against
in-process servers on tiny make-model folders: the embeddings check passes against an embedding model
(its one line names what it checked) and fails (non-zero, the assertion in its output) against a server
whose answers are wrong for it (a model that does not embed, a width that is not the model's). The
same scripts run in `make compat` from the pinned tools venv against `tokenmill serve`."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.server_harness import RunningServer, start_server
from tokenmill.tools.make_model import write_sentence_transformers

ROOT = Path(__file__).resolve().parents[2]


def compat_run() -> Any:
    spec = importlib.util.spec_from_file_location("compat_run", ROOT / "compat" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check(script: str, url: str, width: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script, url, str(width)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def embedder(tiny_model_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("embedder") / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    write_sentence_transformers(folder, "last")
    return folder


def no_leaks(server: RunningServer) -> None:
    stats = server.wait_all_free()
    assert stats.kv_blocks_free == stats.kv_blocks_total, stats


def test_the_embeddings_check_passes_on_an_embedder_and_fails_where_it_should(embedder, tiny_model_dir):
    script = compat_run().EMBEDDINGS_CHECK
    width = json.loads((embedder / "config.json").read_text())["hidden_size"]
    server = start_server(str(embedder))
    try:
        done = check(script, server.base_url, width)
        assert done.returncode == 0, done.stderr
        assert f"4 texts x {width} floats" in done.stdout and "base64 decodes to the float answer" in done.stdout
        wrong = check(script, server.base_url, width * 2)  # a width that is not the model's
        assert wrong.returncode != 0 and "AssertionError" in wrong.stderr
        no_leaks(server)
    finally:
        server.stop()
    generator = start_server(str(tiny_model_dir("llama")))  # serves generation only: a 400 to embeddings
    try:
        refused = check(script, generator.base_url, width)
        assert refused.returncode != 0 and "not embeddings" in refused.stderr, refused.stderr
        no_leaks(generator)
    finally:
        generator.stop()
