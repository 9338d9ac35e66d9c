"""Every command in README.md and docs/*.md runs and prints what the page says it prints.

A page shows a command as a console transcript: a `$` line (a line ending in a backslash, or inside an open quote,
goes on to the next), then lines of its output:

    ```console
    $ mpiparallel schedule --pp 4 --microbatches 8 --schedule 1f1b
    …
    bubble:   0.2727 simulated, 0.2727 formula …
    ```

Each block runs in a fresh folder (with links to the checkout's scripts/ and tests/, and no calibration file: a new
user's machine), its commands one after another with bash (`mpiparallel` and `python` are this interpreter's). A
command must exit with status 0, and every output line the page shows under it must be found in what it printed
(stdout and stderr), in the page's order, each within one line of output: runs of spaces compare as one, and `…`
stands for what the page leaves out (lines, or the rest of a line). A command `export NAME=VALUE` sets NAME for
the block's later commands too, as in one shell. Numbers must be equal as
written, unless the comment line just before the block says otherwise. Such a comment holds directives, joined by
`;`:

    <!-- doc-test: numbers within 2% -->   figures that vary a little between machines (a loss after 2,400 steps)
    <!-- doc-test: measured -->            timings: the words and the layout are checked, not the numbers
    <!-- doc-test: needs a GPU -->         runs only where CuPy sees a GPU (a skip elsewhere, as the GPU tests)
    <!-- doc-test: with my_texts -->       the folder holds my_texts/ (text files) and notes.jsonl first
    <!-- doc-test: python block above as example.py -->   the page's last python block before this one, as that file
    <!-- doc-test: timeout 1200 -->        seconds for the whole block (default 600)
    <!-- doc-test: not run: REASON -->     a block that cannot run in a test (an install, another machine's data)

Any other shell block (bash, sh, shell, console without a `$` line, any block with a `$` line) without
`not run: REASON` fails the suite, so no command on a page goes unchecked by accident; and every repository path a
page names must exist.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from pydoc_data.topics import topics

import pytest
from mpi_harness import Hang, run_with_timeout

from collectives import backend

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
DIRECTIVE = re.compile(r"^<!--\s*doc-test:\s*(.*?)\s*-->$")
NUMBER = r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?"  # 7,242 and 2.00e-05 too
NUMBER_ALONE = re.compile(rf"(?<![\w.]){NUMBER}(?![\w])")  # not the digits of "dp2", "1f1b" or "v1.2"
ELLIPSIS = "…"
EXPORT = re.compile(r"export (\w+)=(\S+)")


@dataclass
class Command:
    text: str
    expected: list[str] = field(default_factory=list)


@dataclass
class Block:
    page: str
    line: int
    language: str
    body: list[str]
    directives: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)  # written into the folder before the commands run

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def read_blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page with the directives of the comment line just before each."""
    lines = page.read_text().splitlines()
    blocks, number = [], 0
    while number < len(lines):
        opening = re.match(r"^\s*```(\w*)\s*$", lines[number])
        if not opening:
            number += 1
            continue
        end = next(i for i in range(number + 1, len(lines)) if lines[i].strip() == "```")
        before = next((lines[i].strip() for i in range(number - 1, -1, -1) if lines[i].strip()), "")
        directive = DIRECTIVE.match(before)
        block = Block(str(page.relative_to(ROOT)), number + 1, opening.group(1), lines[number + 1:end],
                      parse_directives(directive.group(1) if directive else ""))
        if "python block above as" in block.directives:
            code = next(b for b in reversed(blocks) if b.language == "python")
            block.files[block.directives["python block above as"]] = "\n".join(code.body) + "\n"
        blocks.append(block)
        number = end + 1
    return blocks


def parse_directives(text: str) -> dict[str, str]:
    """'numbers within 2%; timeout 900' -> {'numbers within': '2%', 'timeout': '900'}."""
    known = ("not run:", "numbers within", "measured", "needs a GPU", "with my_texts", "python block above as",
             "timeout")
    directives = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name = next((k for k in known if part.startswith(k)), None)
        if name is None:
            raise ValueError(f"unknown doc-test directive {part!r} (known: {', '.join(known)})")
        directives[name.rstrip(":")] = part[len(name):].strip()
    return directives


def read_commands(block: Block) -> list[Command]:
    """The `$` commands of a console block, each with the output lines shown under it."""
    commands: list[Command] = []
    lines = iter(block.body)
    for line in lines:
        if line.startswith("$ "):
            text = line[2:]
            while text.endswith("\\") or not _quotes_closed(text):
                text += "\n" + next(lines)
            commands.append(Command(text))
        elif commands and line.strip() and line.strip() != ELLIPSIS:
            commands[-1].expected.append(line.strip())
    return commands


def _quotes_closed(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:  # "No closing quotation"
        return False
    return True


# -- matching -------------------------------------------------------------------------------------------------------

def line_pattern(expected: str) -> re.Pattern:
    """A pattern for one shown line: its words literally (spaces as any spaces), each number as a captured number,
    `…` as anything."""
    parts = []
    for piece in re.split(rf"({NUMBER_ALONE.pattern}|{ELLIPSIS}|\s+)", expected.strip(ELLIPSIS).strip()):
        if not piece:
            continue
        if piece == ELLIPSIS:
            parts.append(".*?")
        elif piece.isspace():
            parts.append(r"\s+")
        elif NUMBER_ALONE.fullmatch(piece):
            parts.append(f"({NUMBER})")
        else:
            parts.append(re.escape(piece))
    return re.compile("".join(parts))


def numbers_agree(shown: str, printed: str, tolerance: float | None) -> bool:
    """Equal as written; within `tolerance` (relative) when one is given; anything when tolerance is infinite."""
    if tolerance is None:
        return shown == printed
    if tolerance == float("inf"):
        return True
    a, b = float(shown.replace(",", "")), float(printed.replace(",", ""))
    return abs(a - b) <= tolerance * max(abs(a), abs(b))


def line_matches(expected: str, actual: str, tolerance: float | None) -> bool:
    pattern = line_pattern(expected)
    shown = NUMBER_ALONE.findall(expected)
    for found in pattern.finditer(actual):
        if all(numbers_agree(s, p, tolerance) for s, p in zip(shown, found.groups(), strict=True)):
            return True
    return False


def missing_lines(expected: list[str], output: str, tolerance: float | None) -> list[str]:
    """The shown lines not found in `output` in order (each at or after the line where the previous one was)."""
    actual = output.splitlines()
    position, missing = 0, []
    for wanted in expected:
        at = next((i for i in range(position, len(actual)) if line_matches(wanted, actual[i], tolerance)), None)
        if at is None:
            missing.append(wanted)
        else:
            position = at + 1
    return missing


def tolerance_of(block: Block) -> float | None:
    if "measured" in block.directives:
        return float("inf")
    within = block.directives.get("numbers within")
    return None if within is None else float(within.rstrip("%")) / 100


# -- running --------------------------------------------------------------------------------------------------------

def _shims(folder: Path) -> dict[str, str]:
    """PATH with `mpiparallel` and `python` meaning this interpreter and this checkout, as after `pip install -e .`,
    and the checkout's scripts/ and tests/ in the folder."""
    bin_dir = folder / ".bin"
    bin_dir.mkdir()
    for name in ("scripts", "tests"):  # the pages' `python scripts/…` and `tests/…` paths, read-only in spirit
        (folder / name).symlink_to(ROOT / name)
    for name, program in (("mpiparallel", f'exec "{sys.executable}" -m mpiparallel "$@"'),
                          ("python", f'exec "{sys.executable}" "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{program}\n")
        (bin_dir / name).chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    fresh = {"MPIPARALLEL_CALIBRATION": str(folder / "calibration.json"),  # a new user's machine: the default cost
             "MPIPARALLEL_MACHINE": str(folder / "machine.json")}          # model and planner machine, not ours
    return {**os.environ, **fresh, "PATH": path, "PYTHONPATH": python_path, "PYTHONUNBUFFERED": "1"}


def _write_my_texts(folder: Path) -> None:
    """A small corpus for the pages' `my_texts/ notes.jsonl`: Python's documentation topics, one file per topic."""
    texts = folder / "my_texts"
    texts.mkdir()
    names = sorted(topics)
    for name in names[: len(names) // 2]:
        (texts / f"{name}.txt").write_text(topics[name])
    with open(folder / "notes.jsonl", "w") as notes:
        for name in names[len(names) // 2:]:
            notes.write(json.dumps({"text": topics[name]}) + "\n")


def run_block(block: Block) -> None:
    commands = read_commands(block)
    assert commands, f"{block.name}: a console block without a `$` command"
    timeout = float(block.directives.get("timeout", 600))
    with tempfile.TemporaryDirectory(prefix="doc-test-") as scratch:
        folder = Path(scratch)
        environment = _shims(folder)
        if "with my_texts" in block.directives:
            _write_my_texts(folder)
        for name, text in block.files.items():
            (folder / name).write_text(text)
        for command in commands:
            if exported := EXPORT.fullmatch(command.text):  # the block's later commands see it, as in one shell
                environment[exported.group(1)] = exported.group(2)
            try:
                finished = run_with_timeout(["bash", "-c", command.text], timeout, merge_output=True, cwd=folder,
                                            env=environment)
            except Hang as hang:
                pytest.fail(f"{block.name}: {hang}", pytrace=False)
            output = finished.stdout
            assert finished.returncode == 0, f"{block.name}: `{command.text}` exited {finished.returncode}\n" \
                                             f"{output[-4000:]}"
            missing = missing_lines(command.expected, output, tolerance_of(block))
            assert not missing, (f"{block.name}: `{command.text}` did not print, in this order:\n  "
                                 + "\n  ".join(missing) + f"\n--- it printed:\n{output[-6000:]}")


# -- the tests ------------------------------------------------------------------------------------------------------

ALL_BLOCKS = [block for page in PAGES for block in read_blocks(page)]
SHELL_BLOCKS = [block for block in ALL_BLOCKS
                if block.language in SHELL_LANGUAGES or any(line.startswith("$ ") for line in block.body)]
RUN = [block for block in SHELL_BLOCKS if "not run" not in block.directives]


def _param(block: Block):
    marks = [pytest.mark.timeout(float(block.directives.get("timeout", 600)) + 60)]
    if "needs a GPU" in block.directives:
        marks.append(pytest.mark.skipif(not backend.cupy_available(),
                                        reason="needs CuPy and an NVIDIA GPU (pip install -e '.[gpu]')"))
    return pytest.param(block, id=block.name, marks=marks)


@pytest.mark.parametrize("block", [_param(block) for block in RUN])
def test_the_command_runs_and_prints_what_the_page_shows(block):
    run_block(block)


def test_every_shell_block_is_a_transcript_the_test_runs_or_says_why_not():
    unchecked = [block.name for block in SHELL_BLOCKS
                 if "not run" not in block.directives
                 and (block.language != "console" or not any(line.startswith("$ ") for line in block.body))]
    reasonless = [block.name for block in SHELL_BLOCKS if block.directives.get("not run", None) == ""]
    assert RUN and not unchecked and not reasonless, (unchecked, reasonless)


def test_directives_sit_only_on_shell_blocks():
    misplaced = [block.name for block in ALL_BLOCKS if block.directives and block not in SHELL_BLOCKS]
    assert not misplaced, misplaced


REPOSITORY_PATH = re.compile(r"(?<![\w/.])((?:collectives|models|mpiparallel|scripts|tests)/[\w/.-]*[\w/])")


def test_every_file_a_page_names_exists():
    """A renamed or removed module leaves no page pointing at it (`models/gpt.py`, `scripts/bench_data.py`, …)."""
    named = [(page.name, path) for page in PAGES for path in REPOSITORY_PATH.findall(page.read_text())]
    assert named and not [(page, path) for page, path in named if not (ROOT / path).exists()]


# the matcher itself: what it accepts and what it must refuse

OUTPUT = """GPT-2 4 layers, 128 channels, 4 heads, vocab 2048: 1.19 M parameters
step   500/2400 | loss 4.8706, mean of  20 4.8813 | lr 1.87e-03 | 16,460 tok/s | val 5.0655
rank 0: dp 4.746 MB (formula 4.746 MB, ratio 1.0000)"""


@pytest.mark.parametrize("shown, tolerance, found", [
    (["rank 0: dp 4.746 MB (formula 4.746 MB, ratio 1.0000)"], None, True),
    (["rank 0: dp 4.747 MB (formula 4.746 MB, ratio 1.0000)"], None, False),  # one digit off
    (["rank 0: dp 4.746 MB (formula 4.746 MB, ratio 1.0000)", "1.19 M parameters"], None, False),  # out of order
    (["1.19 M parameters", "rank 0: dp …"], None, True),
    (["rank 0: tp 4.746 MB"], None, False),  # another word
    (["step 500/2400 | loss 4.87, … | val 5.08"], 0.01, True),
    (["step 500/2400 | loss 4.87, … | val 5.30"], 0.01, False),  # 4 % off
    (["step 500/2400 | … | 99,999 tok/s"], float("inf"), True),
    (["step 500/2400 | … | 99,999 tok/min"], float("inf"), False),  # measured numbers, but the words count
    (["vocab 2048: 1.19 M"], None, True),
    (["vocab 204"], None, False),  # a number is whole, not a prefix
])
def test_shown_lines_are_found_in_order_with_their_numbers(shown, tolerance, found):
    assert (missing_lines(shown, OUTPUT, tolerance) == []) is found


def test_a_transcript_reads_continued_and_quoted_commands():
    block = Block("page.md", 1, "console", ['$ mpiexec -n 4 python -c "', "print(1)", '"', "1",
                                           "$ mpiparallel train \\", "    --steps 2", "…", "step 2/2"], {})
    commands = read_commands(block)
    assert [c.text for c in commands] == ['mpiexec -n 4 python -c "\nprint(1)\n"',
                                          "mpiparallel train \\\n    --steps 2"]
    assert [c.expected for c in commands] == [["1"], ["step 2/2"]]


def test_a_failing_command_or_a_missing_line_fails_the_block():
    failing = Block("page.md", 1, "console", ["$ python -c 'import sys; sys.exit(3)'"], {})
    with pytest.raises(AssertionError, match="exited 3"):
        run_block(failing)
    wrong = Block("page.md", 1, "console", ["$ python -c 'print(6 * 7)'", "43"], {})
    with pytest.raises(AssertionError, match="did not print"):
        run_block(wrong)
    run_block(Block("page.md", 1, "console", ["$ python -c 'print(6 * 7)'", "42"], {}))
