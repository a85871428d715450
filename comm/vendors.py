"""Accelerator vendors at run time: the vendor registry (specs/catalog/vendors.yaml) plus how to detect each here.

A new vendor is an entry in the registry and, to be detected locally, a check in _DETECT. Detection follows
shared/reference/torch-distributed.md: a CUDA build of torch means NCCL, a ROCm build (torch.version.hip) RCCL under
the same backend name `nccl`, `torch_npu` registers `hccl` for `npu`, Intel XPU uses `xccl`, and the CPU Gloo.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specs.vendors import VendorInfo, vendor_catalog


@dataclass(frozen=True)
class Vendor:
    """An island kind: devices of one vendor whose native library talks among them directly."""

    name: str
    device_type: str  # torch device type: cuda, npu, xpu, cpu
    backend: str  # torch.distributed backend name of the native library
    library: str  # what users call it
    available: Callable[[], bool]

    @classmethod
    def from_info(cls, info: VendorInfo, available: Callable[[], bool]) -> Vendor:
        """The registry's entry with a local availability check."""
        return cls(info.key, info.device_type, info.backend, info.library_name, available)


def _cuda_flavour(hip: bool) -> Callable[[], bool]:
    def check() -> bool:
        return torch.cuda.is_available() and (getattr(torch.version, "hip", None) is not None) == hip

    return check


def _npu() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu and the hccl backend)

    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def _hpu() -> bool:
    if importlib.util.find_spec("habana_frameworks") is None:
        return False
    import habana_frameworks.torch  # noqa: F401  (registers torch.hpu and Habana's hccl backend)

    return bool(getattr(torch, "hpu", None) and torch.hpu.is_available())


def _xpu() -> bool:
    return bool(getattr(torch, "xpu", None) and torch.xpu.is_available())


def _never() -> bool:
    return False


# Registry key -> "is this process's accelerator of that vendor"; a vendor without a check is never detected here.
_DETECT: dict[str, Callable[[], bool]] = {
    "nvidia": _cuda_flavour(hip=False),
    "amd": _cuda_flavour(hip=True),
    "ascend": _npu,
    "habana": _hpu,
    "intel": _xpu,
    "cpu": lambda: True,
}

VENDORS: dict[str, Vendor] = {}


def register_vendor(vendor: Vendor) -> None:
    """Add (or replace) a vendor; the communicator looks islands up by name."""
    VENDORS[vendor.name] = vendor


for _info in vendor_catalog().values():
    register_vendor(Vendor.from_info(_info, _DETECT.get(_info.key, _never)))

# Cross-vendor libraries used for bridged groups when importable (behind the same API); else host-staged Gloo.
CROSS_VENDOR_BACKENDS = {"flagcx": "flagcx"}


def detect_local_vendor() -> Vendor:
    """The vendor of this process's accelerator (the first available in registry order; the CPU last)."""
    for vendor in VENDORS.values():
        if vendor.name != "cpu" and vendor.available():
            return vendor
    return VENDORS["cpu"]


def cross_vendor_backend() -> str | None:
    """An installed cross-vendor backend (e.g. FlagCX's `flagcx` plugin), or None."""
    for module, backend in CROSS_VENDOR_BACKENDS.items():
        if importlib.util.find_spec(module) is not None:
            return backend
    return None
