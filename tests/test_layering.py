"""The layering rules of DESIGN.md (tests/layering.py) hold for tokenmill/, save the exceptions below.

ALLOWED is the list of broken rules, empty now. It may only shrink: an entry that no longer occurs fails
the test until it is removed, and a new broken rule fails it until the import is moved to its room.
"""

from __future__ import annotations

from pathlib import Path

from tests.layering import Violation, violations

PACKAGE = Path(__file__).resolve().parents[1] / "tokenmill"

ALLOWED: set[Violation] = set()  # empty: every rule holds; keep it so


def test_the_house_keeps_its_layering() -> None:
    found = violations(PACKAGE)
    new = sorted(found - ALLOWED)
    assert not new, "imports that break DESIGN.md's layering (move them to their room):\n" + "\n".join(map(str, new))
    gone = sorted(ALLOWED - found)
    assert not gone, "fixed, so remove from ALLOWED in tests/test_layering.py:\n" + "\n".join(map(str, gone))


def _plant(tmp_path: Path, module: str, source: str) -> Path:
    root = tmp_path / "tokenmill"
    path = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
    for folder in [root, *reversed(path.parents)]:
        if folder.is_relative_to(root):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "__init__.py").touch()
    path.write_text(source)
    return root


def test_a_planted_forbidden_import_is_caught(tmp_path: Path) -> None:
    root = _plant(tmp_path, "tokenmill.layers.linear", "from ..engine.core import EngineCore\nimport torch\n")
    _plant(tmp_path, "tokenmill.engine.core", "")
    assert violations(root) == {Violation("tokenmill.layers.linear", "tokenmill.engine.core", "rank")}


def test_torch_in_the_scheduler_and_the_core_from_the_server_are_caught(tmp_path: Path) -> None:
    root = _plant(tmp_path, "tokenmill.sched.scheduler", "import torch.nn\nfrom tokenmill import outputs\n")
    _plant(tmp_path, "tokenmill.outputs", "")
    _plant(tmp_path, "tokenmill.server.app", "from tokenmill.engine import core, async_engine\n")
    _plant(tmp_path, "tokenmill.engine.core", "")
    _plant(tmp_path, "tokenmill.engine.async_engine", "")
    assert violations(root) == {
        Violation("tokenmill.sched.scheduler", "torch.nn", "torch"),
        Violation("tokenmill.server.app", "tokenmill.engine.core", "client"),
    }


def test_a_circle_between_rooms_is_caught(tmp_path: Path) -> None:
    root = _plant(tmp_path, "tokenmill.models.llama", "from tokenmill.layers import fused\n")
    _plant(tmp_path, "tokenmill.layers.fused", "from tokenmill.models.llama import LlamaModel\n")
    assert violations(root) == {Violation("tokenmill.layers.fused", "tokenmill.models.llama", "rank")}
