"""The quantized matrix products torch 2.13 has on the CPU, timed beside the dense ones: groundwork for
the quantization issue (which kernels can carry int8 / int4 weight-only layers on this CPU, and where).

On the `small` peer model's layer shapes (8 layers' worth of distinct weights plus the output
projection, so they come from memory as in a decode step), at 1, 4, 16 and 64 rows, interleaved,
median of 7 (time for all the model's products once):
- dense: torch's `F.linear` in float32 and bfloat16, and tokenmill's native kernel (the engine's
  few-row kernel, `tokenmill_cpu.linear`) in both;
- int8 weight-only, per output channel: `torch._weight_int8pack_mm` (int8 weights, float scales),
  with float32 and bfloat16 activations;
- int4 weight-only, groups of 32 and 128, asymmetric: `torch._weight_int4pack_mm_for_cpu` on weights
  packed by `torch._convert_weight_to_int4pack_for_cpu`, bfloat16 activations.
Each quantized product is also checked against the dense product of its dequantized weights (max
relative error printed). torchao is not installed by the project; whether it is faster is a question
for the quantization issue. Writes benchmarks/results/quant_ops.json.

Usage: python benchmarks/quant_ops.py [--rows 1,4,16,64] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.kernels.autotune import time_candidates
from tokenmill.kernels.cpu_build import cpu_flags, load_cpu_kernels

SHAPES = ((768, 512), (512, 512), (2752, 512), (512, 1376))  # the peer model's qkv, o, gate_up, down
HEAD = (32000, 512)
LAYERS = 8
RESULTS = Path(__file__).resolve().parent / "results"


def int8_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel, symmetric: int8 [N, K], scales [N] (float32)."""
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def int4_weights(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups of `group` along K (32 where `group` does not divide K: 1,376 / 128), asymmetric (0..15
    with a zero point): packed weights, the [K / group, N, 2] scales-and-zeros the op takes, and the
    dequantized weights [N, K]."""
    n, k = w.shape
    group = group if k % group == 0 else 32
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)  # [N, K / group]
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    # the op computes (q - 8) * scale + zero: zero = lo + 8 * scale
    zero = lo + 8 * scale
    deq = ((q - 8) * scale[..., None] + zero[..., None]).reshape(n, k)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.reshape(n, k).to(torch.int32), 1)
    sz = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()  # [K / group, N, 2]
    return packed, sz, deq


def products(
    dense: list[torch.Tensor],
    bf16: list[torch.Tensor],
    q8: list[tuple[torch.Tensor, torch.Tensor]],
    q8_bf16_scales: list[torch.Tensor],
    q4: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]],
    q4_bf16: dict[int, list[torch.Tensor]],
    xs: dict[int, torch.Tensor],
    xb: dict[int, torch.Tensor],
    rows: int,
    kernels: object | None,
) -> dict[str, Callable[[], None]]:
    """name -> a call that runs every product of the model once that way, at `rows` rows."""

    def each(calls: list[Callable[[], object]]) -> Callable[[], None]:
        def run() -> None:
            for call in calls:
                call()

        return run

    fns = {
        "dense_f32_torch": each([partial(F.linear, xs[w.shape[1]], w) for w in dense]),
        "dense_bf16_torch": each([partial(F.linear, xb[w.shape[1]], w) for w in bf16]),
        "int8_f32": each([partial(torch._weight_int8pack_mm, xs[q.shape[1]], q, s) for q, s in q8]),
        "int8_bf16": each(
            [
                partial(torch._weight_int8pack_mm, xb[q.shape[1]], q, s)
                for (q, _), s in zip(q8, q8_bf16_scales, strict=True)
            ]
        ),
    }
    for g, ws in q4.items():
        fns[f"int4_g{g}_bf16"] = each(
            [
                partial(torch._weight_int4pack_mm_for_cpu, xb[d.shape[1]], p, d.shape[1] // sz.shape[0], sz)
                for (p, _, d), sz in zip(ws, q4_bf16[g], strict=True)
            ]
        )
    if kernels is not None:
        op = kernels.ops.linear  # type: ignore[attr-defined]
        out32 = [torch.empty(rows, w.shape[0]) for w in dense]
        out16 = [torch.empty(rows, w.shape[0], dtype=torch.bfloat16) for w in bf16]
        fns["dense_f32_native"] = each(
            [partial(op, o, xs[w.shape[1]], w, None) for o, w in zip(out32, dense, strict=True)]
        )
        fns["dense_bf16_native"] = each(
            [partial(op, o, xb[w.shape[1]], w, None) for o, w in zip(out16, bf16, strict=True)]
        )
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "quant_ops.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kernels = load_cpu_kernels()
    shapes = [s for s in SHAPES for _ in range(LAYERS)] + [HEAD]
    dense = [torch.randn(n, k) * 0.02 for n, k in shapes]
    bf16 = [w.bfloat16() for w in dense]
    q8 = [int8_weights(w) for w in dense]
    q4 = {g: [int4_weights(w, g) for w in dense] for g in (32, 128)}
    q8_bf16_scales = [s.bfloat16() for _, s in q8]
    q4_bf16 = {g: [sz.bfloat16() for _, sz, _ in ws] for g, ws in q4.items()}
    result: dict[str, object] = {
        "torch": torch.__version__,
        "cpu_flags": sorted(set(cpu_flags().split()) & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"}),
        "threads": args.threads,
        "bytes": {
            "float32": sum(w.numel() * 4 for w in dense),
            "bfloat16": sum(w.numel() * 2 for w in dense),
            "int8": sum(q.numel() + s.numel() * 4 for q, s in q8),
            "int4_g32": sum(p.numel() + sz.numel() * 4 for p, sz, _ in q4[32]),
        },
        "rows": {},
    }
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in {k for _, k in shapes}}
        xb = {k: x.bfloat16() for k, x in xs.items()}
        fns = products(dense, bf16, q8, q8_bf16_scales, q4, q4_bf16, xs, xb, m, kernels)
        ms = time_candidates(fns, repeats=7, sync=lambda: None)  # interleaved medians, the autotuner's timer
        # accuracy of each quantized op against the dense product of its own dequantized weights (first shape)
        x = xs[dense[0].shape[1]]
        q, s = q8[0]
        ref8 = x @ (q.float() * s[:, None]).t()
        err8 = ((torch._weight_int8pack_mm(x, q, s) - ref8).abs().max() / ref8.abs().max()).item()
        p, sz, deq = q4[32][0]
        ref4 = x.bfloat16().float() @ deq.t()
        got4 = torch._weight_int4pack_mm_for_cpu(x.bfloat16(), p, 32, sz.bfloat16()).float()
        err4 = ((got4 - ref4).abs().max() / ref4.abs().max()).item()
        result["rows"][str(m)] = {"ms": ms, "max_rel_error": {"int8_f32": err8, "int4_g32_bf16": err4}}  # type: ignore[index]
        cells = "  ".join(f"{name} {t:.2f}" for name, t in ms.items())
        print(f"rows {m:3d} (ms for all the model's products): {cells}  | rel err int8 {err8:.1e}, int4 {err4:.1e}")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
