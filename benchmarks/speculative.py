"""Speculative decoding with prompt lookup on SmolLM2-135M-Instruct (bfloat16), code-edit prompts.

Speed: `tokenmill bench offline --workload code-edit --compare speculative_config=none
speculative_config=<adaptive> [speculative_config=<fixed>]`, variants interleaved in each of 3
repeats, EOS respected (outputs with and without speculation are the same tokens, so both sides run
the same work), at 1, 4, 16 and 32 concurrent requests (4, 8, 32, 64 requests of ~256-token
snippets). `adaptive`: prompt lookup with k = 5 under the measured rule (sched/spec_policy.py);
`fixed`: the same, every draft verified (at 1 and 32 requests). Reported per variant: output
tokens/s, the ratio over none (median [min-max]), TPOT, the share of drafts kept and the tokens a
verification step yields.

The demo pair: the bundled demo model with its draft model (`tokenmill-demo-draft`), k = 3, the same
workload at one request: none, every draft verified, the measured rule.

Outputs: the share of distinct 4-grams among the greedy outputs of the workload's prompts (how much the
outputs repeat themselves; prompt lookup feeds on repetition of the context, prompt included).

Break-even: the engine's own step-time curve (`StepCurve`, steps without prompt chunks), recorded
while fixed-k speculation runs at each batch size B, and from it the mean tokens a verification step
must yield for k = 5 drafts each to pay: T(B (1 + k)) / T(B).

Writes benchmarks/results/speculative.json and prints its table in benchmarks/RESULTS.md.

Usage: python benchmarks/speculative.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

from common import RESULTS, ROOT, cell
from common import bench as run_bench

SMOLLM2 = ROOT.parent / "models" / "smollm2-135m-instruct"
DEMO = ROOT.parent / "models" / "tokenmill-demo"
DEMO_DRAFT = ROOT.parent / "models" / "tokenmill-demo-draft"
K = 5
ADAPTIVE = json.dumps({"method": "ngram", "num_speculative_tokens": K})
FIXED = json.dumps({"method": "ngram", "num_speculative_tokens": K, "adaptive": False})
CONCURRENCY = {1: 4, 4: 8, 16: 32, 32: 64}  # concurrency -> requests
WORKLOAD = ("--workload", "code-edit", "--input-len", "256", "--seed", "0")


def speed(repeats: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for conc, requests in CONCURRENCY.items():
        variants = ["speculative_config=none", f"speculative_config={ADAPTIVE}"]
        if conc in (1, 32):
            variants.append(f"speculative_config={FIXED}")
        out = RESULTS / "speculative" / f"c{conc}.json"  # the raw runs (not in git)
        out.parent.mkdir(parents=True, exist_ok=True)
        result = run_bench(
            "offline", str(SMOLLM2), *WORKLOAD, "--num-requests", str(requests), "--max-concurrency", str(conc),
            "--compare", *variants, "--repeats", str(repeats), "--dtype", "bfloat16", "--max-num-seqs", "32",
            "--no-ignore-eos", "--no-progress", "--out", str(out),
        )  # fmt: skip
        a, g = result.aggregate, result.gains
        base = "speculative_config=None"
        row: dict[str, Any] = {}
        labels = {base: "none", f"speculative_config={ADAPTIVE}": "adaptive", f"speculative_config={FIXED}": "fixed"}
        for label, name in labels.items():
            if label not in a:
                continue
            entry = {
                "output_tok_per_s": a[label]["output_throughput"],
                "tpot_ms": a[label]["tpot.median"],
                "output_tokens": a[label]["output_tokens"],
            }
            for extra in ("spec_decode_acceptance_rate", "spec_decode_mean_accepted_length"):
                if extra in a[label]:
                    entry[extra] = a[label][extra]
            if label != base:
                entry["over_none"] = g[f"{label} over {base}"]["output_throughput"]
            row[name] = entry
        rows[f"c{conc}"] = row
    return rows


def demo_pair(repeats: int) -> dict[str, Any]:
    """The bundled demo model with its draft, code-edit prompts at one request: no speculation, every
    draft verified, the measured rule."""
    draft = json.dumps({"method": "draft_model", "model": str(DEMO_DRAFT), "num_speculative_tokens": 3})
    fixed = json.dumps(
        {"method": "draft_model", "model": str(DEMO_DRAFT), "num_speculative_tokens": 3, "adaptive": False}
    )
    labels = {
        "speculative_config=None": "none",
        f"speculative_config={fixed}": "fixed",
        f"speculative_config={draft}": "adaptive",
    }
    out = RESULTS / "speculative" / "demo_pair.json"
    result = run_bench(
        "offline", str(DEMO), *WORKLOAD, "--num-requests", "4", "--max-concurrency", "1", "--compare",
        *(label.replace("None", "none") for label in labels), "--repeats", str(repeats), "--dtype", "bfloat16",
        "--no-ignore-eos", "--no-progress", "--out", str(out),
    )  # fmt: skip
    a, g = result.aggregate, result.gains
    row: dict[str, Any] = {}
    for label, name in labels.items():
        entry = {"output_tok_per_s": a[label]["output_throughput"], "tpot_ms": a[label]["tpot.median"]}
        for extra in ("spec_decode_acceptance_rate", "spec_decode_mean_accepted_length", "spec_decode_num_drafts"):
            if extra in a[label]:
                entry[extra] = a[label][extra]
        if name != "none":
            entry["over_none"] = g[f"{label} over speculative_config=None"]["output_throughput"]
        row[name] = entry
    return row


def outputs_and_curve() -> dict[str, Any]:
    """Distinct 4-grams of the greedy outputs, and the step-time curve under fixed-k speculation."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.workloads import WorkloadSpec, build_workload

    llm = LLM(str(SMOLLM2), dtype="bfloat16", max_num_seqs=32, speculative_config=FIXED)
    spec = WorkloadSpec("code-edit", num_requests=64, seed=0, input_len=(256, 256))
    workload = build_workload(spec, llm.engine.tokenizer)
    prompts = [r.token_ids(llm.engine.tokenizer) for r in workload.requests]
    limits = [r.max_tokens for r in workload.requests]
    curve: dict[str, Any] = {}
    outputs: list[list[int]] = []
    for batch in (1, 4, 16, 32):
        start = len(outputs)
        picked = range(start % 64, start % 64 + batch)
        params = [SamplingParams(temperature=0, max_tokens=limits[i % 64]) for i in picked]
        outs = llm.generate([prompts[i % 64] for i in picked], params, use_tqdm=False)
        outputs += [o.outputs[0].token_ids for o in outs]
        points = sorted(llm.engine.core.scheduler.drafts.policy.curve.buckets.values())  # type: ignore[attr-defined]
        curve[f"b{batch}"] = [{"tokens": n, "step_ms": t * 1e3} for n, t in points]
    grams = [tuple(o[i : i + 4]) for o in outputs for i in range(len(o) - 3)]
    share = len(set(grams)) / len(grams) if grams else None
    even = {}
    last = sorted(llm.engine.core.scheduler.drafts.policy.curve.buckets.values())  # type: ignore[attr-defined]
    curve_fn = llm.engine.core.scheduler.drafts.policy.curve  # type: ignore[attr-defined]
    for batch in (1, 4, 16, 32):
        plain, spec_t = curve_fn.seconds(batch), curve_fn.seconds(batch * (1 + K))
        if plain and spec_t:
            even[f"b{batch}"] = spec_t / plain
    return {
        "distinct_4gram_share": share,
        "outputs": len(outputs),
        "step_curve": curve,
        "final_curve": [{"tokens": n, "step_ms": t * 1e3} for n, t in last],
        "break_even_tokens_per_step_k5": even,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "speculative.json"))
    args = parser.parse_args()
    if not (SMOLLM2 / "config.json").is_file():
        raise SystemExit(f"{SMOLLM2} is not set up (make serve fetches it)")
    result: dict[str, Any] = {"model": str(SMOLLM2.name), "machine": platform.processor() or platform.machine()}
    result["speed"] = speed(args.repeats)
    result["demo_pair"] = demo_pair(args.repeats)
    result["outputs"] = outputs_and_curve()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("\nSmolLM2 code-edit, output tok/s and the ratio over none (median [min-max] of the repeats)")
    for conc, row in result["speed"].items():
        parts = [f"none {row['none']['output_tok_per_s']['median']:.1f}"]
        for name in ("adaptive", "fixed"):
            if name in row:
                r = row[name]
                kept = r.get("spec_decode_acceptance_rate", {}).get("median")
                parts.append(
                    f"{name} {r['output_tok_per_s']['median']:.1f} ({cell(r['over_none'])}x"
                    + (f", kept {kept:.0%}" if kept is not None else "")
                    + ")"
                )
        print(f"  {conc}: " + "; ".join(parts))
    d = result["demo_pair"]
    print(
        "demo pair (draft model, k = 3, one request): none {:.0f}; every draft {:.0f} ({}x, kept {:.0%}); "
        "adaptive {:.0f} ({}x)".format(
            d["none"]["output_tok_per_s"]["median"], d["fixed"]["output_tok_per_s"]["median"],
            cell(d["fixed"]["over_none"]), d["fixed"]["spec_decode_acceptance_rate"]["median"],
            d["adaptive"]["output_tok_per_s"]["median"], cell(d["adaptive"]["over_none"]),
        )
    )  # fmt: skip
    o = result["outputs"]
    print(f"distinct 4-grams in the outputs: {o['distinct_4gram_share']:.1%}")
    print("break-even tokens a verification step must yield (k = 5):", o["break_even_tokens_per_step_k5"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
