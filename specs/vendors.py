"""The vendor registry (specs/catalog/vendors.yaml): island names, native libraries and the names torch and launchers
use for them, as data that specs, comm and exports share (comm/vendors.py adds run-time detection)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from specs.catalog import Catalog, load_catalog


class VendorInfo(BaseModel):
    """One island kind: a vendor whose devices' native collective library talks among them directly."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str  # the island name (comm/, --islands)
    aliases: tuple[str, ...] = ()  # other names, among them the device catalog's vendor strings ("huawei")
    collective_library: str  # as the device catalog names it: nccl, rccl, hccl, ...
    library_name: str  # what users call it
    device_type: str  # torch device type
    backend: str  # torch.distributed backend name of the native library
    visible_devices_env: str | None = None  # picks a process's local devices in a torchrun launch


def _vendors() -> Catalog[VendorInfo]:
    return load_catalog("vendors.yaml", VendorInfo, "vendor")


def vendor_catalog() -> dict[str, VendorInfo]:
    """All vendors by island name, in detection order."""
    return _vendors().entries


def find_vendor(name: str) -> VendorInfo | None:
    """The vendor an island name or alias (a device catalog vendor string) names, or None."""
    return _vendors().find(name)


def get_vendor(name: str, source: str = "get_vendor()", field: str = "name") -> VendorInfo:
    """The vendor a name resolves to; an unknown name is a one-line SpecError listing the known vendors."""
    return _vendors().get(name, source, field)
