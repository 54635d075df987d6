"""The device script (benchmarks/gpu/check.sh) runs end to end on the CPU with DRY_RUN=1 (Triton's
interpreter, tiny shapes, no timing), as the device would run it: without the server's packages
(importing one fails here), so that it is known to work before a device is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
# what the device lacks (it has torch, triton and transformers): importing any of these fails
SERVER_PACKAGES = ["fastapi", "uvicorn", "pydantic", "httpx", "msgspec", "llguidance", "prometheus_client", "gguf",
                   "compressed_tensors", "ray", "matplotlib", "jsonschema"]  # fmt: skip
WITHOUT_THEM = f"""
import runpy, sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {SERVER_PACKAGES!r}:
            raise ImportError("not on the device: " + name)
sys.meta_path.insert(0, Absent())
runpy.run_path("benchmarks/gpu/check.py", run_name="__main__")
"""


def test_the_dry_run_runs_end_to_end_without_the_server_packages(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_THEM], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_check_dry_run.json").read_text())
    assert result["dry_run"] and result["correctness"]["ok"]
    for path in ("triton_eager", "triton_cuda_graphs"):
        assert result["correctness"][path]["tokens_equal_cpu"]
        assert result["correctness"][path]["max_abs_logit_diff_vs_cpu"] < 1e-4
    assert set(result["roofline_tiny"]) >= {"decode_b1", "decode_b2", "ttft_2048_ms"}
    assert "sparse_2_4_linear" in result


@pytest.mark.slow  # (the same dry run again, through bash: ~11 s; the test above runs check.py itself)
def test_the_shell_script_runs_the_dry_run(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "benchmarks/gpu/check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "gpu_check_dry_run.json").is_file()
