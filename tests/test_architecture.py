"""The layering rules: `core/` never imports `tasks/`; `tasks/common/` imports only `core`; a
domain (`tasks/nlp`, `tasks/recsys`, `tasks/speech`, `tasks/protein`) imports `core`,
`tasks.common` and itself, never another domain."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ("nlp", "recsys", "speech", "protein")


def imported(path: Path) -> list[str]:
    """Every module that `path` imports, at any depth (imports inside functions count)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def task_packages(names: list[str]) -> set[str]:
    """The `tasks` subpackages among `names` ("tasks.nlp.data" -> "nlp"; "tasks" -> "")."""
    return {name.split(".")[1] if "." in name else "" for name in names if name == "tasks" or name.startswith("tasks.")}


def test_core_does_not_import_tasks():
    for path in (ROOT / "core").glob("*.py"):
        assert not task_packages(imported(path)), f"core/{path.name} imports tasks"


def test_common_imports_only_core():
    for path in (ROOT / "tasks" / "common").glob("*.py"):
        assert task_packages(imported(path)) <= {"common"}, f"tasks/common/{path.name} imports a domain"


@pytest.mark.parametrize("domain", DOMAINS)
def test_a_domain_imports_core_common_and_itself(domain):
    files = list((ROOT / "tasks" / domain).glob("*.py"))
    assert files
    for path in files:
        others = task_packages(imported(path)) - {domain, "common"}
        assert not others, f"tasks/{domain}/{path.name} imports tasks.{', tasks.'.join(sorted(others))}"


def test_the_rule_sees_a_forbidden_import(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def f():\n    from tasks.nlp.data import read_file\n")
    assert task_packages(imported(path)) - {"speech", "common"} == {"nlp"}
