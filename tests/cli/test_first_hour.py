"""What a newcomer types in the first hour, exactly as the README and .ci/run write it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readmes_bare_pytest_collects_every_test_with_the_real_packages(tmp_path):
    """`pytest` (the console script, whose sys.path[0] is its own folder), not `python -m pytest` (which puts the
    working folder first): the script is run as pip's console-script wrapper runs it, from a folder of its own. On
    the old settings 36 test modules failed to import (`cannot import name 'Communicator' from 'collectives'
    (unknown location)`: tests/collectives/ shadowed the package)."""
    entry = tmp_path / "bin" / "pytest"
    entry.parent.mkdir()
    entry.write_text("import sys\nimport pytest\nsys.exit(pytest.console_main())\n")
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, str(entry), "--collect-only", "-q", "-p", "no:cacheprovider"],
                            cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "error" not in result.stdout.splitlines()[-1], result.stdout[-3000:]
    assert "tests collected" in result.stdout.splitlines()[-1]


def test_ci_runs_exactly_the_readmes_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "\npytest\n" in readme
    assert ci[-1] == "pytest", ci[-1]
