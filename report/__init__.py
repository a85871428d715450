"""Pictures and reports of a plan, torch-free: `explain` (Gantt, memory per stage, bottleneck, HTML), `traffic`
(bytes by dimension and link class, rail-only check, heatmap), `traffic_calc`, the tables the CLI prints, and what
it prints on stderr (progress, one-line failures).

Functions are named like the commands they serve; the CLI parses flags, calls them and prints what they return.
matplotlib is imported only by the functions that draw, and the names below only when first used: the CLI's entry
point imports report.failures on every run, which must not load the cost model."""

from __future__ import annotations

from importlib import import_module
from typing import Any

_HOMES = {
    "Explanation": "report.explanation",
    "explain": "report.explanation",
    "RailOnly": "report.network",
    "TrafficReport": "report.network",
    "rail_only": "report.network",
    "traffic": "report.network",
    "traffic_calc": "report.network",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    """`from report import explain` loads report.explanation then (PEP 562)."""
    if name not in _HOMES:
        raise AttributeError(f"module 'report' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)
