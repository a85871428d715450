"""Read YAML/JSON spec files and turn pydantic validation errors into one-line SpecErrors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from specs.errors import SpecError

ModelT = TypeVar("ModelT", bound=BaseModel)


def read_mapping(path: Path) -> dict[str, Any]:
    """Load a YAML or JSON file whose top level is a mapping."""
    source = str(path)
    if not path.exists():
        raise SpecError(source, "", "file not found")
    if path.is_dir():
        raise SpecError(source, "", "expected a file, got a directory")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as err:
        raise SpecError(source, f"line {err.lineno}", f"invalid JSON: {err.msg}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise SpecError(source, where, f"invalid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise SpecError(source, "", f"expected a mapping at the top level, got {type(data).__name__}")
    return data


def field_path(loc: tuple[int | str, ...]) -> str:
    """Render a pydantic location like ('groups', 1, 'nodes') as 'groups[1].nodes'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def validate(model: type[ModelT], data: dict[str, Any], source: str, prefix: str = "") -> ModelT:
    """Validate data against a pydantic model; the first error becomes a SpecError naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        field = field_path(loc)
        if prefix:
            field = f"{prefix}.{field}" if field else prefix
        message = first["msg"]
        if first["type"] == "extra_forbidden":
            message = "unknown field (check the spelling; see the README for the format)"
        elif first["type"] == "missing":
            message = "required field is missing"
        elif "input" in first and first["type"] != "value_error":
            message = f"{message}, got {first['input']!r}"
        message = message.removeprefix("Value error, ")
        more = len(err.errors()) - 1
        if more:
            message += f" (and {more} more error{'s' if more > 1 else ''})"
        raise SpecError(source, field, message) from None
