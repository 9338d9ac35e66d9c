"""docs/exit-codes.md is `errors.ExitCode`, and each of its rows names a test that checks that very status."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from mpi_harness import run_with_timeout

from mpiparallel import errors
from mpiparallel.errors import ExitCode

ROOT = Path(__file__).resolve().parents[2]


def page_rows() -> list[tuple[int, str, str]]:
    """(status, name, test) of each row of the page's table."""
    rows = []
    for line in (ROOT / "docs" / "exit-codes.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("|") and cells[0].isdigit():
            rows.append((int(cells[0]), cells[1].strip("`"), cells[4]))
    return rows


def test_the_page_lists_every_status_of_the_enum_and_no_other():
    assert [(status, name) for status, name, _ in page_rows()] == [(code.value, code.name) for code in ExitCode]


def test_the_modules_table_has_the_same_statuses():
    statuses = [int(m.group(1)) for m in re.finditer(r"^\| (\d+) \|", errors.__doc__, re.MULTILINE)]
    assert statuses == [code.value for code in ExitCode]


def function_body(source: str, name: str) -> str:
    """The text of top-level function `name` in `source`, up to the next top-level statement."""
    start = source.index(f"\ndef {name}(") + 1
    end = re.search(r"\n\S", source[start:])
    return source[start:] if end is None else source[start:start + end.start()]


def test_every_row_names_a_test_that_asserts_its_status():
    """The row's test, or a function of its file that the test calls (a shared kill-and-check), names the status."""
    for status, name, test in page_rows():
        if name == "OK":
            continue
        path, function = test.strip("`").split("::")
        source = (ROOT / path).read_text()
        body = function_body(source, function)
        called = [function_body(source, f) for f in set(re.findall(r"(\w+)\(", body)) if f"\ndef {f}(" in source]
        assert any(f"ExitCode.{name}" in text for text in [body, *called]), (status, name, test)


def test_signals_are_128_plus_their_number():
    assert ExitCode.INTERRUPTED == 130 and ExitCode.PREEMPTED_SIGUSR1 == 138 and ExitCode.PREEMPTED_SIGTERM == 143


PLANTED_MISMATCH = """
import os
import mpiparallel.commands.verify as verify

original = verify.mismatches

def planted(ours, theirs):  # rank 1 sees one element of every comparison differ
    return original(ours, theirs) + (os.environ.get("PMI_RANK") == "1")

verify.mismatches = planted
"""


def test_verify_finding_a_wrong_element_exits_with_check_failed(tmp_path):
    """One element planted wrong on rank 1 (sitecustomize, before the command runs): the table says FAILED and the
    status is CHECK_FAILED, not a crash's 1."""
    (tmp_path / "sitecustomize.py").write_text(PLANTED_MISMATCH)
    path = os.pathsep.join(filter(None, [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH")]))
    finished = run_with_timeout([sys.executable, "-m", "mpiparallel", "verify", "-n", "2", "--max-count", "10",
                                 "--collective", "all_reduce"], 120, env={**os.environ, "PYTHONPATH": path})
    assert finished.returncode == ExitCode.CHECK_FAILED, finished.stdout + finished.stderr
    assert "FAILED:" in finished.stdout and "Traceback" not in finished.stderr, finished.stdout + finished.stderr
