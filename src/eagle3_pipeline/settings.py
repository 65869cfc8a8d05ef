"""The one way a settings type is built from the validated config: `from_section(Settings, section, **given)`.

A settings type is a frozen dataclass with no defaults (they are config/schema.yaml's, nowhere else). Each
field reads the section's key of its own name, or the dotted path `setting(key=...)` names, through an optional
`convert`; fields that do not come from the section (another section's value, `trust_remote_code`) are passed
as keywords. A type that lists the section's keys it does not read (a `NOT_SETTINGS` class attribute, or
`unread=`) is strict: any other key no field reads is an error, so a misspelt key is refused, not dropped."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import field, fields
from typing import Any, TypeVar

T = TypeVar("T")


def setting(key: str | None = None, convert: Callable[[Any], Any] | None = None) -> Any:
    """A field read from `key` (a dotted path inside the section; default: the field's name) through `convert`."""
    return field(metadata={"key": key, "convert": convert})


def from_section(cls: type[T], section: Mapping[str, Any], unread: Collection[str] | None = None,
                 **given: Any) -> T:
    """`cls` with every field from `section` (see the module docstring) or from `given`."""
    unread = getattr(cls, "NOT_SETTINGS", None) if unread is None else unread
    values, read = {}, set()
    for spec in fields(cls):  # type: ignore[arg-type]
        if spec.name in given:
            values[spec.name] = given[spec.name]
            continue
        path = spec.metadata.get("key") or spec.name
        read.add(path.split(".")[0])
        values[spec.name] = _convert(spec.metadata.get("convert"), _lookup(cls, section, path))
    unknown = set(given) - set(values)
    if unknown:
        raise TypeError(f"{cls.__qualname__} has no fields {sorted(unknown)}")
    if unread is not None and (extra := set(section) - read - set(unread)):
        raise ValueError(f"{cls.__qualname__}: unknown config keys {sorted(extra)}")
    return cls(**values)


def _lookup(cls: type, section: Mapping[str, Any], path: str) -> Any:
    value: Any = section
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(f"{cls.__qualname__}: the config section has no key {path!r} (is it validated?)")
        value = value[part]
    return value


def _convert(convert: Callable[[Any], Any] | None, value: Any) -> Any:
    return value if convert is None or value is None else convert(value)
