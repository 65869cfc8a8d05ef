"""The report of the tiny run, opened in a real headless Chromium: its first page (what a reader sees without a
click, after the report's JavaScript ran) shows the headline figures of `report/tau_and_speedup.csv`.

Chromium comes from the distribution's packages; the `chromium` fixture installs it where it is missing (as root,
with apt-get) and skips, saying why, only where it cannot. The screenshot of the first page is kept in
`test-artifacts/` (ignored by git) for a person to look at."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
from html.parser import HTMLParser

import matplotlib.image
import numpy as np
import pytest

from tests.conftest import REPO, run_snakemake

pytestmark = pytest.mark.workflow

WINDOW = (1280, 900)
ARTIFACTS = REPO / "test-artifacts"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
PICK_GREEN = np.array([0x06, 0x5F, 0x46]) / 255  # the first page's colour for the fastest setting of a set


def installed_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def apt_install_chromium() -> str:
    """Install Debian's chromium package; returns apt's last lines when it fails."""
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "-o", "DPkg::Lock::Timeout=600", "install", "-y", "-q", "chromium"]
    result = subprocess.run(install, capture_output=True, text=True, env=env)
    if result.returncode != 0:  # stale package lists: refresh them once
        subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=600", "update", "-q"], capture_output=True, env=env)
        result = subprocess.run(install, capture_output=True, text=True, env=env)
    return "" if result.returncode == 0 else (result.stdout + result.stderr)[-500:]


@pytest.fixture(scope="session")
def chromium() -> str:
    """The headless browser's executable, installed from the distribution's packages where missing."""
    if (found := installed_browser()) is not None:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("no Chromium here and no way to install it: needs apt-get as root (or chromium on PATH)")
    failure = apt_install_chromium()
    if (found := installed_browser()) is None:
        pytest.skip(f"Chromium could not be installed with apt-get: {failure.strip()}")
    return found


def headless(browser: str, *args: str) -> subprocess.CompletedProcess:
    """The browser on a page, after its scripts ran (virtual time lets the report's JavaScript finish)."""
    return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--window-size={WINDOW[0]},{WINDOW[1]}", "--virtual-time-budget=15000", *args],
                          capture_output=True, text=True, timeout=300, check=True)


class FrontPage(HTMLParser):
    """The rendered first page's headline (`div.e3-front`): its text, and its table's rows by (prompt set, first
    cell). The report's scripts hold the same HTML as a string, which a parser reads as script text, not elements."""

    def __init__(self, dom: str):
        super().__init__()
        self.depth = 0  # open elements inside div.e3-front
        self.cells: list[str] | None = None  # the open table row's cells
        self.in_cell = False
        self.prompt_set = ""
        self.rows: dict[tuple[str, str], list[str]] = {}
        self.text: list[str] = []
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        if self.depth or ("class", "e3-front") in attrs:
            self.depth += 1
            if tag == "tr":
                self.cells = []
            elif tag in ("td", "th"):
                self.cells.append("")
                self.in_cell = True

    def handle_endtag(self, tag):
        if not self.depth:
            return
        self.depth -= 1
        if tag in ("td", "th"):
            self.in_cell = False
        elif tag == "tr" and self.cells:
            if len(self.cells) == 1:  # a prompt set's title row: "mtbench-package (2 prompts, 1 timed)"
                self.prompt_set = self.cells[0].split(" (")[0]
            self.rows[self.prompt_set, self.cells[0]] = self.cells[1:]

    def handle_data(self, data):
        if self.depth:
            self.text.append(data)
            if self.in_cell:
                self.cells[-1] += data


def expected_rows(table: list[dict[str, str]]) -> dict[str, dict[str, dict[str, str]]]:
    """From the CSV, per prompt set: the target alone and the fastest timed chain, tree and prompt lookup."""
    expected: dict[str, dict[str, dict[str, str]]] = {}
    for row in table:
        speedup = row["speedup_vs_target (timing pass)"]
        kind = next((name for prefix, name in (("target", "target alone"), ("prompt-lookup@", "prompt lookup"),
                                               ("eagle3@", "EAGLE-3 chain"), ("eagle3-tree(", "EAGLE-3 tree"))
                     if row["method"].startswith(prefix)), None)
        if kind is None or not speedup:
            continue
        best = expected.setdefault(row["prompt_set"], {}).get(kind)
        if best is None or float(speedup) > float(best["speedup_vs_target (timing pass)"]):
            expected[row["prompt_set"]][kind] = row
    return expected


def test_the_first_page_in_a_browser_shows_the_headline_of_the_tau_table(finished_tiny_run, chromium, tmp_path):
    report = tmp_path / "report.html"
    run_snakemake(finished_tiny_run.workdir, finished_tiny_run.config, "--report", str(report))
    screenshot = tmp_path / "report_front_page.png"
    headless(chromium, f"--screenshot={screenshot}", report.as_uri())
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copyfile(screenshot, ARTIFACTS / "report_front_page_tiny.png")
    image = matplotlib.image.imread(str(screenshot))[..., :3]
    assert image.shape[:2] == (WINDOW[1], WINDOW[0])
    # the fastest setting of each set is drawn in green: the headline table is on the first screen
    assert int((np.abs(image - PICK_GREEN).max(axis=-1) < 0.08).sum()) > 200

    page = FrontPage(headless(chromium, "--dump-dom", report.as_uri()).stdout)
    table = list(csv.DictReader((finished_tiny_run.results / "report" / "tau_and_speedup.csv").open()))
    expected = expected_rows(table)
    assert set(expected) == {"mtbench-package", "held-out"}
    for prompt_set, best in expected.items():
        assert len(best) == 4, best  # the target alone, prompt lookup, a chain and a tree, all timed
        for kind, row in best.items():
            label = kind if kind == "target alone" else f"{kind}: {row['method']}"
            tau, speedup, tokens_per_s = page.rows[prompt_set, label]
            assert tau == row["tau (tau pass)"]
            assert float(speedup.removesuffix("x")) == pytest.approx(
                float(row["speedup_vs_target (timing pass)"]), abs=0.0051)  # 2 decimals here, 3 in the CSV
            assert tokens_per_s == row["tokens_per_s (timing pass)"]
    text = "".join(page.text)
    assert "--speculative-algorithm EAGLE3" in text and "--speculative-config" in text  # SGLang and vLLM
    assert "Engine check: none in this run" in text
