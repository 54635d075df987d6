"""Turns scheduled work into model inputs and runs the model; owns the KV cache tensors."""
