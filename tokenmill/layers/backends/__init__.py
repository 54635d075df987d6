"""Attention backends: implementations of `tokenmill.layers.attention.AttentionBackend`."""
