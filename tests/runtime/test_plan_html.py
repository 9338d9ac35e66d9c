"""`plan --html` in a real browser: headless Chromium loads the page with a layout named in the URL hash, and the
DOM it renders shows what each GPU holds, derived here from the rank layout (rank = ((pp·dp + dp)·cp + cp)·tp
+ tp) and train's stage split, not from the page's own data.

Needs a chromium binary (Debian: apt-get install chromium); skipped with that reason when there is none, failed
instead under CI=true (tests/support/optional.py).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from mpi_harness import run_with_timeout
from optional import missing

ROOT = Path(__file__).resolve().parents[2]
BROWSER = next((path for name in ("chromium", "chromium-browser", "google-chrome")
                if (path := shutil.which(name))), None)


@pytest.fixture(autouse=True)
def browser() -> str:
    if BROWSER is None:
        missing("no chromium binary (Debian: apt-get install chromium)")
    return BROWSER


class _Cards(HTMLParser):
    """The text of every element with id gpu-N, and of the summary's layout label."""

    def __init__(self) -> None:
        super().__init__()
        self.cards: dict[int, str] = {}
        self.label = ""
        self._open: list[tuple[str, int | str]] = []
        self._depth = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self._depth += 1
        ident = dict(attrs).get("id") or ""
        if match := re.fullmatch(r"gpu-(\d+)", ident):
            self._open.append((str(self._depth), int(match.group(1))))
            self.cards[int(match.group(1))] = ""
        elif ident == "layout-label":
            self._open.append((str(self._depth), "label"))

    def handle_endtag(self, tag: str) -> None:
        if self._open and self._open[-1][0] == str(self._depth):
            self._open.pop()
        self._depth -= 1

    def handle_data(self, data: str) -> None:
        for _, what in self._open:
            if what == "label":
                self.label += data
            else:
                self.cards[what] += data + " "


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "map.html"
    finished = run_with_timeout([sys.executable, "-m", "mpiparallel", "plan", "--gpus", "8", "--n-layer", "8",
                                 "--experts", "4", "--html", str(path)], timeout=120, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert finished.returncode == 0, finished.stderr
    text = path.read_text()
    assert "http://" not in text and "https://" not in text and "<script src" not in text  # self-contained
    return path


def rendered(page: Path, layout_hash: str, tmp_path: Path) -> _Cards:
    finished = run_with_timeout([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path}",
                                 "--dump-dom", f"{page.as_uri()}#{layout_hash}"], timeout=90)
    assert finished.returncode == 0, finished.stderr[-2000:]
    cards = _Cards()
    cards.feed(finished.stdout)
    return cards


def coordinates(rank: int, dp: int, tp: int, cp: int) -> tuple[int, int, int, int]:
    """(pp, dp, cp, tp) of a world rank, innermost first tp, cp, dp, pp."""
    return rank // (dp * cp * tp), rank // (cp * tp) % dp, rank // tp % cp, rank % tp


def test_tp2_pp2_dp2_with_experts_shows_each_gpus_layers_shards_experts_and_rows(page, tmp_path):
    cards = rendered(page, "dp=2&tp=2&pp=2&cp=1&ep=2&zero=1&schedule=1f1b", tmp_path)
    assert cards.label.startswith("dp2 tp2 pp2 cp1 ep2 z1")
    assert sorted(cards.cards) == list(range(8))
    for rank, text in cards.cards.items():
        pp_i, dp_i, _, tp_i = coordinates(rank, dp=2, tp=2, cp=1)
        layers = "embedding, blocks 0–3" if pp_i == 0 else "blocks 4–7, head"  # 8 blocks over 2 stages
        assert f"layers: {layers}" in text
        assert f"tp shard {tp_i + 1}/2" in text
        assert f"optimizer state shard {dp_i + 1}/2" in text
        assert f"experts {2 * dp_i}–{2 * dp_i + 1} of 4" in text  # ep rank = dp rank here
        assert f"batch rows {4 * dp_i}–{4 * dp_i + 3}" in text  # 8 sequences over dp 2
        for axis in ("dp", "tp", "pp", "ep"):
            assert re.search(rf"\b{axis}: [0-9.]+ [kMG]?B", text), (axis, text)
        assert "cp:" not in text


def test_a_zbv_pipeline_of_4_puts_both_ends_of_the_v_on_gpu_0(page, tmp_path):
    cards = rendered(page, "dp=1&tp=1&pp=4&cp=2&ep=1&zero=0&schedule=zbv", tmp_path)
    assert cards.label.startswith("dp1 tp1 pp4 cp2")
    assert sorted(cards.cards) == list(range(8))
    for rank, text in cards.cards.items():
        pp_i, _, cp_i, _ = coordinates(rank, dp=1, tp=1, cp=2)
        first, second = pp_i, 7 - pp_i  # 8 blocks over 8 chunks: chunk s holds block s; rank r chunks r, 7 − r
        ends = ("embedding, " if pp_i == 0 else "", ", head" if pp_i == 0 else "")
        assert f"layers: {ends[0]}block {first}; block {second}{ends[1]}" in text
        assert f"sequence chunks {cp_i} and {3 - cp_i} of 4" in text
        assert "tp shard" not in text and "ZeRO" not in text
