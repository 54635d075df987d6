"""The house rules of DESIGN.md as code: which room of `tokenmill/` may import which.

Reads every module's imports with `ast` (nothing is imported or run), resolves relative imports,
and names each module's room (`tokenmill.layers.linear` -> `layers`; a top-level module such as
`tokenmill.config` is a room of its own). The rules:

- rooms are ranked; a room imports only rooms of a lower rank (so the room graph has no circles);
- a few lower rooms are still out of reach (`FORBIDDEN`): the engine's model is the runner's business;
- `sched` (the scheduler) and the plain-data modules import no torch;
- `server` reaches the engine only through its client interface (`ENGINE_CLIENT`), never the core.

`tests/test_layering.py` holds today's exceptions as an allowlist that may only shrink.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

# Lower imports nothing higher; equal ranks do not import each other.
RANK: dict[str, int] = {
    "errors": 0,
    "sampling_params": 1,
    "pooling_params": 1,
    "request": 2,
    "outputs": 2,
    "kernels": 2,
    "config": 2,
    "model_files": 1,
    "sched": 3,
    "text": 3,
    "quant": 3,
    "layers": 4,
    "models": 5,
    "structured": 6,
    "spec_decode": 6,
    "runner": 7,
    "engine": 8,
    "distributed": 9,
    "server": 10,
    "llm": 10,
    "eval": 10,
    "engine_args": 10,
    "tools": 11,
    "bench": 11,
    "doctor": 12,
    "cli": 13,
    "__init__": 14,
}
# Besides the ranks: rooms that talk through plain data instead (the engine gets its model through
# the runner; layers get their settings as arguments, not the EngineConfig tree).
FORBIDDEN: dict[str, set[str]] = {"layers": {"config"}, "engine": {"models", "layers"}}
TORCH_FREE = ("sched", "errors", "sampling_params", "pooling_params", "request", "outputs", "config", "model_files")
ENGINE_CLIENT = {
    "tokenmill.engine",
    "tokenmill.engine.async_engine",
    "tokenmill.engine.request_stream",
    "tokenmill.engine.metrics",
}


@dataclass(frozen=True, order=True)
class Violation:
    importer: str  # module, e.g. tokenmill.layers.linear
    imported: str  # module, e.g. tokenmill.engine.core
    rule: str  # "rank", "forbidden", "torch" or "client"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path, modules: set[str]) -> set[str]:
    """Every module `path` imports: relative imports resolved; `from a import b` gives `a.b` where
    that is one of `modules`, else `a`."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = {f"{target}.{alias.name}" for alias in node.names}
            found.update(names & modules)
            if names - modules:
                found.add(target)
    return found


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def violations(root: Path) -> set[Violation]:
    """The rules broken by the package at `root` (the `tokenmill/` folder)."""
    files = sorted(root.rglob("*.py"))
    modules = {module_name(f, root) for f in files}
    top = root.name
    broken: set[Violation] = set()
    for path in files:
        importer = module_name(path, root)
        room = room_of(importer)
        for imported in imports_of(path, root, modules):
            if imported.split(".")[0] == "torch" and room in TORCH_FREE:
                broken.add(Violation(importer, imported, "torch"))
            if imported.split(".")[0] != top:
                continue
            other = room_of(imported)
            if other == room:
                continue
            if RANK.get(other, 99) >= RANK.get(room, -1):
                broken.add(Violation(importer, imported, "rank"))
            if other in FORBIDDEN.get(room, set()):
                broken.add(Violation(importer, imported, "forbidden"))
            if room == "server" and other == "engine" and imported not in ENGINE_CLIENT:
                broken.add(Violation(importer, imported, "client"))
    return broken
