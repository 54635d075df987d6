"""tokenmill: an LLM inference engine and OpenAI-compatible server for Llama-family models."""

__version__ = "0.1.0"
