"""House style that a machine can check: no function over 80 lines outside the tests."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80


def long_functions(folder: Path) -> list[str]:
    """`path:line name (n lines)` for every function or method in `folder` longer than MAX_LINES."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_LINES:
                    found.append(f"{path.relative_to(folder.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_over_80_lines() -> None:
    found = [f for room in ("tokenmill", "benchmarks", "scripts", "compat") for f in long_functions(ROOT / room)]
    assert not found, "split by what they do:\n" + "\n".join(found)


def test_a_long_function_is_found(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\nasync def long():\n{body}\n")
    found = long_functions(tmp_path)
    assert len(found) == 1 and " long (81 lines)" in found[0]
