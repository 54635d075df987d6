"""Tools that write model folders: GGUF to a folder (convert), quantize, sparsify, and the tiny
random-weight models the tests and demos use (make-model). They sit above the engine's rooms, so they
may use the tokenizer, the engine and the quality evaluation; nothing in the engine imports them."""
