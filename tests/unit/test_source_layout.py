"""The layout rules docs/design.md states, checked on the source: artifacts are written and opened only in
formats/, modules and functions stay small enough to read, no import cycle and no arrow from a lower layer up to
stages/ (no stage importing another: test_stage_settings)."""

from __future__ import annotations

import ast
import re
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


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every module's imports of the package's modules: top-level, function-local and TYPE_CHECKING ones alike
    (`from package import name` counts as the submodule `package.name` where that is one). A package's
    `__init__` importing its own submodules (re-exports, a factory choosing a backend) is left out: that is
    how a package presents its parts, not an arrow between layers."""
    names = {module_name(path): path for path in modules()}
    graph = {}
    for name, path in names.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle3_pipeline"):
                imported |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in names else node.module
                             for alias in node.names}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names if alias.name.startswith("eagle3_pipeline")}
        is_package = path.name == "__init__.py"
        graph[name] = {m for m in imported if m in names and m != name
                       and not (is_package and m.startswith(name + "."))}
    return graph


def test_no_module_below_the_stages_imports_a_stage():
    upward = [f"{module} imports {imported}" for module, imports in import_graph().items()
              for imported in imports
              if imported.startswith("eagle3_pipeline.stages") and not module.startswith("eagle3_pipeline.stages")]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = import_graph()

    def reaches(start: str, goal: str) -> list[str] | None:
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop()
            for nxt in sorted(graph[path[-1]]):
                if nxt == goal:
                    return path + [nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    paths.append(path + [nxt])
        return None

    cycles = {" -> ".join(cycle) for module in graph if (cycle := reaches(module, module))}
    assert not cycles, "\n".join(sorted(cycles))


def test_the_runs_paths_are_built_only_in_layout_py():
    """results/<run>/... is spelt once (src/eagle3_pipeline/layout.py): no rule or module joins a path onto the
    run's directory itself."""
    root = PACKAGE.parents[1]
    joins = re.compile(r"""f["'][^"']*\{(RESULTS|TRAIN_STATE|WINDOWS_DIR)\}/|\[["']run["']\]\}/""")
    sources = [*root.glob("rules/*.smk"), root / "Snakefile", *(p for p in modules() if p.name != "layout.py")]
    offenders = [f"{path.relative_to(root)}:{number}" for path in sources
                 for number, line in enumerate(path.read_text().splitlines(), 1) if joins.search(line)]
    assert not offenders, offenders
    assert joins.search('x = f"{RESULTS}/tokens"') and joins.search("f\"{config['run']}/x\"")
