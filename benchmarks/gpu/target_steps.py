"""A `tokenmill doctor --target-steps` file from the machine it runs on: the doctor's step-cost probe on an
engine there (cuda by default), its decode and prompt steps written with the model's config.json, so
the doctor elsewhere can calibrate that target's roofline on them ("roofline, calibrated").

The probe (`doctor/step_cost.probe`) times one-request prompt steps over a grid of lengths and decode
steps of 1 .. max_num_seqs requests; each shape's median is written as {chunks, decoding, seconds}.

Usage: python benchmarks/gpu/target_steps.py MODEL --target h100 [--device cuda] [--max-num-seqs 64]
    [--out results/target_steps_h100.json]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from tokenmill.config import EngineConfig
from tokenmill.doctor.hardware import load_target
from tokenmill.doctor.step_cost import probe
from tokenmill.doctor.targets import measured_steps_record
from tokenmill.engine.engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--target", required=True, help="the sheet this machine is (h100, ..., or a YAML)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    load_target(args.target)  # (a bad name fails before the probe)
    config = EngineConfig.from_kwargs(
        args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False
    )
    engine = LLMEngine(config)
    cost = probe(engine)
    raw = json.loads((Path(args.model) / "config.json").read_text())
    source = f"step-cost probe of {args.model} on {platform.node()} ({args.device}, {args.dtype})"
    record = measured_steps_record(cost, args.target, raw, "bfloat16", source)
    out = Path(args.out or Path(__file__).resolve().parents[1] / "results" / f"target_steps_{args.target}.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}: {len(record['steps'])} steps")


if __name__ == "__main__":
    main()
