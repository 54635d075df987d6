"""The engine: requests in, tokens and text out (tokenizer, detokenizer, scheduling loop)."""
