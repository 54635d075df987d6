"""The kernel a start-up takes without timing anything: one explicit rule per CPU kind and row class.

A server start never measures (kernels/autotune.py's no-measure mode): a choice the autotune cache
holds is read back, and one it does not hold is taken from the table here, marked `default`, until
`tokenmill tune` measures it on the machine at hand. So the table is not any one machine's timings; it
is what the kernels' designs say each CPU kind should run, by three facts about the CPU
(`CpuKind.from_flags`, from /proc/cpuinfo's flags) and the class of row counts:

- **decode** (1-8 rows): the step reads every weight once and does little arithmetic on it, so the
  time is the weights' bytes over the memory bandwidth. tokenmill's own kernels stream each weight in
  its stored form once (dense in its checkpoint layout, int8 as a byte a weight, int4 as half a byte)
  and win on every CPU kind; torch's GEMMs pack or dequantize first.
- **batch** (9-64 rows): still close to one read of the weights a step, and enough rows that
  register tiling pays. Where the CPU has AMX, its tiles (the `amx` kernels) multiply 16 rows at a
  time; elsewhere the tiled native loops (`tiled`: 4 weight rows x 4 input rows) keep the weights read
  once. A dequantizing kernel here would write a dense copy of the weights every step, the cost the
  quantization exists to avoid, so it is the last resort (int4 takes `gemm` except on AMX: its
  integer kernel with int8 activations in runs of 32, as llama.cpp multiplies its 4-bit blocks, the
  loops ordered for many rows; with AVX-512 VNNI each vpdpbusd is 64 of its multiply-adds).
- **prompt** (65+ rows): arithmetic, not weight reads, bounds the product, so torch's GEMM (oneDNN /
  MKL, packed panels) takes it wherever it runs the dtype in hardware: float32 everywhere, bfloat16
  where the CPU has bfloat16 arithmetic (AVX-512 BF16 or AMX). Without it (AVX2 alone) torch's
  bfloat16 GEMM emulates every product, and the native kernel, which widens bfloat16 to float32 once
  per load, takes the class. Quantized weights are dequantized once per product for this class
  (`dequant`; for int8 on AVX2, `broadcast`: each tile of weight rows widened to float32 in cache for
  the dense kernel's outer-product tiles, no dense copy of the layer), except int4 without AMX
  (`gemm`, as the batch class: its integer sums outrun dequantizing the layer for a GEMM) and W8A8,
  whose integer GEMM (`int_mm`: oneDNN, VNNI where present) keeps the
  activations in int8, and AMX's own int8 tiles where the CPU has them.

The greedy head (`greedy_head`: the argmax taken inside the output projection, or logits then
argmax) defaults to logits: the plain product at the kernels' chosen shape, the chunked head's gain
(no [rows, vocab] float32 logits written) being small beside the product itself.

Each rule is a preference list: the first name among the candidates the caller offers wins (a
candidate is offered only where it runs: AMX kernels where the CPU has AMX and Linux grants its
tiles, `tiled` for per-channel int8, the native kernels where they built), so a rule written for a
kind degrades to what is there. `tokenmill tune` replaces any of these by a measurement.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

DECODE, BATCH, PROMPT = "decode", "batch", "prompt"
ANY = "*"  # a rule for every CPU kind, or every dtype


@dataclass(frozen=True)
class CpuKind:
    """What the defaults depend on: AVX-512 at all, its VNNI int8 dot products, bfloat16 arithmetic
    (AVX-512 BF16 or AMX-BF16), AMX tiles; `name` for the log."""

    avx512: bool
    vnni: bool
    bf16: bool
    amx: bool
    avx2: bool = False  # AVX2 with FMA (the kernels' x86-64-v3 vector forms)

    @classmethod
    def from_flags(cls, flags: str) -> CpuKind:
        """From a CPU's flags as /proc/cpuinfo lists them (kernels/cpu_build.py `cpu_flags`)."""
        have = set(flags.split())
        amx = "amx_tile" in have and bool({"amx_bf16", "amx_int8"} & have)
        return cls(
            avx512="avx512f" in have,
            vnni="avx512_vnni" in have or "avx512vnni" in have,
            bf16="avx512_bf16" in have or "amx_bf16" in have,
            amx=amx,
            avx2="avx2" in have and "fma" in have,
        )

    @property
    def name(self) -> str:
        if self.amx:
            return "AMX"
        if self.avx512:
            return "AVX-512" + (" VNNI" if self.vnni else "") + (" BF16" if self.bf16 else "")
        return "AVX2 or older"

    def has(self, feature: str) -> bool:
        return feature == ANY or bool(getattr(self, feature))


@dataclass(frozen=True)
class Rule:
    """For `op` at `rows` (a row class) with `dtype` activations (or ANY) on a CPU that has `cpu`
    (a `CpuKind` field, or ANY): the candidates in order of preference."""

    op: str
    rows: str
    dtype: str
    cpu: str
    prefer: tuple[str, ...]


# The first rule that matches wins (the specific before the general). Ops: `linear` (dense: `cpu`,
# the native kernel, or `torch`'s GEMM), `int8` / `w8a8` / `int4` (quant/int_methods.py's kernels),
# `gguf_layout` (the form a GGUF file's 32-weight block types are kept in: quant/config.py).
RULES: tuple[Rule, ...] = (
    # dense
    Rule("linear", DECODE, ANY, ANY, ("cpu", "torch")),
    Rule("linear", BATCH, ANY, ANY, ("cpu", "torch")),
    Rule("linear", PROMPT, "float32", ANY, ("torch", "cpu")),
    Rule("linear", PROMPT, "bfloat16", "bf16", ("torch", "cpu")),
    Rule("linear", PROMPT, ANY, ANY, ("cpu", "torch")),  # AVX2: torch's bfloat16 GEMM is emulated
    # int8 weight-only
    Rule("int8", DECODE, ANY, ANY, ("native", "tiled", "dequant")),
    Rule("int8", BATCH, ANY, "amx", ("amx", "tiled", "native", "dequant")),
    Rule("int8", BATCH, ANY, ANY, ("tiled", "native", "dequant")),
    Rule("int8", PROMPT, ANY, "amx", ("dequant", "amx", "tiled", "native")),
    # (AVX-512 BF16 without AMX: `dequant`, the layer written out dense for torch's bfloat16 GEMM. On Zen
    # 4 `gemm`, int8 activations in runs of 256 on VNNI, ran 1.6x it at 64-128 rows alone but 0.80-0.89x
    # in the engine's 512-row prompt chunks, benchmarks/quant_prefill.py: a candidate for `tokenmill tune`)
    Rule("int8", PROMPT, ANY, "bf16", ("dequant", "gemm", "tiled", "native")),
    Rule("int8", PROMPT, "float32", "avx512", ("dequant", "tiled", "native")),
    Rule("int8", PROMPT, ANY, "avx512", ("tiled", "native", "dequant")),
    # AVX2: no bfloat16 GEMM to dequantize to; each tile's rows widened to float32 for the outer-product
    # tiles, as the dense kernel does with bfloat16 weights
    Rule("int8", PROMPT, ANY, ANY, ("broadcast", "tiled", "native", "dequant")),
    # W8A8: int8 activations, integer products
    Rule("w8a8", DECODE, ANY, ANY, ("native", "tiled", "int_mm")),
    Rule("w8a8", BATCH, ANY, "amx", ("amx", "tiled", "native", "int_mm")),
    Rule("w8a8", BATCH, ANY, ANY, ("tiled", "native", "int_mm")),
    Rule("w8a8", PROMPT, ANY, "amx", ("amx", "int_mm", "tiled")),
    Rule("w8a8", PROMPT, ANY, "vnni", ("int_mm", "tiled", "native")),
    Rule("w8a8", PROMPT, ANY, ANY, ("tiled", "int_mm", "native")),  # AVX2: its own integer loop
    # int4 weight-only (`native` is kept to decode rows by the method; `int4pack`: torch's kernel,
    # offered only where tokenmill's kernels do not build)
    Rule("int4", DECODE, ANY, ANY, ("native", "int4pack", "amx", "dequant")),
    # (`dequant32`: bfloat16 activations through float32 weights and GEMM, for CPUs without bfloat16
    # arithmetic, where `dequant`'s bfloat16 GEMM is emulated)
    Rule("int4", BATCH, ANY, "amx", ("amx", "int4pack", "dequant")),
    # (AVX-512 BF16 without AMX: `gemm` on VNNI, 1.5-15x `dequant` at 512-16 rows on Zen 4,
    # benchmarks/quant_many_rows.py; `dequant`'s GEMM runs bfloat16 in hardware there, not `dequant32`)
    Rule("int4", BATCH, ANY, "bf16", ("gemm", "int4pack", "dequant")),
    # (`gemm`: the integer kernel, int8 activations in runs of 32 as llama.cpp's, its loops ordered for
    # many rows; `widened`: float32 outer-product tiles over weight rows dequantized in cache, AVX2
    # builds alone. Both read the weights once a product, where `dequant32` writes a float32 copy.)
    Rule("int4", BATCH, ANY, ANY, ("gemm", "widened", "int4pack", "dequant32", "dequant")),
    Rule("int4", PROMPT, ANY, "amx", ("dequant", "int4pack", "amx")),
    Rule("int4", PROMPT, ANY, "bf16", ("gemm", "int4pack", "dequant")),
    Rule("int4", PROMPT, ANY, ANY, ("gemm", "widened", "dequant32", "dequant", "int4pack", "amx")),
    # the greedy head
    Rule("greedy_head", ANY, ANY, ANY, ("logits", "head")),
    # a GGUF block type's form in memory (`gguf_repack`; the rule's dtype is the block type): `x16`, the
    # file's blocks repacked at load into groups of 16 rows (gguf_x16.cpp), or `file`, as stored. With
    # AVX-512 VNNI every type's x16 product runs on vpdpbusd. On AVX2 (gguf_x16_avx2.h, vpmaddubsw) the
    # x16 products beat the file blocks' from memory at one x row and at eight for every type but Q8_0
    # (the 1.1B shapes: Q4_K 1.13-1.31x at one row, Q6_K 1.17-1.31x, Q4_0 1.38-2.13x); Q8_0's lost at
    # one row (0.65-0.99x; 1.28-1.76x at eight), and one request's decode goes by it. benchmarks/gguf_kernels.py
    # --forms file,x16 under TOKENMILL_MAX_ISA=avx2 on Zen 4: results/gguf_kernels_x16_avx2cap_zen4.json.
    Rule("gguf_repack", ANY, ANY, "vnni", ("x16", "file")),
    Rule("gguf_repack", ANY, "Q4_K", "avx2", ("x16", "file")),
    Rule("gguf_repack", ANY, "Q5_K", "avx2", ("x16", "file")),
    Rule("gguf_repack", ANY, "Q6_K", "avx2", ("x16", "file")),
    Rule("gguf_repack", ANY, "Q4_0", "avx2", ("x16", "file")),
    Rule("gguf_repack", ANY, "Q4_1", "avx2", ("x16", "file")),
    Rule("gguf_repack", ANY, ANY, ANY, ("file", "x16")),
    # a GGUF file's Q8_0 / Q4_0 / Q4_1 matrices (`gguf_layout`, every row class): `blocks` (all three
    # in the file's own blocks, quant/gguf_method.py), `q8_0` (Q8_0 in its blocks, Q4_0 / Q4_1 in int4)
    # or `int` (tokenmill's int8 / int4 formats and their kernels). On AVX2 the file's blocks kernel
    # multiplies a Q8_0 block's bytes as stored (vpmaddubsw on int8 activations in runs of 32) over
    # several weight streams a thread at one x row, where the int8 kernel widens each weight to 16 bits
    # over one stream a thread; Q4_0's file blocks pay a nibble unpack and sign step per 32 weights that
    # the int4 kernel's layout avoids, their 16-row form not (below). With AVX-512 VNNI and BF16 but
    # no AMX (Zen 4), the blocks repacked in 16-row groups (gguf_x16.cpp) outrun the int kernels: Q8_0's (the 1.1B q8_0
    # file: prompt 2.21x llama.cpp against 1.58x, 8 requests 2.22x against 1.83x, one request alike)
    # and Q4_0's / Q4_1's at one request (the 4-bit product alone 1.12x the int4 kernel's speed at one
    # row, level at eight; the q4_0 file served: benchmarks/RESULTS.md, Zen 4): `blocks`. The same
    # rule puts `--quantization int8` / `int4` in Q8_0 / Q4_1 blocks there (quant/int_blocks.py).
    # With AMX, and AVX-512 without BF16, the int kernels stay the default until a measurement there
    # says otherwise. On AVX2, Q4_0 / Q4_1 blocks repacked in 16-row groups (gguf_x16_avx2.h) outran
    # int4 (the q4_0 file: one request 1.09x, eight 1.33x, benchmarks/gguf_decode.py under
    # TOKENMILL_MAX_ISA=avx2 on Zen 4), and Q8_0 stays in its file blocks there (`gguf_repack`):
    # `blocks`. Without AVX2 (no vector form of the blocks): `q8_0`, as AVX2 had before that form.
    Rule("gguf_layout", ANY, ANY, "amx", ("int", "q8_0", "blocks")),
    Rule("gguf_layout", ANY, ANY, "bf16", ("blocks", "q8_0", "int")),
    Rule("gguf_layout", ANY, ANY, "avx512", ("int", "q8_0", "blocks")),
    Rule("gguf_layout", ANY, ANY, "avx2", ("blocks", "q8_0", "int")),
    Rule("gguf_layout", ANY, ANY, ANY, ("q8_0", "int", "blocks")),
    # a GGUF block type's prompt product (`gguf_prompt`; the rule's dtype is the block type): `gemm`
    # (int8 activations, integer sums: quant/gguf_method.py), `dequant` (below) or `widened` (each tile
    # of 6 weight rows dequantized to float32 in cache for the dense kernel's outer-product tiles: AVX2
    # builds alone; elsewhere it runs `gemm`). On AVX2 the K-quants' integer sums run a float step per 256 weights
    # and outpace float32 FMAs; the 32-weight types pay a sign step and a float step per 32, and the
    # float32 tiles outpace them (benchmarks/gguf_prefill.py). AVX-512 keeps `gemm` everywhere.
    # (`dequant`: the layer dequantized a chunk of rows at a time for torch's GEMM, bfloat16 in hardware
    # with AVX-512 BF16 or AMX. Q3_K's 3-bit runs unpack slower than the other K-quants' and it has no
    # 16-row form: on Zen 4 its integer GEMM took 1.9x dequant's time at 512 rows, 1.3x at 128, at
    # the 1.1B model's 5632x2048; elsewhere the first candidate, `gemm`, until measured there)
    Rule("gguf_prompt", PROMPT, "Q3_K", "bf16", ("dequant", "gemm")),
    Rule("gguf_prompt", PROMPT, "Q8_0", "avx512", ("gemm", "widened")),
    Rule("gguf_prompt", PROMPT, "Q8_0", ANY, ("widened", "gemm")),
    Rule("gguf_prompt", PROMPT, "Q4_0", "avx512", ("gemm", "widened")),
    Rule("gguf_prompt", PROMPT, "Q4_0", ANY, ("widened", "gemm")),
    # a prompt chunk's attention in the `cpu` backend (`prompt_attention`): `native`, the paged kernel
    # (attention.cpp: float32 FMAs, or bfloat16 dot products on AVX-512 BF16; the keys after a slice's
    # last query skipped), or `sdpa`, torch's flash kernel over the chunk's gathered keys. On Zen 4 the
    # kernel ran the 1.1B model's 1,017-token prompt's two chunks in 0.30x SDPA's time with bfloat16
    # dot products (0.61x under TOKENMILL_MAX_ISA=avx2, float32 FMAs; 0.35x / 0.78x at 4,096 tokens:
    # benchmarks/prompt_attention.py). AMX keeps SDPA, whose bfloat16 products may run on its tiles,
    # until measured there (`tokenmill tune` times both).
    Rule("prompt_attention", PROMPT, ANY, "amx", ("sdpa", "native")),
    Rule("prompt_attention", PROMPT, ANY, ANY, ("native", "sdpa")),
)


def row_class(low: int) -> str:
    """The class of row counts a range starting at `low` falls in (quant/cpu_dense.py ROW_CLASSES)."""
    return DECODE if low <= 8 else BATCH if low <= 64 else PROMPT


def default_choice(op: str, rows: str, dtype: str, cpu: CpuKind, candidates: Collection[str]) -> str:
    """The candidate the first matching rule prefers among `candidates`; with no rule (or none of its
    names offered), the first candidate."""
    for rule in RULES:
        if rule.op == op and rule.rows in (rows, ANY) and rule.dtype in (dtype, ANY) and cpu.has(rule.cpu):
            for name in rule.prefer:
                if name in candidates:
                    return name
            break
    return next(iter(candidates))
