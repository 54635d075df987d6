"""Model-quality evaluations: held-out text and the quantization report."""
