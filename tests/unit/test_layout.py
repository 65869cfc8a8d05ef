"""The tests' own layout: test modules live in tests/unit/ or tests/workflow/, and share helpers only through
the conftest files, never by importing another test module."""

from __future__ import annotations

import ast

from tests.conftest import REPO

TESTS = REPO / "tests"


def imported_modules(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def test_test_modules_live_in_unit_or_workflow():
    misplaced = [str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
                 if p.parent.name not in ("unit", "workflow")]
    assert misplaced == []


def test_no_test_module_imports_another_module_of_the_tests_but_a_conftest():
    for path in TESTS.rglob("*.py"):
        for name in imported_modules(path):
            if name.startswith(("tests", ".")):
                assert name.split(".")[-1] == "conftest", f"{path.relative_to(REPO)} imports {name}"
