"""Measures accelerators, or simulates them from datasheets.

The profile schema and the simulated profiles need no torch; measuring on real hardware does.
"""

from profiler.profile import DeviceProfile, LayerCost, LayerCostSource, LayerKind, ProfileEntry, load_profile
from profiler.simulated import SimulatedDevice

__all__ = [
    "DeviceProfile",
    "LayerCost",
    "LayerCostSource",
    "LayerKind",
    "ProfileEntry",
    "SimulatedDevice",
    "load_profile",
]
