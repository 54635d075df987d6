"""Structured output: grammar-constrained decoding (JSON schema, regex, choice, grammar) via llguidance."""
