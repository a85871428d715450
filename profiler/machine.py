"""What this machine offers local runs and measurements (no torch: the planner's report reads it too)."""

from __future__ import annotations

import os


def host_cores() -> int:
    """The cores this process may run on, which local ranks share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
