"""The one boundary for input files: read YAML/JSON safely and turn every problem into a one-line SpecError.

Every file a user gives hetplan (cluster, model, training, plan, profile, run record, link profile) is read here:
UTF-8 only, at most MAX_FILE_BYTES, nested at most MAX_DEPTH levels, YAML aliases expanding to at most MAX_NODES
values, no duplicate keys, no non-finite numbers. Messages quote at most QUOTE_CHARS characters of input.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import numbers
import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import BaseModel, BeforeValidator, Field, Strict, ValidationError

from specs.errors import SpecError, also_wrong, expected_wording

ModelT = TypeVar("ModelT", bound=BaseModel)

MAX_FILE_BYTES = 64 * 2**20
MAX_DEPTH = 50
MAX_NODES = 1_000_000
QUOTE_CHARS = 200


def _python_int(value: object) -> object:
    """numpy's integers (a launcher's arrays) as Python's: strict validation refused them as "not an integer"."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)
    return value


# Numbers in files: integers must be integers (not `true`, "3" or 3.0) and floats finite numbers (not strings).
StrictInt = Annotated[int, Strict(), BeforeValidator(_python_int)]
StrictBool = Annotated[bool, Strict()]
PositiveInt = Annotated[int, Strict(), Field(ge=1), BeforeValidator(_python_int)]
StrictFloat = Annotated[float, Strict(), Field(allow_inf_nan=False)]


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes (hex): what a plan records of the files its costs came from."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def text_sha256(text: str) -> str:
    """The SHA-256 (hex) of the file `text` makes when written as UTF-8 (an export records its files' so)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def quote(value: Any) -> str:
    """repr of a value, cut to QUOTE_CHARS characters (error messages never echo a whole input); true, false and null
    as a YAML or JSON file writes them (`nodes: true` read "got True")."""
    text = {True: "true", False: "false", None: "null"}.get(value, repr(value)) if _is_literal(value) else repr(value)
    return text if len(text) <= QUOTE_CHARS else text[: QUOTE_CHARS - 3] + "..."


def _is_literal(value: Any) -> bool:
    """true, false or null (not 1 or 0, which equal True and False)."""
    return value is None or isinstance(value, bool)


class _InputError(Exception):
    """A problem found while reading, with where (a line or a field) it is."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(message)
        self.where = where
        self.message = message


class _StrictYamlLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys in a mapping (the last would silently win)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the base constructor names it
                break
            if duplicate:
                line = key_node.start_mark.line + 1
                raise _InputError(f"line {line}", f"duplicate key {quote(key)}")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _check_node_graph(root: yaml.Node) -> None:
    """Refuse YAML whose aliases expand past MAX_NODES values or MAX_DEPTH levels, or refer to themselves."""
    expanded: dict[int, tuple[int, int]] = {}  # id(node) -> (values when expanded, depth)
    visiting: set[int] = set()

    def children(node: yaml.Node) -> Iterator[yaml.Node]:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                yield key
                yield value
        elif isinstance(node, yaml.SequenceNode):
            yield from node.value

    def measure(node: yaml.Node, level: int) -> tuple[int, int]:
        if id(node) in expanded:
            return expanded[id(node)]
        if id(node) in visiting:
            raise _InputError(f"line {node.start_mark.line + 1}", "an alias refers to itself (a recursive structure)")
        if level > MAX_DEPTH:
            raise _InputError(f"line {node.start_mark.line + 1}", f"nested deeper than {MAX_DEPTH} levels")
        visiting.add(id(node))
        count, depth = 1, 0
        for child in children(node):
            child_count, child_depth = measure(child, level + 1)
            count += child_count
            depth = max(depth, child_depth + 1)
            if count > MAX_NODES:
                raise _InputError("", f"aliases expand to more than {MAX_NODES:,} values")
        visiting.discard(id(node))
        expanded[id(node)] = (count, depth)
        return count, depth

    measure(root, 0)


def _load_yaml(text: str) -> Any:
    loader = _StrictYamlLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        _check_node_graph(root)
        return loader.construct_document(root)
    finally:
        loader.dispose()


def _load_json(text: str) -> Any:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise _InputError("", f"duplicate key {quote(key)}")
            out[key] = value
        return out

    def no_constant(name: str) -> Any:
        raise _InputError("", f"{name} is not a number a spec can use (expected a finite number)")

    return json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constant)


def _check_values(data: Any) -> None:
    """Refuse non-finite numbers and nesting past MAX_DEPTH anywhere in loaded data (names the field)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, where, level = stack.pop()
        if level > MAX_DEPTH:
            raise _InputError(where, f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, float) and not math.isfinite(value):
            raise _InputError(where, f"expected a finite number, got {value}")
        if isinstance(value, dict):
            stack += [(v, f"{where}.{k}" if where else str(k), level + 1) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(v, f"{where}[{i}]", level + 1) for i, v in enumerate(value)]


def read_mapping(path: Path) -> dict[str, Any]:
    """Load a YAML or JSON file whose top level is a mapping (JSON by the .json suffix)."""
    source = str(path)
    if not path.exists():
        raise SpecError(source, "", "file not found")
    if path.is_dir():
        raise SpecError(source, "", "expected a file, got a directory")
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise SpecError(source, "", f"{size:,} bytes: larger than any spec ({MAX_FILE_BYTES:,} bytes at most)")
        raw = path.read_bytes()
    except OSError as err:
        raise SpecError(source, "", f"cannot read: {err.strerror or err}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        if b"hetplan.predictor/" in raw[:256]:  # (its schema, near the start of the pickle)
            raise SpecError(source, "", "expected YAML or JSON text, got a predictor (from hetplan fit)") from None
        raise SpecError(source, "", f"not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start})") from None
    try:
        data = _load_json(text) if path.suffix.lower() == ".json" else _load_yaml(text)
        _check_values(data)
    except _InputError as err:
        raise SpecError(source, err.where, err.message) from None
    except RecursionError:
        raise SpecError(source, "", f"nested deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as err:
        raise SpecError(source, f"line {err.lineno}", f"invalid JSON: {err.msg}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise SpecError(source, where, f"invalid YAML: {problem}") from None
    if data is None:  # nothing but blanks or comments
        raise SpecError(source, "", "the file is empty: expected a mapping at the top level")
    if not isinstance(data, dict):
        kinds = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true/false"}
        kind = kinds.get(type(data), type(data).__name__)
        raise SpecError(source, "", f"expected a mapping at the top level, got {kind}")
    return data


# The kinds of file a user gives hetplan, as a message names them, and what marks each: the `schema` a file hetplan
# writes names (without its version), else a field only that kind has (the first that matches: a Hugging Face config
# by its layer count too when it lacks model_type, and before a model file, as load_model has always taken it).
PLAN_FILE, CLUSTER_FILE, MODEL_FILE = "a plan", "a cluster file", "a model file"
HF_CONFIG, TRAINING_FILE = "a Hugging Face config.json", "a training file"
KIND_BY_SCHEMA = {
    "hetplan.plan": PLAN_FILE,
    "hetplan.profile": "a device profile",
    "hetplan.host": "a host profile",
    "hetplan.links": "a link profile",
    "hetplan.run": "a run record",
    "hetplan.runs": "a file of run records",
    "calibration-runs": "a file of calibration runs",
    "hetplan.predictor": "a predictor",
    "hetplan.checkpoint": "a checkpoint's metadata",
}
KIND_BY_FIELD = (
    ("groups", CLUSTER_FILE),
    *((field, HF_CONFIG) for field in ("model_type", "architectures", "num_hidden_layers", "n_layer")),
    ("num_layers", MODEL_FILE),
    ("pipelines", PLAN_FILE),  # (a plan has a top-level zero_stage too: it is marked before the training fields)
    *((field, TRAINING_FILE) for field in ("global_batch_size", "micro_batch_sizes", "zero_stage", "dtype")),
    ("exported_strategy", "an export summary (export.json)"),
)


def file_kind(data: dict[str, Any]) -> str:
    """The kind of file `data` was read from, as a message names it ("a plan", "a cluster file"), by its schema or a
    field only that kind has; "" when nothing marks it (a file of misspelt fields, say)."""
    schema = data.get("schema")
    if isinstance(schema, str):
        return KIND_BY_SCHEMA.get(schema.split("/")[0], "")
    return next((kind for field, kind in KIND_BY_FIELD if field in data), "")


def check_file_kind(data: dict[str, Any], source: str, expected: str, accepted: tuple[str, ...]) -> None:
    """Refuse a file of another kind than `accepted` in one line naming what it is and what was `expected`: the
    fields of a plan given for a cluster all read as misspelt ("schema: unknown field (also wrong: name, groups, ...
    and 32 more)")."""
    kind = file_kind(data)
    if kind and kind not in accepted:
        raise SpecError(source, "", f"expected {expected}, got {kind}")


def field_path(loc: tuple[int | str, ...]) -> str:
    """Render a pydantic location like ('groups', 1, 'nodes') as 'groups[1].nodes'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


_UNION_BRANCH = re.compile(r"^[A-Z][A-Za-z0-9]*$")  # a union's branch in a location: its model's class name


def _branches(loc: tuple[int | str, ...]) -> set[str]:
    """The union branches a pydantic error location passes through."""
    return {p for p in loc if isinstance(p, str) and _UNION_BRANCH.match(p)}


def _field_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """A pydantic error location without its validators' own steps and its unions' branch names (fields are
    snake_case)."""
    return tuple(
        p
        for p in loc
        if not (
            isinstance(p, str)
            and (p.startswith("function-") or p in ("constrained-int", "constrained-float") or _UNION_BRANCH.match(p))
        )
    )


def _one_type(annotation: Any) -> Any:
    """The type inside Optional[...] and Annotated[...]; None for a union of several."""
    while typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        if typing.get_origin(annotation) is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
            continue
        inner = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(inner) != 1:
            return None
        annotation = inner[0]
    return annotation


def _field_names(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names (aliases where given) of the mapping at `loc` inside `model`, followed through nested models,
    lists and optional fields; none where the path leaves the models (a union of two models, a plain mapping)."""
    current: Any = model
    for part in loc:
        current = _one_type(current)
        if isinstance(part, int):
            if typing.get_origin(current) is not list:
                return []
            current = typing.get_args(current)[0]
        elif isinstance(current, type) and issubclass(current, BaseModel) and part in current.model_fields:
            current = current.model_fields[part].annotation
        else:
            return []
    current = _one_type(current)
    if not (isinstance(current, type) and issubclass(current, BaseModel)):
        return []
    return [info.alias or name for name, info in current.model_fields.items()]


class CheckedModel(BaseModel):
    """A spec that, built in code (`TrainingSpec(global_batch_size=-1)`), is refused in one line as its file would be
    (a SpecError naming the class and the field), not with pydantic's multi-line ValidationError. Files and mappings
    are read with validate(), which names the file."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise spec_error(type(self), err, f"{type(self).__name__}()") from None

    # pydantic's mark of its own __init__ (RootModel's too): validation (model_validate, a nested spec) then builds
    # the model itself, not through this __init__, so validate() names the file and a nested spec its path
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]


def validate(model: type[ModelT], data: dict[str, Any], source: str, prefix: str = "") -> ModelT:
    """Validate data against a pydantic model; the first error becomes a SpecError naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise spec_error(model, err, source, prefix) from None


def spec_error(model: type[BaseModel], err: ValidationError, source: str, prefix: str = "") -> SpecError:
    """pydantic's errors of `model` as one line: the first wrong field with its expectation, the others after it."""
    errors = err.errors()
    # a misspelt field also leaves the field it meant missing: the misspelling is the error to name; the deepest
    # one, since a union's other branches refuse the whole mapping's keys (a run record's plan layout)
    misspelt = [e for e in errors if e["type"] == "extra_forbidden"]
    first = max(misspelt, key=lambda e: len(_field_loc(e["loc"]))) if misspelt else errors[0]
    loc = _field_loc(first["loc"])
    field = field_path(loc)
    if prefix:
        field = f"{prefix}.{field}" if field else prefix
    message = expected_wording(first["msg"])
    meant: list[str] = []
    if first["type"] == "extra_forbidden":
        missing = [str(_field_loc(e["loc"])[-1]) for e in errors if e["type"] == "missing"
                   and _field_loc(e["loc"])[:-1] == loc[:-1]]  # fmt: skip
        meant = difflib.get_close_matches(str(loc[-1]), missing, n=1) if loc else []
        known = difflib.get_close_matches(str(loc[-1]), _field_names(model, loc[:-1]), n=1) if loc else []
        message = (
            f"unknown field: did you mean {meant[0]} (required, missing)?"
            if meant
            else f"unknown field: did you mean {known[0]}?"
            if known
            else "unknown field (check the spelling; see the README for the format)"
        )
    elif first["type"] == "missing":
        message = "required field is missing"
    elif "input" in first and first["type"] != "value_error":
        message = f"{message}, got {quote(first['input'])}"
    message = message.removeprefix("Value error, ")
    # the others by field (the missing field a misspelling meant is the same error)
    # and a union's branches other than the one named (which refuse what the named one accepts)
    same = (*loc[:-1], meant[0]) if meant else None
    branches = _branches(first["loc"])
    others = [e for e in errors if e is not first and _branches(e["loc"]) <= branches
              and not (e["type"] == "missing" and _field_loc(e["loc"]) == same)]  # fmt: skip
    fields = list(dict.fromkeys(field_path(_field_loc(e["loc"])) or "(top level)" for e in others))
    message += also_wrong([f"{prefix}.{name}" if prefix else name for name in fields])
    return SpecError(source, field, message)
