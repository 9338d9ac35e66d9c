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
    for node in ast.walk(ast.parse(path.read_text())):
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
