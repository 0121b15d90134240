"""The layering rules and the sizes that keep the house readable.

- `core/` never imports `tasks/`; `tasks/common/` imports only `core`; a domain (`tasks/nlp`,
  `tasks/recsys`, `tasks/speech`, `tasks/protein`) imports `core`, `tasks.common` and itself,
  never another domain.
- Inside `core/`, imports run one way, down `LAYERS`: a module may import its own layer and the
  layers below it, never one above; and no two core modules import each other, even through
  others (imports inside functions count: a lazy import is still a dependency).
- No source file over 400 lines, no function over 60: growth shows in CI when it happens.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ("nlp", "recsys", "speech", "protein")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60

# The core's layers, bottom first; each package or top-level module of core/ is in exactly one.
LAYERS = (
    ("core.errors", "core.values", "core.paths"),
    ("core.config", "core.presets"),
    ("core.model",),  # the network: layers, attention, cache, heads, front ends, precision
    ("core.task", "core.options", "core.metrics"),  # the contract a task implements, its predict options
    ("core.checkpoints",),  # pretrained weights in and out: formats and families
    ("core.training",),  # steps, fit and hooks, losses, batching, sharding, run checkpoints
    ("core.generation",),  # sampling, beams, penalties, CTC, the slot engine
    (
        "core.run",
        "core.loading",
        "core.export",
        "core.predict",
        "core.report",
        "core.seeds",
        "core.terminal",
    ),  # the plain functions the CLI and Python call
    ("core.bench",),  # speed of the core
    ("core.serving",),  # HTTP over the engine, and its load benchmark
    ("core.bench.commands",),  # apps bench's subcommands, the serving one included
)
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def imported(path: Path, package: str | None = None) -> list[str]:
    """Every module that `path` imports, at any depth (imports inside functions count);
    `from package import module` names the module, and a relative import is resolved against
    the file's `package` (by default its place under the repository)."""
    if package is None and path.is_relative_to(ROOT):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level:
                parts = (package or "").split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{module}" if module else base
            if module:
                names += [module, *(f"{module}.{alias.name}" for alias in node.names)]
    return names


def task_packages(names: list[str]) -> set[str]:
    """The `tasks` subpackages among `names` ("tasks.nlp.data" -> "nlp"; "tasks" -> "")."""
    return {name.split(".")[1] if "." in name else "" for name in names if name == "tasks" or name.startswith("tasks.")}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def core_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted((ROOT / "core").rglob("*.py"))}


def unit(module: str) -> str | None:
    """The layer unit that `module` belongs to (its package or top-level module), or None."""
    matches = [name for name in RANK if module == name or module.startswith(name + ".")]
    return max(matches, key=len) if matches else None


def core_imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each core module -> the core modules it imports (a package counts as its __init__)."""
    return {name: {i for i in imported(path) if i in modules and i != name} for name, path in modules.items()}


def upward(modules: dict[str, Path]) -> list[str]:
    """Imports that go up the layers: "a -> b" where b's layer is above a's."""
    return [
        f"{name} -> {target}"
        for name, targets in core_imports(modules).items()
        if name != "core"
        for target in sorted(targets)
        if target != "core" and RANK[unit(target)] > RANK[unit(name)]
    ]


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs (a, b) where a imports b and b reaches a again."""

    def reach(start: str) -> set[str]:
        seen, stack = set(), [start]
        while stack:
            for target in graph.get(stack.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    stack.append(target)
        return seen

    return [(a, b) for a in sorted(graph) for b in sorted(graph[a]) if a in reach(b)]


def source_files() -> list[Path]:
    return [ROOT / "cli.py", *sorted((ROOT / "core").rglob("*.py")), *sorted((ROOT / "tasks").rglob("*.py"))]


def oversized(path: Path) -> list[str]:
    """What in `path` is over the limits: the file's lines, each function's (def to its end)."""
    text, label = path.read_text(), path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    lines = len(text.splitlines())
    found = [f"{label}: {lines} lines"] if lines > MAX_FILE_LINES else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{label}:{node.lineno} {node.name}: {length} lines")
    return found


def test_core_does_not_import_tasks():
    for name, path in core_modules().items():
        assert not task_packages(imported(path)), f"{name} imports tasks"


def test_every_core_module_has_a_layer_and_a_docstring():
    for name, path in core_modules().items():
        assert name == "core" or unit(name), f"{name} is in no layer of tests/test_architecture.py's LAYERS"
        assert ast.get_docstring(ast.parse(path.read_text())), f"{name} opens with no docstring"


def test_core_imports_run_down_the_layers():
    assert upward(core_modules()) == []


def test_no_core_module_imports_itself_back():
    assert cycles(core_imports(core_modules())) == []


def test_no_file_or_function_outgrows_its_limit():
    assert [found for path in source_files() for found in oversized(path)] == []


def behind_the_seam(modules: dict[str, Path]) -> list[str]:
    """Imports of a kernel module (`core.model.kernels.native`, `tiles`, `flash_tiles`, `splash`)
    from outside `core.model.kernels`: the rest of the core calls the seam, never a kernel."""
    seam = "core.model.kernels"
    return [
        f"{name} -> {target}"
        for name, targets in core_imports(modules).items()
        if not name.startswith(seam)
        for target in sorted(targets)
        if target.startswith(seam + ".")
    ]


def test_the_core_reaches_kernels_through_the_seam_alone():
    assert behind_the_seam(core_modules()) == []
    # Nor do the model, training and generation test the hardware themselves: the seam does.
    for name, path in core_modules().items():
        if name.startswith(("core.model.", "core.training.", "core.generation.")) and not name.startswith(
            "core.model.kernels"
        ):
            assert "default_backend" not in path.read_text(), f"{name} asks for the backend; ask the seam"


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


def test_the_rules_see_what_they_forbid(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def f():\n    from tasks.nlp.data import read_file\n")
    assert task_packages(imported(path)) - {"speech", "common"} == {"nlp"}
    # Relative imports resolve against the file's package.
    path.write_text("from ..nlp import data\nfrom . import audio\nfrom .featurizer import clip\n")
    assert set(imported(path, "tasks.speech")) >= {"tasks.nlp.data", "tasks.speech.audio", "tasks.speech.featurizer"}
    # A model module that imports training goes up; two modules that import each other cycle.
    model, training = tmp_path / "model.py", tmp_path / "training.py"
    model.write_text("from core.training.steps import fit\n")
    training.write_text("from core.model import transformer\n")
    modules = {"core.model.transformer": model, "core.training.steps": training}
    assert upward(modules) == ["core.model.transformer -> core.training.steps"]
    assert cycles(core_imports(modules)) == [
        ("core.model.transformer", "core.training.steps"),
        ("core.training.steps", "core.model.transformer"),
    ]
    # A layer that multiplies through a kernel module directly goes around the seam.
    layer = tmp_path / "layer.py"
    layer.write_text("from core.model.kernels import native\n")
    (tmp_path / "x.py").write_text("")
    assert behind_the_seam({"core.model.layers": layer, "core.model.kernels.native": tmp_path / "x.py"}) == [
        "core.model.layers -> core.model.kernels.native"
    ]
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert oversized(long) == ["long.py:1 f: 61 lines"]
