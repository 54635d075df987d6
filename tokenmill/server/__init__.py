"""OpenAI-compatible HTTP server: schemas, the FastAPI app, SSE streaming."""
