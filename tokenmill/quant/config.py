"""Which `LinearMethod` each linear layer of a model gets: `QuantConfig`, built once per model.

`build_quant_config` turns the engine's quantization settings (`QuantSettings`, plain data from
EngineConfig) and what the checkpoint stores (an AWQ / GPTQ / compressed-tensors
`CheckpointQuantization`, a GGUF file's tensor types) into one `QuantConfig`; a layer asks it for
its method at construction, by its prefix in the model (`layers.0.self_attn.qkv_proj`, `lm_head`)
and its (out, in) shape, as vLLM's `get_quant_method`. The rules:

- `quantization` int8 / int4 / w8a8: every projection quantized at load (CPU only), the output
  projection by `quantization_head` (`same`, or `int8` per channel); a checkpoint stored quantized
  already refuses them. int8 and int4 with the group size unset or 32 go by `gguf_layout` too, where
  the CPU has AVX-512 VNNI: a layout keeping Q8_0 in blocks quantizes int8 into Q8_0 blocks, one
  keeping Q4_0 / Q4_1 in blocks int4 into Q4_1 blocks (`in_blocks`, quant/int_blocks.py); otherwise
  tokenmill's int8 / int4 formats.
- `quantization` auto: a stored AWQ / GPTQ / compressed-tensors checkpoint loads as stored (CPU only;
  its output projection dense); a GGUF file's layers stay quantized on a CPU. The K-quants (Q3_K,
  Q4_K, Q5_K, Q6_K), Q5_0 / Q5_1 and layers mixing block types stay in the file's own blocks
  (quant/gguf_method.py), the embedding table too where its type is one of those
  (`embedding_blocks`). Q8_0 / Q4_0 / Q4_1 matrices go by `gguf_layout`: `blocks` keeps them so too
  (`q8_0`: Q8_0 only, Q4_0 / Q4_1 as `int`); `int` loads Q8_0 into int8 and Q4_0 / Q4_1 into int4
  (groups of 32: the same grids) where every tensor of the layer shares that type, and a tied output
  projection over a Q8_0 table becomes an int8 layer of its own, quantized from the table in groups
  of 32 (Q8_0's grid again, exactly); `auto` takes the CPU kind's default (kernels/defaults.py).
  Over a table of another block type the tied projection reads the table's blocks themselves.
  Otherwise dense.
- `quantization` none: dense (the `linear_backend` method); a stored quantized checkpoint refuses it.
2:4 checkpoints take the dense method; the loader moves their weights to the sparse tensor cores
(quant/sparse24.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from tokenmill.config import GGUF_LAYOUTS, GGUF_REPACKS  # the settings' choices
from tokenmill.kernels.cpu_build import NATIVE_DTYPES, CpuKernels, cpu_flags, load_cpu_kernels
from tokenmill.kernels.defaults import ANY, CpuKind, default_choice
from tokenmill.quant.awq_gptq import checkpoint_method
from tokenmill.quant.checkpoint import CheckpointQuantization
from tokenmill.quant.cpu_dense import get_dense_linear_method
from tokenmill.quant.gguf_method import GGUFBlocksMethod, repacks_on
from tokenmill.quant.int_blocks import BLOCK_TYPES, BlocksQuantMethod
from tokenmill.quant.int_methods import Int4LinearMethod, Int8LinearMethod, get_head_method, get_quant_method
from tokenmill.quant.method import LinearMethod, Shape, UnquantizedLinearMethod
from tokenmill.quant.quantize import QuantSpec

GGUF_BLOCK = 32  # the group of GGUF's Q8_0 / Q4_0 / Q4_1 blocks
GGUF_INT_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # the block types `gguf_layout` may load into the int formats
HEAD = "lm_head"  # the output projection's prefix
GGUF_TABLE = "embed_tokens"  # `gguf_types` key of a tied output projection's table
GGUF_EMBEDDING = "model.embed_tokens"  # `gguf_types` key of the embedding table's type (tied or not)


@dataclass(frozen=True)
class QuantSettings:
    """The engine's quantization settings (EngineConfig's fields of the same meaning)."""

    quantization: str = "auto"  # auto, none, int8, int4, w8a8
    group_size: int | None = None
    group_fallback: bool = False
    head: str = "same"  # same, int8
    linear_backend: str = "auto"  # the kernels' switch: torch keeps the quantized methods off the native kernels
    gguf_layout: str = "auto"  # a GGUF file's Q8_0 / Q4_0 / Q4_1 matrices: auto, blocks, q8_0, int
    gguf_repack: str = "auto"  # the blocks kept as stored: auto, x16 (repacked in 16-row groups), file


@dataclass(frozen=True)
class QuantConfig:
    """The linear methods of one model. `layers`: every projection's; `head`: the output projection's
    own (None: by the rules below); `gguf`: a GGUF tensor type -> the method that keeps such layers as
    stored, applied where `gguf_types` (layer prefix -> its tensors' one type) names it;
    `tied_gguf_head`: a tied output projection's own method when its table's type is Q8_0."""

    layers: LinearMethod
    head: LinearMethod | None = None
    gguf: Mapping[str, LinearMethod] = field(default_factory=dict)
    gguf_types: Mapping[str, str] = field(default_factory=dict)
    tied_gguf_head: LinearMethod | None = None
    name: str = "none"  # what the log calls it
    # products with dense weights outside a layer (a tied head, slices of the head): the layers'
    # method when it is a dense one (the CPU plan applies), plain torch otherwise
    dense: UnquantizedLinearMethod = field(init=False)

    def __post_init__(self) -> None:
        layers = self.layers
        object.__setattr__(
            self, "dense", layers if isinstance(layers, UnquantizedLinearMethod) else UnquantizedLinearMethod()
        )

    @classmethod
    def uniform(cls, method: LinearMethod | None = None, head: LinearMethod | None = None) -> QuantConfig:
        """One method for every projection (None: dense), `head` for the output projection's own."""
        return cls(method or UnquantizedLinearMethod(), head, name=getattr(method, "name", "none"))

    @classmethod
    def for_checkpoint(cls, stored: CheckpointQuantization | None) -> QuantConfig:
        """What a checkpoint loads as without settings: its stored layers as they are (torch's
        kernels, the output projection dense), else dense."""
        if stored is None:
            return cls.uniform()
        return cls(checkpoint_method(stored, None), UnquantizedLinearMethod(), name=stored.method)

    def method_for(self, prefix: str, shape: Shape) -> LinearMethod:
        """The method of the layer at `prefix` (its module name in the model), of (out, in) `shape`."""
        kept = self._gguf_method(self.gguf_types.get(prefix, ""))
        if kept is not None:
            return kept
        if prefix == HEAD:
            if self.head is not None:
                return self.head
            table = self.gguf_types.get(GGUF_TABLE, "")
            if self.tied_gguf_head is not None and table == "Q8_0":
                return self.tied_gguf_head
            blocks = self._blocks()
            if blocks is not None and table in blocks.types:  # the table's own blocks
                return blocks
        return self.layers

    def _blocks(self) -> GGUFBlocksMethod | None:
        return next((m for m in self.gguf.values() if isinstance(m, GGUFBlocksMethod)), None)

    def _gguf_method(self, type_name: str) -> LinearMethod | None:
        """The method keeping a layer of `type_name` (types joined by '+': a fused layer mixing them)."""
        kept = self.gguf.get(type_name)
        blocks = self._blocks()
        mixed = "+" in type_name and blocks is not None and all(t in blocks.types for t in type_name.split("+"))
        if kept is None and mixed:
            return blocks
        return kept

    def embedding_blocks(self, tied: bool) -> GGUFBlocksMethod | None:
        """The blocks method when the embedding table stays in its GGUF blocks (a tied table whose
        output projection is not one of them stays dense: that head reads or quantizes it)."""
        blocks = self._blocks()
        table = self.gguf_types.get(GGUF_EMBEDDING, "")
        if blocks is None or table not in blocks.types:
            return None
        if tied and self.method_for(HEAD, (0, 0)) is not blocks:
            return None
        return blocks

    def describe(self) -> str:
        """One phrase for the log: the method, the head's when it differs, the GGUF types kept."""
        head = self.method_for(HEAD, (0, 0))
        text = self.name
        if head is not self.layers:
            text += f" (head {getattr(head, 'name', 'dense')})"
        if self.gguf:
            text += f" (GGUF {', '.join(sorted(self.gguf))} kept as stored)"
        return text


def _check_unquantized(settings: QuantSettings) -> None:
    if settings.group_size is not None or settings.head != "same":
        raise ValueError(
            "quantization_group_size, quantization_head: apply to int8, int4 or w8a8; "
            f"quantization is {settings.quantization}"
        )


def build_quant_config(
    settings: QuantSettings,
    *,
    device: torch.device,
    dtype: torch.dtype,
    dense_backend: Callable[[], str],
    stored: CheckpointQuantization | None,
    gguf_types: Mapping[str, str] | None,
) -> QuantConfig:
    """The model's `QuantConfig` (module docstring): `dense_backend` names the dense method (`cpu` or
    `torch`, resolved by the caller when a dense method is asked for); `gguf_types` is a GGUF file's
    layer prefix -> tensor type (None: not a GGUF file). A ValueError names the setting at fault."""

    def kernels() -> CpuKernels | None:  # the native kernels the quantized methods run, where asked for
        return load_cpu_kernels() if settings.linear_backend != "torch" and dtype in NATIVE_DTYPES else None

    quantization = settings.quantization
    if quantization in ("auto", "none"):
        _check_unquantized(settings)
        dense = get_dense_linear_method(dense_backend())
        if stored is not None:
            if quantization == "none" or device.type != "cpu":
                raise ValueError(
                    f"quantization: this checkpoint is {stored.method.upper()}-quantized; it loads as stored "
                    f"(quantization auto) on a CPU device, not with quantization {quantization} on {device}"
                )
            return QuantConfig(checkpoint_method(stored, kernels()), dense, name=stored.method)  # (the head: dense)
        if quantization == "none" or gguf_types is None or device.type != "cpu":
            return QuantConfig(dense, name="none")
        repack = gguf_repack(settings.gguf_repack)
        return _gguf_config(dense, gguf_types, kernels(), gguf_layout(settings.gguf_layout), repack)
    if stored is not None:
        raise ValueError(
            f"quantization: this checkpoint is {stored.method.upper()}-quantized already; "
            f"leave quantization auto, not {quantization}"
        )
    if device.type != "cpu":
        raise ValueError(f"quantization: {quantization} runs on a CPU device, not {device}")
    spec = QuantSpec(quantization, settings.group_size, settings.group_fallback, settings.head)
    layers, head = quantized_methods(spec, kernels(), settings.gguf_layout, gguf_repack(settings.gguf_repack))
    return QuantConfig(layers, head, name=quantization)


def quantized_methods(
    spec: QuantSpec, kernels: CpuKernels | None, layout: str = "auto", repack: bool | None = None
) -> tuple[LinearMethod, LinearMethod | None]:
    """The projections' method and the output projection's own (None: the same) for quantizing at load
    by `spec` on this CPU: int8 / int4 in GGUF blocks where `in_blocks` says so (`layout`: the
    `gguf_layout` setting; `repack`: `gguf_repack`'s), else `spec`'s method. `tokenmill eval-quant` builds
    its models by this too."""
    settings = QuantSettings(spec.method, spec.group_size, spec.group_fallback, spec.head, gguf_layout=layout)
    if kernels is not None and in_blocks(settings):
        blocks = QuantSpec(spec.method, GGUF_BLOCK, spec.group_fallback, spec.head)
        return BlocksQuantMethod(blocks, kernels, repack), get_head_method(blocks, kernels)
    return get_quant_method(spec, kernels), get_head_method(spec, kernels)


def in_blocks(settings: QuantSettings, cpu: CpuKind | None = None) -> bool:
    """Whether `quantization` int8 / int4 keeps its weights in GGUF blocks (quant/int_blocks.py: Q8_0 /
    Q4_1) rather than tokenmill's int formats: the group size unset or 32 (the blocks'), and
    `gguf_layout` keeping a GGUF file's Q8_0 (int8) or Q4_0 / Q4_1 (int4) in blocks on `cpu` (None: this
    machine's), where its block type is repacked in 16-row groups there (`gguf_repack`): both with AVX-512
    VNNI, int4's Q4_1 alone on AVX2 (gguf_x16_avx2.h: the 1.1B model's prefill 1.28x the int4 kernels',
    eight requests 1.27x, one alike; int8 in Q8_0's file blocks lost there at eight requests, 0.82x,
    benchmarks/RESULTS.md)."""
    if settings.quantization not in ("int8", "int4") or settings.group_size not in (None, GGUF_BLOCK):
        return False
    kind = cpu or CpuKind.from_flags(cpu_flags())
    kept = ("blocks", "q8_0") if settings.quantization == "int8" else ("blocks",)
    return repacks_on(kind, BLOCK_TYPES[settings.quantization]) and gguf_layout(settings.gguf_layout, kind) in kept


def gguf_layout(setting: str, cpu: CpuKind | None = None) -> str:
    """`blocks`, `q8_0` or `int`: the form of a GGUF file's Q8_0 / Q4_0 / Q4_1 matrices; `auto` is the default
    rule for `cpu` (None: this machine's, from /proc/cpuinfo's flags)."""
    if setting not in GGUF_LAYOUTS:
        raise ValueError(f"gguf_layout: expected one of {', '.join(GGUF_LAYOUTS)}, got {setting!r}")
    if setting != "auto":
        return setting
    return default_choice("gguf_layout", ANY, ANY, cpu or CpuKind.from_flags(cpu_flags()), GGUF_LAYOUTS[1:])


def gguf_repack(setting: str) -> bool | None:
    """`GGUFBlocksMethod`'s `repack` for the `gguf_repack` setting: None (auto: the CPU kind's rule per
    block type), True (x16: every type with the 16-row form) or False (file: none)."""
    if setting not in GGUF_REPACKS:
        raise ValueError(f"gguf_repack: expected one of {', '.join(GGUF_REPACKS)}, got {setting!r}")
    return None if setting == "auto" else setting == "x16"


def gguf_methods(
    kernels: CpuKernels | None, layout: str = "int", repack: bool | None = None
) -> dict[str, LinearMethod]:
    """A GGUF tensor type -> the method that keeps such matrices as stored: the K-quants (Q3_K to Q6_K)
    and Q5_0 / Q5_1 in their own blocks (which also take layers mixing block types, and embedding
    tables); Q8_0, Q4_0 and Q4_1 as well with `layout` blocks (Q8_0 alone with `q8_0`), the others of
    them Q8_0 in int8 and Q4_0 / Q4_1 in int4, in groups of 32 (the same grids). `repack`:
    `gguf_repack`'s."""
    blocks = GGUFBlocksMethod(kernels, repack=repack)
    kept: dict[str, LinearMethod] = {t: blocks for t in ("Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")}
    int8 = Int8LinearMethod(QuantSpec("int8", GGUF_BLOCK), kernels, prequantized=True)
    int4 = Int4LinearMethod(QuantSpec("int4", GGUF_BLOCK), kernels, prequantized=True)
    ints: dict[str, LinearMethod] = {"Q8_0": int8, "Q4_0": int4, "Q4_1": int4}
    in_blocks = GGUF_INT_TYPES if layout == "blocks" else ("Q8_0",) if layout == "q8_0" else ()
    return {t: blocks if t in in_blocks else m for t, m in ints.items()} | kept


def _gguf_config(
    dense: LinearMethod, gguf_types: Mapping[str, str], kernels: CpuKernels | None, layout: str, repack: bool | None
) -> QuantConfig:
    # a tied head over a Q8_0 table: int8 quantized from the table at load (`int`), else its blocks
    tied = None if layout in ("blocks", "q8_0") else Int8LinearMethod(QuantSpec("int8", GGUF_BLOCK), kernels)
    return QuantConfig(dense, None, gguf_methods(kernels, layout, repack), dict(gguf_types), tied, name="none")
