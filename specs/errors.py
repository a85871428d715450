"""The one exception hierarchy: every user-facing failure is a HetplanError with a one-line message."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from os import PathLike

# pydantic's phrasing of a value's expectation ("Input should be ...", also in typer's flag errors) and the house's
# ("expected ..."), in the order tried
_EXPECTATIONS = (
    (re.compile(r"^input should be greater than or equal to (.+)$", re.I), r"expected a value >= \1"),
    (re.compile(r"^input should be greater than (.+)$", re.I), r"expected a value > \1"),
    (re.compile(r"^input should be less than or equal to (.+)$", re.I), r"expected a value <= \1"),
    (re.compile(r"^input should be less than (.+)$", re.I), r"expected a value < \1"),
    (re.compile(r"^input should be a valid integer\b.*$", re.I), "expected an integer"),
    (re.compile(r"^input should be a valid number\b.*$", re.I), "expected a number"),
    (re.compile(r"^input should be a valid boolean\b.*$", re.I), "expected true or false"),
    (re.compile(r"^input should be a valid string\b.*$", re.I), "expected text"),
    (re.compile(r"^input should be a valid list\b.*$", re.I), "expected a list"),
    (re.compile(r"^input should be a valid dictionary\b.*$", re.I), "expected a mapping"),
    (re.compile(r"^input should be a finite number$", re.I), "expected a finite number"),
    (re.compile(r"^input should be a valid tuple\b.*$", re.I), "expected a list"),
    (
        re.compile(r"^\w+ should have at least (\d+) items? after validation.*$", re.I),
        lambda m: _counted("at least", m),
    ),
    (re.compile(r"^\w+ should have at most (\d+) items? after validation.*$", re.I), lambda m: _counted("at most", m)),
    (
        re.compile(r"^string should have at least (\d+) characters?$", re.I),
        lambda m: _counted("at least", m, "character"),
    ),
    (re.compile(r"^string should match pattern '(.+)'$", re.I), r"expected text matching \1"),
    (re.compile(r"^input should be (.+)$", re.I), r"expected \1"),  # a choice: 'off', 'refine' or 'exhaustive'
)


def also_wrong(fields: list[str], shown: int = 3) -> str:
    """' (also wrong: a, b, c and 2 more)': the fields of a file's other mistakes, after the first one's message."""
    if not fields:
        return ""
    rest = f" and {len(fields) - shown} more" if len(fields) > shown else ""
    return f" (also wrong: {', '.join(fields[:shown])}{rest})"


def _counted(bound: str, match: re.Match[str], thing: str = "item") -> str:
    count = int(match[1])
    return f"expected {bound} {count} {thing}{'' if count == 1 else 's'}"


def expected_wording(message: str) -> str:
    """A validation message in the house's words: "Input should be a valid integer, unable to parse ..." ->
    "expected an integer"; a message in no known phrasing is returned as it is."""
    for pattern, replacement in _EXPECTATIONS:
        if pattern.match(message):
            return pattern.sub(replacement, message)
    return message


class HetplanError(Exception):
    """A failure the user can act on; the CLI prints its message on one line and exits 2."""


class SpecError(HetplanError):
    """A spec file (or flag) is invalid: names the file, the field and what was expected."""

    def __init__(self, source: str, field: str, expectation: str) -> None:
        self.source = source
        self.field = field
        self.expectation = expectation
        where = f"{source}: {field}" if field else source
        super().__init__(f"{where}: {expectation}")


def expect_argument(value: object, kinds: type | tuple[type, ...], function: str, argument: str, what: str) -> None:
    """A Python API argument of one of `kinds`, else a one-line SpecError naming the function, the argument and `what`
    it takes (a path where a loaded spec is expected failed deep inside with an AttributeError)."""
    if not isinstance(value, kinds):
        raise wrong_argument(value, function, argument, what)


def expect_list(value: object, function: str, argument: str, what: str) -> None:
    """A Python API argument that is a list (or tuple, set, ...) of items, else a one-line SpecError naming the
    function, the argument and `what` it takes: a string is a sequence too, read letter by letter ('n' is no ZeRO
    shard), and a number is none."""
    if isinstance(value, (str, bytes, PathLike, Mapping)) or not isinstance(value, Iterable):
        raise wrong_argument(value, function, argument, what)


def wrong_argument(value: object, function: str, argument: str, what: str) -> SpecError:
    """The one-line error of expect_argument, for a check that is not of the value's type alone. The value is shown
    where its text is short, or a string or path (cut at 60 characters); a spec or a plan by its type alone."""
    shown = repr(value)
    if len(shown) > 60:
        shown = f"{shown:.60}" if isinstance(value, (str, PathLike)) else ""
    return SpecError(function, argument, f"expected {what}, got {type(value).__name__} {shown}".rstrip())


class DoesNotFitError(HetplanError):
    """No strategy fits device memory; carries the smallest shortfall found."""

    def __init__(self, message: str, shortfall_bytes: float) -> None:
        self.shortfall_bytes = shortfall_bytes
        super().__init__(message)


class TorchMissingError(HetplanError):
    """A command that measures or runs needs torch, which is an optional extra."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what} needs PyTorch, which is not installed: pip install 'hetplan[torch]' (from a clone: make test; "
            "CPU-only, first: pip install torch --index-url https://download.pytorch.org/whl/cpu)"
        )
