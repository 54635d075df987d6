"""Model families, their configs, loading from Hugging Face folders, and test checkpoints."""
