"""Question 1 for several models (`tokenmill doctor --models FILE [--memory SIZE]`): which of a models
file's models fit in memory together, and which must take turns.

Each model counts what a several-model server's `--memory` least-recently-used unloading counts for
it before it loads: `ModelSpec.memory_bytes`, its weight files' size scaled to the dtype and weight
quantization it will run in, plus its KV cache budget (`kv_cache_memory`, else the CPU default); the
models file is read by the same `read_models_file` as `serve --models`. The budget is `--memory`, else
this machine's available memory (the kernel's MemAvailable: free memory plus the page cache it can
drop). Nothing is loaded: the figures are the files' sizes and the settings.

The answer: whether all fit at once; if not, the largest groups that fit together (every group of
models whose sum fits, none of which another model could join; enumerated for up to `MAX_ENUMERATED`
models), the pairs that can never be loaded together (requests for one unload the other), the models
too large on their own (a server refuses to start with them), and the `--memory` that holds them all.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tokenmill.config import EngineConfig
from tokenmill.doctor.findings import Finding, render_finding
from tokenmill.server.model_catalog import ModelSpec, read_models_file, scan_models_dir

MAX_ENUMERATED = 16  # models whose every subset is weighed (2^16 sums)
MAX_LISTED = 20  # groups the report names
GIB = 2**30


@dataclass
class ModelFigures:
    name: str
    path: str
    weight_bytes: int
    kv_bytes: int
    memory_bytes: int  # weight_bytes + kv_bytes, as the server's --memory counts it


@dataclass
class SeveralFit:
    budget_bytes: int
    budget_source: str  # "--memory" or "available memory"
    models: list[ModelFigures]
    total_bytes: int  # all models at once: the --memory that holds them all
    all_fit: bool
    too_large: list[str]  # models larger than the budget on their own
    groups: list[list[str]]  # the largest groups that fit together (empty when all fit or not enumerated)
    apart: list[tuple[str, str]]  # pairs never loaded together

    def finding(self) -> Finding:
        return several_finding(self)


def available_memory() -> int:
    """This machine's available memory: MemAvailable from /proc/meminfo, else the free pages."""
    try:
        for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # (kB)
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def read_specs(models: str | None, models_dir: str | None, base: EngineConfig) -> list[ModelSpec]:
    if (models is None) == (models_dir is None):
        raise ValueError("--models FILE or --models-dir DIR: give one")
    return read_models_file(models, base) if models is not None else scan_models_dir(models_dir or "", base)


def several_fit(specs: list[ModelSpec], memory: int | None) -> SeveralFit:
    """Weigh `specs` against `memory` bytes (None: this machine's available memory)."""
    budget = memory if memory is not None else available_memory()
    figures = [
        ModelFigures(s.name, s.config.model, s.weight_bytes, s.kv_bytes, s.memory_bytes)
        for s in specs
    ]  # fmt: skip
    size = {f.name: f.memory_bytes for f in figures}
    total = sum(size.values())
    fitting = [f.name for f in figures if f.memory_bytes <= budget]
    apart = [
        (a, b) for i, a in enumerate(fitting) for b in fitting[i + 1 :] if size[a] + size[b] > budget
    ]  # fmt: skip
    groups = [] if total <= budget or len(fitting) > MAX_ENUMERATED else largest_groups(fitting, size, budget)
    return SeveralFit(
        budget,
        "--memory" if memory is not None else "available memory",
        figures,
        total,
        total <= budget,
        [f.name for f in figures if f.memory_bytes > budget],
        groups,
        apart,
    )


def largest_groups(names: list[str], size: dict[str, int], budget: int) -> list[list[str]]:
    """Every group of `names` whose sizes sum within `budget` that no other name could join, the
    largest sums first (each group in the models file's order)."""
    n = len(names)
    sums = [0] * (1 << n)
    for mask in range(1, 1 << n):
        low = (mask & -mask).bit_length() - 1
        sums[mask] = sums[mask & (mask - 1)] + size[names[low]]
    maximal = [
        mask
        for mask in range(1, 1 << n)
        if sums[mask] <= budget and all(mask >> i & 1 or sums[mask | 1 << i] > budget for i in range(n))
    ]
    maximal.sort(key=lambda m: (-sums[m], m))
    return [[names[i] for i in range(n) if m >> i & 1] for m in maximal]


def several_finding(fit: SeveralFit) -> Finding:
    size = {f.name: f.memory_bytes for f in fit.models}
    evidence = [
        f"{f.name}: {gib(f.memory_bytes)} = weights {gib(f.weight_bytes)} + KV cache {gib(f.kv_bytes)} ({f.path})"
        for f in fit.models
    ]
    evidence.append(f"all at once: {gib(fit.total_bytes)}, the budget ({fit.budget_source}): {gib(fit.budget_bytes)}")
    pitfalls = [
        f"{name} alone needs {gib(size[name])}, more than the budget: `serve --models` refuses to start with it"
        for name in fit.too_large
    ]
    need = f"--memory {fit.total_bytes} (about {gib(fit.total_bytes)}) holds all {len(fit.models)} at once"
    if fit.all_fit:
        verdict = f"all {len(fit.models)} models fit at once: {gib(fit.total_bytes)} of {gib(fit.budget_bytes)}"
        return Finding("1. Model fit (several models)", verdict, evidence, pitfalls=pitfalls)
    verdict = f"not all at once: {gib(fit.total_bytes)} for all, {gib(fit.budget_bytes)} in the budget; {need}"
    for group in fit.groups[:MAX_LISTED]:
        evidence.append(f"fit together: {', '.join(group)} ({gib(sum(size[n] for n in group))})")
    if len(fit.groups) > MAX_LISTED:
        evidence.append(f"... and {len(fit.groups) - MAX_LISTED} more groups that fit together")
    evidence += [
        f"take turns: {a} and {b} ({gib(size[a] + size[b])} together): a request for one unloads the other when idle"
        for a, b in fit.apart
    ]
    return Finding("1. Model fit (several models)", verdict, evidence, pitfalls=pitfalls)


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def write_several_report(fit: SeveralFit, source: str, out: Path) -> str:
    """report.md and report.json into `out`; returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    finding = fit.finding()
    preamble = (
        f"Models of `{source}`, each as a `serve --models` server's `--memory` counts it (weights scaled to "
        "the dtype and quantization it runs in, plus its KV cache budget); nothing loaded."
    )
    text = "\n".join(["# tokenmill doctor", "", preamble, "", *render_finding(finding)])
    (out / "report.md").write_text(text)
    record = {"models_file": source, "several_fit": dataclasses.asdict(fit), "findings": [dataclasses.asdict(finding)]}
    (out / "report.json").write_text(json.dumps(record, indent=2) + "\n")
    return text
