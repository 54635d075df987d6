"""Shared fixtures: tiny random-weight checkpoints of each family, built offline once per session,
and transformers' logits on them as the reference."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported (its standard library's @jit helpers are made
# then), and torch.compile imports it: without CUDA, set it before any test can, so the Triton backend's
# tests run under the interpreter whatever ran before them
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenmill.tools.make_model import ARCHS, make_model

# Sharded checkpoints (with an index file) for two families, single files for the others.
SHARDED = {"llama", "qwen3"}


@pytest.fixture(scope="session", autouse=True)
def _quantized_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Quantized weights, GGUF headers and tokenizers, and kernel choices the tests cache go to this
    session's folders, not the user's cache."""
    os.environ.setdefault("TOKENMILL_QUANTIZED_CACHE_DIR", str(tmp_path_factory.mktemp("quantized-cache")))
    os.environ.setdefault("TOKENMILL_GGUF_CACHE_DIR", str(tmp_path_factory.mktemp("gguf-cache")))
    # (and kernel choices: a user's tuned or earlier sessions' choices would change which kernels run)
    os.environ.setdefault("TOKENMILL_AUTOTUNE_CACHE_DIR", str(tmp_path_factory.mktemp("autotune-cache")))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], Path]:
    """(arch, tied) -> folder of a tiny random-weight checkpoint, built on first request."""
    built: dict[tuple[str, bool], Path] = {}

    def get(arch: str, tied: bool = False) -> Path:
        assert arch in ARCHS
        key = (arch, tied)
        if key not in built:
            out = tmp_path_factory.mktemp(f"{arch}-{'tied' if tied else 'untied'}")
            shard = "1MB" if arch in SHARDED and not tied else None
            built[key] = make_model(arch, "tiny", out, seed=1, tie_embeddings=tied, max_shard_size=shard)
        return built[key]

    return get


@pytest.fixture(scope="session")
def hf_logits() -> Callable[[Path, torch.Tensor], torch.Tensor]:
    """(folder, token ids [L]) -> transformers' float32 logits [L, vocab] for the whole sequence."""
    import transformers

    models: dict[Path, torch.nn.Module] = {}

    def run(folder: Path, ids: torch.Tensor) -> torch.Tensor:
        if folder not in models:
            models[folder] = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            return models[folder](ids[None]).logits[0].float()

    return run


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the test run (loopback, no dashboard): the Ray tests' servers join it."""
    ray = pytest.importorskip("ray")
    from tokenmill.distributed.cluster import connect

    connect(None, num_cpus=2)
    yield ray
    ray.shutdown()
