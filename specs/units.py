"""Unit conversions at the edges: files and screens use vendor units, the code uses SI."""

from __future__ import annotations

GIB = 2**30
TERA = 1e12
GIGA = 1e9


def gbps_to_bytes_per_s(gbit_per_s: float) -> float:
    """Network line rate in Gb/s to bytes per second."""
    return gbit_per_s * GIGA / 8.0
