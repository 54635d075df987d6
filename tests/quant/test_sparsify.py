"""2:4 pruning (`tokenmill sparsify`): the pattern holds in every decoder projection and nowhere else;
magnitude keeps the 2 largest of 4, wanda weighs them by their inputs' norms; the folder loads and
runs (dense on a CPU, said in the log), and the quality report compares it with the dense model
(the storage format and the GPU path: test_sparse24.py)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open

from tokenmill.cli import main as tokenmill
from tokenmill.llm import LLM
from tokenmill.quant.sparse24 import is_2_4
from tokenmill.tools.sparsify import PROJECTION, prune_2_4, sparsify_folder


def test_prune_keeps_the_two_best_scored_of_every_four():
    w = torch.tensor([[1.0, -4.0, 3.0, 2.0, 0.5, 0.1, -0.2, 9.0]])
    assert prune_2_4(w, w.abs()).tolist() == [[0.0, -4.0, 3.0, 0.0, 0.5, 0.0, 0.0, 9.0]]
    score = w.abs() * torch.tensor([[10.0, 1, 1, 1, 1, 1, 1, 1]])  # a loud first input keeps its small weight
    assert prune_2_4(w, score).tolist() == [[1.0, -4.0, 0.0, 0.0, 0.5, 0.0, 0.0, 9.0]]
    with pytest.raises(ValueError, match="multiples of 4"):
        prune_2_4(torch.ones(2, 6), torch.ones(2, 6))


@pytest.mark.parametrize("method", ["magnitude", "wanda"])
def test_a_sparsified_folder_has_the_pattern_loads_and_runs(tiny_model_dir, tmp_path, method, caplog):
    src = tiny_model_dir("llama")
    out = sparsify_folder(src, tmp_path / method, method, windows=2, length=64, storage="dense")
    sparsity = json.loads((out / "config.json").read_text())["quantization_config"]["sparsity_config"]
    assert sparsity["format"] == "dense" and sparsity["sparsity_structure"] == "2:4"
    assert sparsity["ignore"] == ["lm_head"] and 0.4 < sparsity["global_sparsity"] <= 0.5 + 1e-9
    pruned = 0
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        for name in names:
            w = f.get_tensor(name)
            if PROJECTION.match(name):
                assert is_2_4(w) and float((w == 0).float().mean()) >= 0.5, name
                pruned += 1
            elif w.dim() == 2 and w.shape[1] % 4 == 0:
                assert not is_2_4(w), name  # the embedding and the output projection stay whole
    assert pruned == 7 * sum(1 for n in names if n.endswith("mlp.down_proj.weight"))
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        llm = LLM(str(out), max_model_len=128, kv_cache_memory=16 * 24576)
    assert "2:4 sparse weights run dense on cpu" in caplog.text
    out_tokens = llm.generate([{"prompt_token_ids": [5, 6, 7]}], None)[0].outputs[0].token_ids
    assert len(out_tokens) == 16


def test_the_command_reports_the_quality_against_the_dense_model(tiny_model_dir, tmp_path, capsys):
    report = tmp_path / "report.json"
    args = ["sparsify", str(tiny_model_dir("llama")), "--method", "magnitude", "--out", str(tmp_path / "s")]
    assert tokenmill([*args, "--windows", "2", "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["quantization"] == "2:4 sparse (magnitude)" and data["mean_kl_nats"] > 0
    assert 0 <= data["top1_agreement"] <= 1 and data["predicted_tokens"] > 0
    assert "wrote" in capsys.readouterr().out
    assert tokenmill(args) == 2  # an existing folder is refused, in one line
    err = capsys.readouterr().err
    assert "out:" in err and "already exists" in err
