"""The layering rule: `core/` never imports `tasks/`."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_core_does_not_import_tasks():
    for path in (ROOT / "core").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n == "tasks" or n.startswith("tasks.") for n in names), f"{path.name} imports {names}"
