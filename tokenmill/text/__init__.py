"""The model's text side: its tokenizer and chat template, from a Hugging Face folder or from a GGUF
file's metadata. Below the engine, the runner and structured output, which all need it; it knows
nothing of the model code."""
