"""RoPE inverse frequencies and attention scaling equal transformers' for every supported variant."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.rotary import apply_rotary, inverse_frequencies
from tokenmill.models.config import parse_config

VARIANTS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768},
    {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
        "truncate": False,
    },
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "attention_factor": 1.3},
]


@pytest.mark.parametrize("params", VARIANTS, ids=lambda p: p["rope_type"])
def test_matches_transformers(params):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(
        hidden_size=512, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=dict(params)
    )
    raw = hf_cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]}
    ours = parse_config(raw, "config.json")
    inv_freq, scale = inverse_frequencies(ours.rope, ours.head_dim)
    if params["rope_type"] == "default":
        ref_inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, 128, 2).float() / 128))
        ref_scale = 1.0
    else:
        ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg, torch.device("cpu"))
    torch.testing.assert_close(inv_freq, ref_inv.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-7)


def test_rotation_preserves_norm_and_relative_position():
    from tokenmill.layers.rotary import RopeConfig, RotaryEmbedding

    rope = RotaryEmbedding(RopeConfig("default", 10000.0), head_dim=16, max_positions=64, device=torch.device("cpu"))
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)

    def rotated(x, pos):
        cos, sin = rope.cos_sin(torch.tensor([pos]), torch.float32)
        return apply_rotary(x, cos, sin)

    assert torch.allclose(rotated(q, 9).norm(), q.norm())
    # <R(m) q, R(n) k> depends only on m - n
    a = (rotated(q, 10) * rotated(k, 3)).sum()
    b = (rotated(q, 40) * rotated(k, 33)).sum()
    assert torch.allclose(a, b, atol=1e-5)
