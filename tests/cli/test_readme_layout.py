"""The README's layout table names every module of every package and every script, each in its own folder's row,
so that a reader who starts there can find any file."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ["collectives", "models", "mpiparallel", "mpiparallel/train", "mpiparallel/checkpoints", "mpiparallel/data",
           "mpiparallel/schedules", "mpiparallel/planner", "mpiparallel/jobs", "mpiparallel/commands"]


def _layout_rows() -> dict[str, str]:
    """The layout table: folder (as written, without backticks) -> the row's description."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| directory | what is there |"):]
    rows = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("| `"):
            break
        folder, description = re.match(r"\| `([^`]+)/` \| (.*) \|$", line).groups()
        rows[folder] = description
    return rows


def _named(description: str) -> set[str]:
    return set(re.findall(r"`([\w.]+)`", description))


def test_every_package_module_is_named_in_its_folders_row():
    rows = _layout_rows()
    missing = {}
    for folder in FOLDERS:
        modules = {path.stem for path in (ROOT / folder).glob("*.py") if not path.stem.startswith("__")}
        packages = {path.parent.name for path in (ROOT / folder).glob("*/__init__.py")}
        unnamed = modules - _named(rows.get(folder, "")) - packages
        if unnamed:
            missing[folder] = sorted(unnamed)
    assert not missing, f"modules the README's layout table does not name, by folder: {missing}"


def test_every_script_is_named_in_the_scripts_row():
    scripts = {path.name for path in (ROOT / "scripts").iterdir() if path.suffix in (".py", ".sh")}
    assert scripts - _named(_layout_rows()["scripts"]) == set()


def test_no_module_is_named_twice_in_different_folders():
    """One name, one module: a reader who meets `hardware` or `namespace_cluster` knows which file it is."""
    seen: dict[str, list[str]] = {}
    for folder in FOLDERS:
        for path in (ROOT / folder).glob("*.py"):
            if not path.stem.startswith("__"):
                seen.setdefault(path.stem, []).append(folder)
    # commands/X is the command line of the module X it drives: the one sanctioned pairing
    twice = {name: folders for name, folders in seen.items() if len(folders) > 1
             and not (len(folders) == 2 and "mpiparallel/commands" in folders)}
    assert not twice, twice


def _lines(paths) -> int:
    return sum(len(path.read_text().splitlines()) for path in paths)


def test_the_sizes_the_readme_states_are_within_ten_percent():
    """The README's line counts of the core, the planner, the job machinery and the command line (a change that
    moves them by more than 10 % updates the sentence)."""
    text = " ".join((ROOT / "README.md").read_text().split())
    stated = re.search(r"is about ([\d,]+) lines of Python \(the planner ([\d,]+) of them\); the job machinery "
                       r"\(`mpiparallel/jobs/`\) is ([\d,]+) and the command line ([\d,]+) more", text)
    assert stated, "the README's sentence on the core's size"
    core, planner, jobs, commands = (int(group.replace(",", "")) for group in stated.groups())
    python = [path for folder in ("collectives", "models", "mpiparallel") for path in (ROOT / folder).rglob("*.py")]
    outside = ("jobs", "commands")
    measured = {"core": _lines(p for p in python if not set(outside) & set(p.relative_to(ROOT).parts)),
                "planner": _lines((ROOT / "mpiparallel" / "planner").glob("*.py")),
                "jobs": _lines((ROOT / "mpiparallel" / "jobs").glob("*.py")),
                "commands": _lines((ROOT / "mpiparallel" / "commands").glob("*.py"))}
    for name, value in zip(measured, (core, planner, jobs, commands), strict=True):
        assert abs(measured[name] - value) <= 0.1 * measured[name], (name, value, measured[name])
