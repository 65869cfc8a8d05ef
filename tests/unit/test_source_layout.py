"""The layout rules docs/design.md states, checked on the source: artifacts are written and opened only in
formats/, and modules and functions stay small enough to read (no stage importing another: test_stage_settings)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "eagle3_pipeline"
MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 60
# calls that write a file or open a weights/zarr file: only formats/ may make them (logs.py writes the job logs)
ARTIFACT_CALLS = {"write_text", "write_bytes", "dump", "save", "save_file", "safe_open", "open_group", "open_array",
                  "create_array", "to_csv", "savefig"}
ALLOWED_CALLERS = {"logs.py"}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_artifacts_are_written_only_in_formats():
    offenders = []
    for path in modules():
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "formats" or relative.name in ALLOWED_CALLERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            target = node.func.value
            renames = node.func.attr == "replace" and isinstance(target, ast.Name) and target.id == "os"
            if node.func.attr in ARTIFACT_CALLS or renames:
                offenders.append(f"{relative}:{node.lineno} .{node.func.attr}(...)")
    assert not offenders, "\n".join(offenders)


def test_modules_and_functions_stay_small():
    too_long = []
    for path in modules():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(PACKAGE)}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "\n".join(too_long)
