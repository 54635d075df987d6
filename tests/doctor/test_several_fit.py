"""`tokenmill doctor --models FILE`: each model's memory as the several-model server's `--memory`
counts it (`ModelSpec.memory_bytes` of the same models file), whether they all fit, and when they do
not, the groups that fit together, the pairs that take turns and the `--memory` that holds all."""

from __future__ import annotations

import json
from pathlib import Path

from tokenmill.cli import main
from tokenmill.config import EngineConfig
from tokenmill.doctor.several_fit import available_memory, several_fit
from tokenmill.server.model_catalog import read_models_file


def models_file(tmp_path: Path, llama: Path, qwen: Path) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(
        f"big:\n  model: {llama}\n  kv_cache_memory: 8MiB\n"
        f"mid:\n  model: {llama}\n  kv_cache_memory: 4MiB\n  dtype: bfloat16\n"
        f"small:\n  model: {qwen}\n  kv_cache_memory: 1MiB\n  dtype: bfloat16\n",
        encoding="utf-8",
    )
    return path


def run_doctor(path: Path, out: Path, *memory: str) -> dict:
    assert main(["doctor", "--models", str(path), *memory, "--out", str(out)]) == 0
    assert (out / "report.md").read_text().startswith("# tokenmill doctor")
    return json.loads((out / "report.json").read_text())


def test_the_doctor_weighs_a_models_file_as_the_server_counts_it(tiny_model_dir, tmp_path: Path, capsys) -> None:
    path = models_file(tmp_path, tiny_model_dir("llama"), tiny_model_dir("qwen3"))
    specs = {s.name: s for s in read_models_file(str(path), EngineConfig(model="."))}
    size = {name: s.memory_bytes for name, s in specs.items()}
    assert size["big"] > size["mid"] > size["small"]  # (8 MiB of KV over 4 over 1; mid and small in bfloat16)

    report = run_doctor(path, tmp_path / "all")  # the budget: this machine's available memory
    fit = report["several_fit"]
    assert [(m["name"], m["weight_bytes"], m["kv_bytes"], m["memory_bytes"]) for m in fit["models"]] == [
        (s.name, s.weight_bytes, s.kv_bytes, s.memory_bytes) for s in specs.values()
    ]
    assert fit["total_bytes"] == sum(size.values()) and fit["all_fit"] and fit["budget_source"] == "available memory"
    assert fit["budget_bytes"] > 0 and abs(fit["budget_bytes"] - available_memory()) < 2**30
    assert report["findings"][0]["verdict"].startswith("all 3 models fit at once")
    assert "all 3 models fit at once" in capsys.readouterr().out


def test_models_that_do_not_fit_together_are_grouped_and_take_turns(tiny_model_dir, tmp_path: Path) -> None:
    path = models_file(tmp_path, tiny_model_dir("llama"), tiny_model_dir("qwen3"))
    size = {s.name: s.memory_bytes for s in read_models_file(str(path), EngineConfig(model="."))}
    budget = size["big"] + size["small"]  # big with small, mid with small, never big with mid

    fit = run_doctor(path, tmp_path / "turns", "--memory", str(budget))["several_fit"]
    assert not fit["all_fit"] and fit["budget_bytes"] == budget and fit["budget_source"] == "--memory"
    assert fit["groups"] == [["big", "small"], ["mid", "small"]]
    assert fit["apart"] == [["big", "mid"]] and fit["too_large"] == []
    assert fit["total_bytes"] == sum(size.values())
    text = (tmp_path / "turns" / "report.md").read_text()
    assert f"--memory {sum(size.values())}" in text and "take turns: big and mid" in text

    # a budget below the largest model alone: it is named, the others still weighed
    specs = read_models_file(str(path), EngineConfig(model="."))
    small_budget = several_fit(specs, size["mid"] + size["small"])
    assert small_budget.too_large == ["big"] and small_budget.groups == [["mid", "small"]]
    assert small_budget.apart == [] and "refuses to start" in small_budget.finding().pitfalls[0]


def test_the_doctor_takes_a_models_file_or_a_model(tiny_model_dir, tmp_path: Path) -> None:
    path = models_file(tmp_path, tiny_model_dir("llama"), tiny_model_dir("qwen3"))
    assert main(["doctor", str(tiny_model_dir("llama")), "--models", str(path), "--out", str(tmp_path)]) == 2
    assert main(["doctor", "--models", str(tmp_path / "none.yaml"), "--out", str(tmp_path)]) == 2
