"""tokenmill: an LLM inference engine and OpenAI-compatible server for Llama-family models."""

from tokenmill.config import EngineConfig
from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # LLM pulls in torch and transformers: import it on first use, so `tokenmill --help` stays fast.
    if name == "LLM":
        from tokenmill.llm import LLM

        return LLM
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")


__all__ = ["LLM", "EngineConfig", "SamplingParams"]
