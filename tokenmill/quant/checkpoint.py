"""How a checkpoint stores its linear layers quantized or sparse: config.json's `quantization_config`,
parsed by models/config.py into these plain records, read by the quantization policy (quant/config.py)
and the stored formats' methods (quant/awq_gptq.py, quant/compressed.py, quant/sparse24.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointQuantization:
    """How a checkpoint's linear layers are stored quantized (config.json's `quantization_config`):
    AWQ (GEMM packing, 4 bits), GPTQ (4 or 8 bits), or compressed-tensors' pack-quantized int4 / int8; groups of
    `group_size` inputs (None: the whole input width, one scale per output channel)."""

    method: str  # "awq" | "gptq" | "compressed-tensors"
    bits: int
    group_size: int | None
    gptq_v2: bool = False  # GPTQ's checkpoint_format gptq_v2 stores the true zero points (v1: zero - 1)
    desc_act: bool = False  # GPTQ's activation order: g_idx a permutation of the groups
    symmetric: bool = False  # compressed-tensors: no zero points stored


CHECKPOINT_QUANTIZATIONS = ("awq", "gptq", "compressed-tensors")
SPARSITY_FORMATS = ("sparse-24-bitmask", "dense")


@dataclass(frozen=True)
class CheckpointSparsity:
    """compressed-tensors' `sparsity_config` for 2:4 weights: stored `sparse-24-bitmask`
    (quant/sparse24.py) or `dense` (zeros in place); the decoder projections follow 2:4."""

    format: str  # one of SPARSITY_FORMATS
    structure: str = "2:4"
