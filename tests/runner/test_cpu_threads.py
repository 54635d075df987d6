"""torch's threads: one per physical core the process may use (hyperthread siblings counted once),
unless `cpu_threads` says otherwise."""

from __future__ import annotations

import os

import torch

from tokenmill import LLM
from tokenmill.runner.cpu_threads import physical_cores


def fake_sysfs(root, cores_of_cpu):
    for cpu, (package, core) in cores_of_cpu.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    return root


def test_siblings_count_once_and_only_allowed_cpus_count(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    # cpus 0/2 and 1/3 are hyperthread pairs; cpu 4 is not ours
    sysfs = fake_sysfs(tmp_path, {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1), 4: (0, 2)})
    assert physical_cores(sysfs) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert physical_cores(sysfs) == 3
    assert physical_cores(tmp_path / "missing") == 5  # no topology files: every CPU counts


def test_the_engine_sets_torch_threads(tiny_model_dir):
    before = torch.get_num_threads()
    try:
        LLM(str(tiny_model_dir("llama")), kv_cache_memory=16 * 24576, max_model_len=64, cpu_threads=1)
        assert torch.get_num_threads() == 1
        LLM(str(tiny_model_dir("llama")), kv_cache_memory=16 * 24576, max_model_len=64)
        assert torch.get_num_threads() == physical_cores()
    finally:
        torch.set_num_threads(before)
