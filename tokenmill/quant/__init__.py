"""Quantization: how a linear layer holds and applies its weights, and which way each layer does.

`method.py` is the seam (`LinearMethod`, the weight-loader convention's pieces, the dense method);
`config.py` the policy (`QuantConfig.method_for(prefix, shape)`, built once per model from the
engine's settings and the checkpoint); the other modules one method family or format each.
"""
