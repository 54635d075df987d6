"""2:4 sparse weights: compressed-tensors' `sparse-24-bitmask` storage, and the sparse tensor cores.

2:4: in every group of 4 consecutive inputs of an output row, at most 2 weights are nonzero (the
pattern NVIDIA's sparse tensor cores run at up to twice the dense rate). Storage, as compressed-tensors
writes it (the `sparse-24-bitmask` format llm-compressor's 2:4 models use): per weight `<prefix>.shape`
([2, 1]: rows, columns), `<prefix>.compressed` ([rows, columns / 2], the kept values in row order,
the weight's dtype) and `<prefix>.bitmask` (uint8 [rows, ceil(columns / 8)]: which entries are kept,
8 a byte, the first entry in the lowest bit). A group of 4 with fewer than 2 nonzeros keeps some of
its zeros, so that every row keeps exactly half.

Running them: on a CUDA device in float16 or bfloat16, each 2:4 layer's weight becomes torch's
semi-structured sparse tensor (`to_sparse_semi_structured`: cuSPARSELt where torch has it, CUTLASS
otherwise), which `F.linear` dispatches to the sparse kernels. Elsewhere (a CPU: torch's
semi-structured kernels are CUDA-only) the layers stay dense, and the log says there is no speed-up.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from tokenmill.quant.method import UnquantizedLinearMethod

SPARSE_24_SUFFIXES = (".shape", ".compressed", ".bitmask")
SEMI_STRUCTURED_DTYPES = (torch.float16, torch.bfloat16)


def keep_mask_2_4(score: torch.Tensor) -> torch.Tensor:
    """score [N, K] -> [N, K] bool: the 2 best-scored entries of every group of 4 inputs (K a multiple of 4)."""
    n, k = score.shape
    if k % 4:
        raise ValueError(f"2:4 sparsity needs input widths that are multiples of 4, got {k}")
    groups = score.float().reshape(n, k // 4, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.topk(2, dim=-1).indices, True)
    return keep.reshape(n, k)


def is_2_4(weight: torch.Tensor) -> bool:
    """Every group of 4 inputs of every row holds at most 2 nonzeros."""
    n, k = weight.shape
    return k % 4 == 0 and bool(((weight.reshape(n, k // 4, 4) != 0).sum(-1) <= 2).all())


def compress_2_4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A 2:4 weight [N, K] -> its `sparse-24-bitmask` tensors (suffix -> tensor)."""
    if not is_2_4(weight):
        raise ValueError("compress_2_4: the weight does not follow the 2:4 pattern")
    keep = keep_mask_2_4(weight.abs())  # the nonzeros (at most 2 of 4), topped up with zeros to exactly 2
    n, k = weight.shape
    bits = np.packbits(keep.numpy(), axis=-1, bitorder="little")
    return {
        ".shape": torch.tensor([[n], [k]], dtype=torch.int64),
        ".compressed": weight[keep].reshape(n, k // 2).contiguous(),
        ".bitmask": torch.from_numpy(bits),
    }


def decompress_2_4(shape: torch.Tensor, compressed: torch.Tensor, bitmask: torch.Tensor, where: str) -> torch.Tensor:
    """`sparse-24-bitmask` tensors -> the dense weight [N, K]; a ValueError names what does not fit."""
    dims = [int(v) for v in shape.flatten().tolist()]
    if len(dims) != 2 or min(dims) <= 0:
        raise ValueError(f"{where}.shape: expected [rows, columns], got {dims}")
    n, k = dims
    if tuple(bitmask.shape) != (n, -(-k // 8)) or bitmask.dtype != torch.uint8:
        raise ValueError(
            f"{where}.bitmask: expected uint8 [{n}, {-(-k // 8)}], got {bitmask.dtype} {list(bitmask.shape)}"
        )
    keep = torch.from_numpy(np.unpackbits(bitmask.numpy(), axis=-1, count=k, bitorder="little").astype(bool))
    if int(keep.sum()) != compressed.numel():
        raise ValueError(f"{where}.compressed: {compressed.numel()} values for {int(keep.sum())} kept entries")
    dense = torch.zeros(n, k, dtype=compressed.dtype)
    dense[keep] = compressed.flatten()
    return dense


def to_semi_structured(layers: Mapping[str, nn.Module]) -> tuple[list[str], dict[str, str]]:
    """Hold the dense linear layers `layers` (module name -> layer) whose weights follow 2:4 as torch's
    semi-structured sparse tensors (CUDA, float16 / bfloat16); returns the ones converted, and the ones
    torch refused with its reason (a shape its kernels do not take)."""
    from torch.sparse import to_sparse_semi_structured

    done: list[str] = []
    refused: dict[str, str] = {}
    for name, module in layers.items():
        if type(module.linear_method) is not UnquantizedLinearMethod:
            continue
        weight = module.weight
        if not isinstance(weight, torch.Tensor) or not weight.is_cuda or weight.dtype not in SEMI_STRUCTURED_DTYPES:
            continue
        if not is_2_4(weight):
            continue
        try:
            module.weight = nn.Parameter(to_sparse_semi_structured(weight.detach()), requires_grad=False)
        except (RuntimeError, ValueError) as e:  # a shape the sparse kernels do not take: stays dense
            refused[name] = str(e).splitlines()[0]
            continue
        done.append(name)
    return done, refused
