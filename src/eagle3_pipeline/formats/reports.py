"""Reports: the small JSON records stages leave for people and for the report (ingest report, data stats,
parity report, disk plan vs actual, provenance, job files of evaluation workers), the report's figures and
its first page's HTML fragment.
Written whole through a `.partial` sibling, like every artifact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_pipeline.formats.atomic import atomic_file, atomic_write


def write(path: Path, record: dict[str, Any]) -> None:
    atomic_write(Path(path), json.dumps(record, indent=2))


def read(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def write_yaml(path: Path, record: dict[str, Any]) -> None:
    """The training config snapshot (`train/config_snapshot.yaml`): keys in the config's order."""
    import yaml

    atomic_write(Path(path), yaml.safe_dump(record, sort_keys=False))


def read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(Path(path).read_text())


def write_html(path: Path, fragment: str) -> None:
    """An HTML fragment for the report (`report/front_page.html`, embedded by report/workflow.rst)."""
    atomic_write(Path(path), fragment)


def write_figure(figure: Any, path: Path, dpi: int = 110) -> None:
    """A matplotlib figure as PNG (the format named explicitly: the `.partial` name has no image suffix)."""
    with atomic_file(Path(path)) as partial:
        figure.savefig(partial, dpi=dpi, format=Path(path).suffix.lstrip(".") or "png")
