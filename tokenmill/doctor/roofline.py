"""The roofline step model: what one engine step of a model costs on a machine from its bytes and FLOPs,
and the efficiency factors that bring it to measured steps.

A step's chunks ((query length q, start position s) each, as the simulator's cost models take them):
- bytes: every weight of the layers and the LM head read once (the embedding only reads a row a
  token: left out), each chunk's s + q keys and values read (its context, itself included) and its q
  written;
- FLOPs: 2 per weight per token in the layers, 2 per head weight per sampled row (one a chunk), and
  attention's 4 x layers x heads x head_dim per (query, key) pair (QK^T and PV), a chunk scoring
  q s + q (q + 1) / 2 pairs (causal);
- roofline seconds: max(bytes / bandwidth, FLOPs / peak).
A `RooflineCost` prices a step as roofline / efficiency + overhead, with a factor and an overhead for
decode steps (every chunk one token) and another for the rest (prefill and mixed steps). `fit` finds
them from (roofline seconds, measured seconds) pairs by least squares on measured = roofline /
efficiency + overhead in relative error (overhead kept >= 0), and the band: the largest relative error of the fit on its
own points.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.doctor.hardware import Target
from tokenmill.doctor.model_fit import count_parameters
from tokenmill.doctor.step_cost import StepCost
from tokenmill.models.config import ModelConfig

# weight storage -> (bytes a weight, the peak it computes at)
WEIGHT_DTYPES = {"float32": (4.0, "float32"), "bfloat16": (2.0, "bfloat16"), "fp8": (1.0, "fp8"), "int8": (1.0, "int8")}


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a model (from its config.json)."""

    layer_weights: int  # weights in the layers' linear maps (all layers)
    head_weights: int  # the LM head's (vocab x hidden, tied or not: it is read every step)
    attention_flops_per_pair: int  # 4 x layers x heads x head_dim
    kv_bytes_per_token: float  # layers x KV heads x head_dim x 2 x bytes a value
    weight_bytes_per_param: float = 2.0

    @classmethod
    def of(cls, cfg: ModelConfig, weight_bytes: float = 2.0, kv_value_bytes: float = 2.0) -> ModelShape:
        params = count_parameters(cfg)
        head = cfg.vocab_size * cfg.hidden_size
        layers = params.linear - (0 if cfg.tie_word_embeddings else head)
        kv = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * kv_value_bytes
        return cls(layers, head, 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim, kv, weight_bytes)

    @property
    def weight_read_bytes(self) -> float:
        return (self.layer_weights + self.head_weights) * self.weight_bytes_per_param


def step_bytes(shape: ModelShape, chunks: Sequence[tuple[int, int]]) -> float:
    """Bytes a step reads and writes: the weights once, each chunk's KV (s + q read, q written)."""
    kv_tokens = sum(s + 2 * q for q, s in chunks)
    return shape.weight_read_bytes + kv_tokens * shape.kv_bytes_per_token


def step_flops(shape: ModelShape, chunks: Sequence[tuple[int, int]]) -> float:
    tokens = sum(q for q, _ in chunks)
    pairs = sum(q * s + q * (q + 1) / 2 for q, s in chunks)
    return (
        2 * shape.layer_weights * tokens + 2 * shape.head_weights * len(chunks) + shape.attention_flops_per_pair * pairs
    )


def roofline_seconds(shape: ModelShape, target: Target, dtype: str, chunks: Sequence[tuple[int, int]]) -> float:
    return max(step_bytes(shape, chunks) / target.bandwidth, step_flops(shape, chunks) / target.peak(dtype))


@dataclass
class Fit:
    efficiency: float  # roofline seconds / (measured - overhead)
    overhead: float  # seconds a step beyond its roofline
    band: float  # the largest relative error of the fit on its own points
    points: int


@dataclass
class Calibration:
    """Efficiency factors and overheads for decode and other steps, and where they came from."""

    decode: Fit
    other: Fit
    source: str  # e.g. "this machine's probe (24 steps)" or a file of GPU measurements
    on: str  # the target whose steps were measured ("here", "h100", ...)

    @property
    def band(self) -> float:
        return max(self.decode.band, self.other.band)

    def carried(self) -> Calibration:
        """These factors for another machine: efficiencies held to at most 1 (above 1 says this machine's
        measured roofline was low; no step beats the target's sheet)."""
        d, o = (Fit(min(f.efficiency, 1.0), f.overhead, f.band, f.points) for f in (self.decode, self.other))
        return Calibration(d, o, self.source, self.on)


def fit(pairs: Sequence[tuple[float, float]]) -> Fit:
    """(roofline seconds, measured seconds) -> measured = roofline / efficiency + overhead, least squares
    in relative error (each point weighted 1 / measured^2: a long prefill's noise must not swamp a short
    step's overhead) with the overhead >= 0 (else the line through the origin). Steps that do not grow
    with their roofline (all overhead: a small model) get efficiency 1 and their mean excess as
    overhead, so a larger model's steps on another machine still pay their roofline. An efficiency
    above 1 says the measured roofline is below what the kernels reach."""
    if not pairs:
        raise ValueError("calibration: no measured steps to fit")
    xs, ys = [p[0] for p in pairs], [p[1] for p in pairs]
    if min(xs) <= 0 or min(ys) <= 0:
        raise ValueError("calibration: step times and rooflines must be above 0")
    ws = [1 / (y * y) for y in ys]
    sw, swx, swy = (
        sum(ws),
        sum(w * x for w, x in zip(ws, xs, strict=True)),
        sum(w * y for w, y in zip(ws, ys, strict=True)),
    )
    swxx = sum(w * x * x for w, x in zip(ws, xs, strict=True))
    swxy = sum(w * x * y for w, x, y in zip(ws, xs, ys, strict=True))
    det = swxx * sw - swx * swx
    slope = (swxy * sw - swx * swy) / det if det > 1e-12 * swxx * sw else 0.0
    overhead = (swy - slope * swx) / sw
    if slope <= 0:
        slope, overhead = 1.0, max(0.0, (swy - swx) / sw)
    elif overhead < 0:
        slope, overhead = swxy / swxx, 0.0
    band = max(abs(x * slope + overhead - y) / y for x, y in zip(xs, ys, strict=True))
    return Fit(1 / slope, overhead, band, len(xs))


@dataclass
class RooflineCost:
    """The simulator's cost model for a target: roofline / efficiency + overhead, per kind of step."""

    shape: ModelShape
    target: Target
    calibration: Calibration
    dtype: str = "bfloat16"  # the peak the steps compute at
    notes: list[str] = field(default_factory=list)

    def predict(self, chunks: Sequence[tuple[int, int]], decoding: bool) -> float:
        f = self.calibration.decode if decoding else self.calibration.other
        return roofline_seconds(self.shape, self.target, self.dtype, chunks) / f.efficiency + f.overhead


def probe_points(cost: StepCost, context: int = 16) -> tuple[list[list[tuple[int, int]]], list[list[tuple[int, int]]]]:
    """The step shapes the probe measured: decode steps of B requests at `context` (its short
    context), and one-request prompt steps of T tokens from position 0."""
    decode = [[(1, context)] * b for b in cost.decode_batch]
    prompt = [[(t, 0)] for t in cost.prompt_tokens]
    return decode, prompt


def calibrate_here(cost: StepCost, shape: ModelShape, here: Target, dtype: str) -> Calibration:
    """The factors and overheads that bring this machine's roofline to its probed steps (as the cost
    model prices them: the probe's medians, scaled by the run of the trace's first requests)."""
    decode, prompt = probe_points(cost)
    fits = [
        fit([(roofline_seconds(shape, here, dtype, c), cost.predict(c, decoding)) for c in shapes])
        for shapes, decoding in ((decode, True), (prompt, False))
    ]
    points = len(decode) + len(prompt)
    return Calibration(fits[0], fits[1], f"this machine's probed steps ({points} step shapes)", "here")
