"""`tokenmill eval-quant`: what a quantization costs in quality and what it saves in memory, measured.

The unquantized and the quantized model (same dtype, the engine's kernels, tuned as the engine
tunes them) read the same held-out text in windows; at every position but a window's first, each
model's full next-token distribution is compared:
- perplexity of each on the text (exp of the mean negative log-likelihood of the actual next token);
- mean KL divergence KL(unquantized || quantized) of the two distributions, in nats;
- top-1 agreement: the share of positions whose argmax tokens agree (what greedy decoding sees);
and the weight bytes of each, and the KV cache tokens the difference buys at the model's KV bytes a
token. The text is `--text FILE` (tokenized whole), or by default the standard library's held-out
files (eval/stdlib_text.py), which the demo models never trained on.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.eval.stdlib_text import read, split
from tokenmill.kernels.autotune import Autotuner, default_cache_path
from tokenmill.kernels.cpu_build import load_cpu_kernels
from tokenmill.layers.attention import AttentionBackend, allocate_kv_cache
from tokenmill.layers.backends import get_attention_backend
from tokenmill.layers.ops import get_layer_ops
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.loader import load_model
from tokenmill.quant.config import quantized_methods
from tokenmill.quant.cpu_dense import get_dense_linear_method
from tokenmill.quant.quantize import QuantSpec
from tokenmill.runner.kv_cache import kv_bytes_per_block
from tokenmill.runner.model_builder import prepare_native
from tokenmill.text.tokenizer import Tokenizer

BLOCK = 16


@dataclass(frozen=True)
class QuantEvalReport:
    model: str
    quantization: str
    group_size: int | None  # as asked (None: the method's default)
    head: str  # the output projection's quantization ("same": the layers')
    dtype: str
    text: str  # where the text came from
    windows: int
    predicted_tokens: int  # positions compared
    perplexity_unquantized: float
    perplexity_quantized: float
    mean_kl_nats: float
    top1_agreement: float
    weight_bytes_unquantized: int
    weight_bytes_quantized: int
    kv_bytes_per_token: int
    kv_tokens_freed: int  # the weight bytes saved, as KV cache tokens

    @property
    def perplexity_change(self) -> float:
        """Relative change of perplexity (+0.01: 1% worse)."""
        return self.perplexity_quantized / self.perplexity_unquantized - 1

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "perplexity_change": self.perplexity_change}

    def render(self) -> str:
        mib = 2**20
        return "\n".join(
            [
                f"{self.model}: {self.quantization}"
                + (f" (groups of {self.group_size})" if self.group_size else "")
                + (f", output projection {self.head}" if self.head != "same" else "")
                + f" against {self.dtype}, {self.predicted_tokens} predicted tokens of {self.text}",
                f"  perplexity      {self.perplexity_unquantized:.4f} -> {self.perplexity_quantized:.4f} "
                f"({100 * self.perplexity_change:+.2f}%)",
                f"  mean KL         {self.mean_kl_nats:.5f} nats (unquantized || quantized)",
                f"  top-1 agreement {100 * self.top1_agreement:.2f}%",
                f"  weights         {self.weight_bytes_unquantized / mib:.1f} MiB -> "
                f"{self.weight_bytes_quantized / mib:.1f} MiB "
                f"({self.weight_bytes_quantized / self.weight_bytes_unquantized:.2f}x)",
                f"  KV cache        the {(self.weight_bytes_unquantized - self.weight_bytes_quantized) / mib:.1f} MiB "
                f"saved hold {self.kv_tokens_freed} more tokens ({self.kv_bytes_per_token} bytes a token)",
            ]
        )


def text_windows(tokenizer: Tokenizer, text_file: Path | None, windows: int, length: int) -> tuple[torch.Tensor, str]:
    """[n, length] token ids (n <= windows) of the text, and a description of where it came from."""
    ids: list[int] = []
    if text_file is not None:
        if not text_file.is_file():
            raise ValueError(f"text: {text_file} is not a file")
        text = text_file.read_text(encoding="utf-8", errors="replace")
        ids = tokenizer.hf.encode(text, add_special_tokens=False, verbose=False)  # no warning past the model length
        source = str(text_file)
    else:
        for relative in split()[1]:
            ids.extend(tokenizer.hf.encode(read(relative), add_special_tokens=False, verbose=False))
            if len(ids) >= windows * length:
                break
        source = "the standard library's held-out files"
    n = min(windows, len(ids) // length)
    if n == 0:
        raise ValueError(f"text: {len(ids)} tokens, fewer than one window of {length}")
    return torch.tensor(ids[: n * length], dtype=torch.int64).view(n, length), source


@dataclass(frozen=True)
class Loaded:
    model: LlamaForCausalLM
    backend: AttentionBackend


def _load(model: str, dtype: str, spec: QuantSpec | None, length: int, tuner: Autotuner) -> Loaded:
    """The model as the engine builds it on this CPU (native kernels where they build, tuned)."""
    backend = get_attention_backend("auto")
    kernels = load_cpu_kernels()
    method, head = (get_dense_linear_method("auto"), None) if spec is None else quantized_methods(spec, kernels)
    loaded = load_model(
        model, dtype=dtype, backend=backend, ops=get_layer_ops("auto"), linear_method=method, head_method=head
    )
    prepare_native(loaded, tuner, 1, length, tune=True, fused=False)
    return Loaded(loaded, backend)


@torch.inference_mode()
def _log_probs(loaded: Loaded, ids: torch.Tensor) -> torch.Tensor:  # [L] -> [L - 1, vocab] float32
    model, backend = loaded.model, loaded.backend
    cfg = model.config
    length = ids.shape[0]
    blocks = -(-length // BLOCK)
    dtype = model.dtype
    caches = allocate_kv_cache(backend, cfg.num_layers, blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype)
    md = backend.build_metadata([length], [length], [list(range(blocks))], BLOCK)
    hidden = model(ids, torch.arange(length), caches, md)
    return torch.log_softmax(model.compute_logits(hidden[:-1]), dim=-1)


def evaluate(
    model: str,
    spec: QuantSpec,
    dtype: str = "auto",
    text_file: Path | None = None,
    windows: int = 16,
    length: int = 512,
) -> QuantEvalReport:
    """The report for `spec` on `model` (a folder or GGUF file)."""
    tuner = Autotuner(torch.device("cpu"), default_cache_path())
    ref = _load(model, dtype, None, length, tuner)
    quant = _load(model, dtype, spec, length, tuner)
    return _compare(model, spec.method, spec.group_size, spec.head, ref, quant, text_file, windows, length)


def compare_folders(
    reference: str, candidate: str, label: str, dtype: str = "auto", text_file: Path | None = None,
    windows: int = 16, length: int = 512,
) -> QuantEvalReport:  # fmt: skip
    """The same measures for another folder of the same model (a pruned copy: `label` says what it is)."""
    tuner = Autotuner(torch.device("cpu"), default_cache_path())
    ref = _load(reference, dtype, None, length, tuner)
    other = _load(candidate, dtype, None, length, tuner)
    return _compare(reference, label, None, "same", ref, other, text_file, windows, length)


def _compare(
    model: str, label: str, group_size: int | None, head: str, ref: Loaded, quant: Loaded,
    text_file: Path | None, windows: int, length: int,
) -> QuantEvalReport:  # fmt: skip
    wins, source = text_windows(Tokenizer(model), text_file, windows, length)
    nll_ref = nll_quant = kl = 0.0
    agree = count = 0
    for window in wins:
        lp_ref, lp_quant = _log_probs(ref, window), _log_probs(quant, window)
        target = window[1:, None]
        nll_ref -= lp_ref.gather(-1, target).sum().item()
        nll_quant -= lp_quant.gather(-1, target).sum().item()
        kl += (lp_ref.exp() * (lp_ref - lp_quant)).sum().item()
        agree += int((lp_ref.argmax(-1) == lp_quant.argmax(-1)).sum())
        count += target.shape[0]
    dense, quantized = ref.model, quant.model
    torch_dtype = dense.dtype
    kv_token = kv_bytes_per_block(ref.backend, dense.config, 1, torch_dtype)
    saved = dense.weight_bytes() - quantized.weight_bytes()
    return QuantEvalReport(
        model=str(model),
        quantization=label,
        group_size=group_size,
        head=head,
        dtype=str(torch_dtype).removeprefix("torch."),
        text=source,
        windows=len(wins),
        predicted_tokens=count,
        perplexity_unquantized=math.exp(nll_ref / count),
        perplexity_quantized=math.exp(nll_quant / count),
        mean_kl_nats=kl / count,
        top1_agreement=agree / count,
        weight_bytes_unquantized=dense.weight_bytes(),
        weight_bytes_quantized=quantized.weight_bytes(),
        kv_bytes_per_token=kv_token,
        kv_tokens_freed=max(0, saved) // kv_token,
    )
