"""The floors hold: no import goes up (collectives ← models ← mpiparallel), and the teaching core never imports the
job machinery (`mpiparallel.jobs`) or the command line (`mpiparallel.commands`). Read from the source, every import
statement, at module level or inside a function."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> list[str]:
    """Every module `path` imports, as an absolute dotted name."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    if path.name == "__init__.py":
        package = ".".join(path.relative_to(ROOT).parts[:-1])
    names = []
    tree = ast.parse(path.read_text())
    type_checking = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If)
                     and getattr(node.test, "id", None) == "TYPE_CHECKING" for inner in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in type_checking:  # for the type checker only: never run
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


def _violations(folders: list[str], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            bad = sorted({name for name in _imports(path) if name.startswith(forbidden)})
            if bad:
                found[str(path.relative_to(ROOT))] = bad
    return found


CORE = [path.relative_to(ROOT).as_posix() for path in (ROOT / "mpiparallel").iterdir()
        if path.is_dir() and path.name not in ("jobs", "commands", "__pycache__")]


def test_no_import_goes_up_a_floor():
    assert _violations(["collectives"], ("models", "mpiparallel")) == {}
    assert _violations(["models"], ("mpiparallel",)) == {}


def test_the_core_never_imports_the_job_machinery_or_the_command_line():
    core_modules = [path for path in (ROOT / "mpiparallel").glob("*.py") if path.name != "__main__.py"]  # the CLI
    found = _violations(CORE, ("mpiparallel.jobs", "mpiparallel.commands"))
    for path in core_modules:
        bad = sorted({name for name in _imports(path) if name.startswith(("mpiparallel.jobs", "mpiparallel.commands"))})
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    assert found == {}, found
    assert "mpiparallel/train" in CORE and "mpiparallel/checkpoints" in CORE  # the check reads the folders it means


def test_the_check_sees_relative_imports():
    """The reader resolves `from ..jobs import launch` in mpiparallel/train/x.py to mpiparallel.jobs.launch."""
    path = ROOT / "mpiparallel" / "train" / "step.py"
    assert "mpiparallel.errors.on_every_rank" in _imports(path)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if path.name == "__init__.py" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports (every statement, also inside functions)."""
    paths = [path for folder in ("collectives", "models", "mpiparallel") for path in (ROOT / folder).rglob("*.py")]
    modules = {_module_name(path): path for path in paths}
    graph = {}
    for name, path in modules.items():
        imported = {module for module in _imports(path) if module in modules and module != name}
        # `from package import module` needs the module, not more of the package than is already loading
        graph[name] = {module for module in imported if not any(other.startswith(module + ".") for other in imported)}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for after in graph[node]:
            if after not in index:
                visit(after)
                low[node] = min(low[node], low[after])
            elif after in stack:
                low[node] = min(low[node], index[after])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle():
    """No module imports, however indirectly or late (inside a function), one that imports it back."""
    assert _circles(_import_graph()) == []


def test_the_circle_check_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
