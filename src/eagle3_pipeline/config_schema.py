"""The config's JSON schema (config/schema.yaml): validation with one short message naming the key, and the
schema's defaults for code that builds stage settings without the workflow (tests, benchmarks)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

# PyYAML follows YAML 1.1: an exponent without a dot ("3e-4") is a string, not a number.
_YAML_EXPONENT = re.compile(r"^[+-]?\d+[eE][+-]?\d+$")


class ConfigError(ValueError):
    pass


def check_schema(config: dict[str, Any], schema_path: Path) -> None:
    """Validate against the JSON schema; raise one short ConfigError naming the key (not the whole schema)."""
    import jsonschema

    schema = yaml.safe_load(Path(schema_path).read_text())
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(config),
                    key=lambda e: (list(e.absolute_path), e.validator))
    if not errors:
        return
    problems = [_describe(error) for error in errors[:3]]
    more = f"\n({len(errors) - 3} more problems)" if len(errors) > 3 else ""
    raise ConfigError("\n".join(problems) + more)


def _describe(error: Any) -> str:
    key = ".".join(str(part) for part in error.absolute_path) or "(top level)"
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties") or {})
        unknown = sorted(set(error.instance) - set(allowed))
        where = f"{key}." if error.absolute_path else ""
        return (f"config key {where}{unknown[0] if len(unknown) == 1 else unknown}: unknown key "
                f"(allowed here: {', '.join(allowed)})")
    if error.validator == "required":
        return f"config key {key}: {error.message}"
    message = f"config key {key}: {error.message[:300]}"
    if isinstance(error.instance, str) and _YAML_EXPONENT.match(error.instance.strip()):
        mantissa, exponent = re.split("[eE]", error.instance.strip())
        message += (f"; YAML reads {error.instance} as a string - write {mantissa}.0e{exponent} "
                    f"(with a dot) for a number")
    return message


def schema_properties(schema_path: Path | None = None) -> dict[str, Any]:
    """The schema's top-level keys (config/schema.yaml unless another file is named)."""
    path = schema_path or Path(__file__).resolve().parents[2] / "config" / "schema.yaml"
    return yaml.safe_load(Path(path).read_text())["properties"]


def schema_defaults(section: str, schema_path: Path | None = None) -> dict[str, Any]:
    """The schema's defaults of one config section (nested objects included): what a validated config holds
    for keys it leaves out. For callers outside the workflow (tests, benchmarks) building stage settings."""
    return _defaults(schema_properties(schema_path)[section])


def schema_top_level_default(key: str, schema_path: Path | None = None) -> Any:
    """A top-level key's default (`results_dir`), for code reading a config file without the workflow."""
    return schema_properties(schema_path)[key]["default"]


def _defaults(schema: dict[str, Any]) -> dict[str, Any]:
    values = {}
    for key, sub in (schema.get("properties") or {}).items():
        if sub.get("type") == "object" and "properties" in sub:
            values[key] = sub.get("default", {}) | _defaults(sub)  # its keys' defaults, as validation fills them
        elif "default" in sub:
            values[key] = sub["default"]
    return values
