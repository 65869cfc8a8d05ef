"""Write docs/reference/config.md from config/schema.yaml: every key with its path, type, default, allowed values
and description, one table per section. The schema is the one source; this page is its rendering.

    .venv/bin/python tools/config_reference.py           (write docs/reference/config.md)
    .venv/bin/python tools/config_reference.py --check   (exit 1 naming the keys whose rows drifted)

tests/unit/test_docs.py fails when the committed page differs from what the schema renders.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "config" / "schema.yaml"
PAGE = REPO / "docs" / "reference" / "config.md"
COMMAND = ".venv/bin/python tools/config_reference.py"
COLUMNS = ("key", "type", "default", "allowed", "description")

HEADER = f"""# Configuration reference

> Generated from `config/schema.yaml` by `{COMMAND}` - do not edit by hand. After changing the schema, run that
> command; `{COMMAND} --check` (and tests/unit/test_docs.py) fails while this page and the schema disagree.

Every key the pipeline reads, generated from [`config/schema.yaml`](../../config/schema.yaml). A run's config is
its `--configfile` files merged in order, mapping by mapping ([`config/config.yaml`](../../config/config.yaml), the
2-core demo, when none is given); a key left out takes the default below. Unknown keys, wrong types and values
outside the allowed range stop the run before any job starts (also in `snakemake -n`), naming the key. Write
floats with a dot (`3.0e-4`): YAML reads `3e-4` as a string. Keys are written as paths: `train.learning_rate` is
`learning_rate` under `train:`; `evaluate.tree[]` is one entry of the list `evaluate.tree`.
"""


def type_of(node: dict[str, Any]) -> str:
    """The JSON-schema type as prose: 'integer', 'string or null', 'list of string'; an untyped enum says so."""
    declared = node.get("type")
    if declared is None:
        return "one of the allowed values" if "enum" in node else "any"
    types = declared if isinstance(declared, list) else [declared]
    names = []
    for name in types:
        if name == "array" and isinstance(node.get("items"), dict) and node["items"].get("type"):
            names.append(f"list of {type_of(node['items'])}")
        else:
            names.append("list" if name == "array" else "mapping" if name == "object" else name)
    return " or ".join(names)


def literal(value: Any) -> str:
    """A YAML value as it would be written in a config file, in backticks."""
    if isinstance(value, str):
        return f"`{value}`"
    return f"`{json.dumps(value, separators=(', ', ': '))}`".replace('"', "")


def allowed_of(node: dict[str, Any]) -> str:
    """Enumerations, bounds, patterns and list lengths, joined with '; '."""
    parts = []
    if "enum" in node:
        parts.append(", ".join(literal(v) for v in node["enum"]))
    bounds = (("minimum", "at least"), ("exclusiveMinimum", "more than"), ("maximum", "at most"),
              ("exclusiveMaximum", "less than"))
    items = node.get("items") if isinstance(node.get("items"), dict) else {}
    for source, prefix in ((node, ""), (items, "each ")):
        for key, symbol in bounds:
            if key in source:
                parts.append(f"{prefix}{symbol} {source[key]}")
    if "pattern" in node:
        parts.append(f"matches `{node['pattern']}`")
    if "minItems" in node and node.get("maxItems") == node["minItems"]:
        parts.append(f"exactly {entries(node['minItems'])}")
    else:
        if "minItems" in node:
            parts.append(f"at least {entries(node['minItems'])}")
        if "maxItems" in node:
            parts.append(f"at most {entries(node['maxItems'])}")
    return "; ".join(parts)


def entries(count: int) -> str:
    return f"{count} entry" if count == 1 else f"{count} entries"


def cell(text: str) -> str:
    """Text that stays inside one markdown table cell and is not read as HTML."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text.replace("<", "&lt;")


def rows(node: dict[str, Any], path: str, required: set[str]) -> Iterator[tuple[str, ...]]:
    """One row per key under `node`, depth first; objects and lists of objects recurse into their keys."""
    for key, sub in (node.get("properties") or {}).items():
        key_path = f"{path}.{key}" if path else key
        default = "required" if key in required else ""
        if "default" in sub and not sub.get("properties"):  # a mapping's default is its keys' rows below
            default = literal(sub["default"])
        yield (f"`{key_path}`", type_of(sub), default, allowed_of(sub), sub.get("description", ""))
        if sub.get("properties"):
            yield from rows(sub, key_path, set(sub.get("required", [])))
        items = sub.get("items")
        if isinstance(items, dict) and items.get("properties"):
            yield from rows(items, f"{key_path}[]", set(items.get("required", [])))


def table(section_rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in section_rows]
    return "\n".join(lines)


def render(schema: dict[str, Any]) -> str:
    """The whole page: the header, top-level keys, then one section per mapping of the schema."""
    required = set(schema.get("required", []))
    scalars = {k: v for k, v in schema["properties"].items() if not v.get("properties")}
    parts = [HEADER, "## Top level\n", table(list(rows({"properties": scalars}, "", required)))]
    for name, section in schema["properties"].items():
        if name in scalars:
            continue
        parts.append(f"\n## `{name}`\n")
        if section.get("description"):
            parts.append(cell(section["description"]) + "\n")
        parts.append(table(list(rows(section, name, set(section.get("required", []))))))
    return "\n".join(parts) + "\n"


def row_map(page: str) -> dict[str, str]:
    """Table rows of a rendered page by their key path (the first cell)."""
    found = {}
    for line in page.splitlines():
        if line.startswith("| `"):
            found[line.split("|")[1].strip()] = line
    return found


def drift(committed: str, expected: str) -> list[str]:
    """What differs between the committed page and the schema's rendering, by key; [] when they agree."""
    old, new = row_map(committed), row_map(expected)
    problems = [f"{key}: in the schema, not on the page" for key in new if key not in old]
    problems += [f"{key}: on the page, not in the schema" for key in old if key not in new]
    problems += [f"{key}: row differs from the schema" for key in new if key in old and old[key] != new[key]]
    if not problems and committed != expected:
        problems.append("text outside the key rows differs (header or section descriptions)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the schema")
    parser.add_argument("--schema", type=Path, default=SCHEMA)
    parser.add_argument("--page", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    expected = render(yaml.safe_load(args.schema.read_text()))
    if not args.check:
        args.page.parent.mkdir(parents=True, exist_ok=True)
        args.page.write_text(expected)
        print(f"wrote {args.page}")
        return 0
    committed = args.page.read_text() if args.page.exists() else ""
    problems = drift(committed, expected)
    for problem in problems:
        print(f"{args.page.name} drifted from {args.schema.name}: {problem}", file=sys.stderr)
    if problems:
        print(f"regenerate it: {COMMAND}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
