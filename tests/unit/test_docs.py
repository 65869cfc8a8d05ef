"""The documentation stays true to the tree: the config reference is what config/schema.yaml generates, every
relative link in README.md and docs/ resolves, and no doc, docstring or comment cites numbered development
sessions or rounds (the dated history lives in docs/history/ alone)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import REPO

TOOL = REPO / "tools" / "config_reference.py"
DOCS = REPO / "docs"
HISTORY = DOCS / "history"
ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
            "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth")
# "the ninth session", "sessions 8-12", "round 3", "RESULTS entry 12", and the design picture kept outside the repo
DEVELOPMENT_CITATION = re.compile(
    rf"\b(?:{ORDINALS})[ -](?:session|round)s?\b|\bsessions? \d+\b|\bround \d+\b|\bentry \d+\b"
    r"|\bRESULTS(?:\.md)?,? (?:entry|session)|(?-i:\bDESIGN(?:\.md| names))", re.IGNORECASE)
SCANNED = ("src", "scripts", "rules", "benchmarks", "tools", "tests", "config", "report", "profiles", "envs")
SUFFIXES = {".py", ".smk", ".sh", ".yaml", ".yml", ".rst", ".md"}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, cwd=REPO)


def test_config_reference_is_what_the_schema_generates():
    result = run_tool("--check")
    assert result.returncode == 0, result.stderr


def test_config_reference_check_names_the_keys_that_drifted(tmp_path):
    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    page = tmp_path / "config.md"
    assert run_tool("--schema", str(REPO / "config" / "schema.yaml"), "--page", str(page)).returncode == 0
    schema["properties"]["train"]["properties"]["a_new_knob"] = {"type": "integer", "default": 3}
    schema["properties"]["train"]["properties"]["epochs"]["default"] = 99
    changed = tmp_path / "schema.yaml"
    changed.write_text(yaml.safe_dump(schema))
    result = run_tool("--check", "--schema", str(changed), "--page", str(page))
    assert result.returncode == 1
    assert "`train.a_new_knob`: in the schema, not on the page" in result.stderr
    assert "`train.epochs`: row differs" in result.stderr
    assert "tools/config_reference.py" in result.stderr  # says how to regenerate


def test_config_reference_lists_every_schema_key_with_its_default():
    page = (DOCS / "reference" / "config.md").read_text()
    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    evaluate = schema["properties"]["evaluate"]["properties"]
    row = next(line for line in page.splitlines() if line.startswith("| `evaluate.max_new_tokens` |"))
    assert f"`{evaluate['max_new_tokens']['default']}`" in row
    for section, node in schema["properties"].items():
        for key in node.get("properties") or {}:
            assert f"| `{section}.{key}` |" in page, f"{section}.{key} missing from docs/reference/config.md"


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def broken_links(path: Path) -> list[str]:
    """Relative links (and images) in a markdown file whose target does not exist; code blocks are skipped."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # a URL
        file, _, anchor = target.partition("#")
        linked = path.parent / file if file else path
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked)):
            broken.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path.name}: {target}")
    return broken


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    headings = re.findall(r"^#+ +(.+?) *$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_every_relative_link_in_the_docs_points_to_an_existing_file():
    broken = [problem for path in markdown_files() for problem in broken_links(path)]
    assert broken == []


def test_the_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# There\n\n## Part two: the `rest`\n")
    page.write_text("# Page\n[ok](there.md#part-two-the-rest) [here](#page) [web](https://example.org)\n"
                    "`[code](gone.md)` ![picture](img/missing.png) [gone](guides/gone.md#part)\n"
                    "[no such part](there.md#part-three) [no such heading](#elsewhere)\n")
    assert broken_links(page) == ["page.md: img/missing.png", "page.md: guides/gone.md#part",
                                  "page.md: there.md#part-three", "page.md: #elsewhere"]


def development_citations(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            match = DEVELOPMENT_CITATION.search(line)
            if match:
                found.append(f"{path.relative_to(REPO)}:{number}: {match.group(0)!r}")
    return found


def scanned_files() -> list[Path]:
    user_docs = [p for p in markdown_files() if HISTORY not in p.parents]
    sources = [p for top in SCANNED for p in sorted((REPO / top).rglob("*"))
               if p.is_file() and p.suffix in SUFFIXES and p != Path(__file__)]
    return user_docs + sources + [REPO / "Snakefile", REPO / "Makefile"]


def test_no_doc_docstring_or_comment_cites_numbered_development_sessions():
    assert development_citations(scanned_files()) == []


def test_the_citation_check_catches_session_and_round_numbers(tmp_path):
    cited = ["measured in the ninth session", "(sessions 8-12)", "see RESULTS entry 12", "as in round 3",
             "the eleventh-session run", "docs/RESULTS.md, twelfth session", "its DESIGN names",
             "see DESIGN.md"]
    facts = ["one 30-minute GPU session", "the first pass compiles", "every round asks the engine",
             "a session-scoped fixture", "round trip per format", "rounds 49 -> 32",
             "see docs/design.md"]
    assert all(DEVELOPMENT_CITATION.search(text) for text in cited)
    assert not any(DEVELOPMENT_CITATION.search(text) for text in facts)


def test_readme_stays_a_front_page_and_the_docs_tree_is_there():
    assert len((REPO / "README.md").read_text().splitlines()) <= 160  # the guides hold the rest
    for page in ("getting_started.md", "concepts.md", "design.md", "results.md", "reference/config.md",
                 "guides/own-target-and-data.md", "guides/regeneration.md", "guides/big-targets-sglang.md",
                 "guides/slurm-and-conda.md", "guides/disk-planning.md", "guides/reruns-and-recovery.md"):
        assert (DOCS / page).is_file(), page
