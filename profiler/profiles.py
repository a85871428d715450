"""A directory of device profiles: the files in it, and the profiles checked against the model to plan.

A profile times one layer shape; planning another model with it would silently mistime every layer, so loading
refuses a profile whose shape differs and a second profile of the same device. Torch-free.
"""

from __future__ import annotations

from pathlib import Path

from profiler.profile import DeviceProfile, load_profile
from specs.errors import SpecError
from specs.model import ModelSpec

# the fields that decide a decoder layer's cost: a profile must have been measured with the same
SHAPE_FIELDS = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads", "vocab_size", "mlp")


def _json_files(directory: Path) -> list[Path]:
    """The *.json files of a directory, sorted (deterministic order); refused when it is not a directory."""
    if not directory.is_dir():
        raise SpecError(str(directory), "", "expected a directory of profile JSON files")
    return sorted(directory.glob("*.json"))


def profile_files(directory: Path) -> list[Path]:
    """The profile files of a directory, at least one (a fit from an empty directory is a user error)."""
    paths = _json_files(directory)
    if not paths:
        raise SpecError(str(directory), "", "no *.json profiles in this directory")
    return paths


def load_profiles(directory: Path | None, model: ModelSpec) -> dict[str, DeviceProfile]:
    """Measured (or saved simulated) profiles by device key; each must describe this model's layer shape."""
    if directory is None:
        return {}
    profiles: dict[str, DeviceProfile] = {}
    for path in _json_files(directory):
        profile = load_profile(path)
        for field in SHAPE_FIELDS:
            if profile.model.get(field) != getattr(model, field):
                raise SpecError(
                    str(path),
                    f"model.{field}",
                    f"profiled {profile.model.get(field)!r}, the model to plan has {getattr(model, field)!r}",
                )
        key = str(profile.device.get("key", ""))
        if key in profiles:
            raise SpecError(str(path), "device.key", f"a second profile for device {key!r} in {directory}")
        profiles[key] = profile
    return profiles
