"""What a command says on stderr before its result (notes on assumed settings, the costs it evaluates with), held
until its input is checked: the first progress line or result prints them, a success that showed nothing prints
them at the end, and a refusal drops them, so that its one line is the only one (report.failures)."""

from __future__ import annotations

import sys

_held: list[str] = []


def say(line: str) -> None:
    """Say `line` on stderr once the command gets past its checks."""
    _held.append(line)


def flush() -> None:
    """Print what was held (the command's checks passed: it works or shows its result now)."""
    if not _held:
        return
    lines = list(_held)
    _held.clear()
    try:
        for line in lines:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed or full stderr must not fail the command (as report.progress)
        pass


def drop() -> None:
    """Forget what was held (the command failed: its one line says why)."""
    _held.clear()
