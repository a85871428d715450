"""Accelerator specs and the shipped device catalog (specs/catalog/devices.yaml)."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from specs.catalog import Catalog, load_catalog
from specs.errors import SpecError
from specs.loading import CheckedModel
from specs.units import GIB, GIGA, TERA
from specs.vendors import find_vendor, vendor_catalog


class DeviceSpec(CheckedModel):
    """One accelerator type. File fields carry vendor units; the *_bytes/_per_s properties are SI."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str
    aliases: tuple[str, ...] = ()
    name: str
    vendor: str
    generation: str = Field(min_length=1)
    peak_tflops: float = Field(gt=0)
    peak_fp32_tflops: float | None = Field(default=None, gt=0)
    peak_tf32_tflops: float | None = Field(default=None, gt=0)
    peak_fp8_tflops: float | None = Field(default=None, gt=0)
    supports_bf16: bool = True
    memory_GB: float = Field(gt=0)
    hbm_TBps: float = Field(gt=0)
    intra_node_GBps: float = Field(gt=0)
    collective_library: str  # the vendor's (specs/catalog/vendors.yaml); filled in when not given
    gemm_efficiency: float = Field(gt=0, le=1)
    gemm_ramp_us: float = Field(gt=0)
    gemm_tile: float = Field(gt=0)
    intra_node_efficiency: float = Field(gt=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _vendor_library(cls, data: Any) -> Any:
        """A device speaks its vendor's collective library: the catalog says it once, in vendors.yaml."""
        if isinstance(data, dict) and "collective_library" not in data and isinstance(data.get("vendor"), str):
            vendor = find_vendor(data["vendor"])
            if vendor is not None:
                data = {**data, "collective_library": vendor.collective_library}
        return data

    @field_validator("vendor")
    @classmethod
    def _known_vendor(cls, vendor: str) -> str:
        if find_vendor(vendor) is None:
            raise ValueError(f"unknown vendor {vendor!r}; expected one of: {', '.join(vendor_catalog())}")
        return vendor

    @field_validator("collective_library")
    @classmethod
    def _library_of_vendor(cls, library: str, info: ValidationInfo) -> str:
        vendor = find_vendor(info.data.get("vendor", ""))
        if vendor is not None and library != vendor.collective_library:
            raise ValueError(f"{vendor.key} devices use {vendor.collective_library!r} (vendors.yaml), got {library!r}")
        return library

    @property
    def peak_flops_per_s(self) -> float:
        """Dense 16-bit peak, FLOP/s."""
        return self.peak_tflops * TERA

    @property
    def memory_bytes(self) -> float:
        return self.memory_GB * GIB

    @property
    def hbm_bw_bytes_per_s(self) -> float:
        return self.hbm_TBps * TERA

    @property
    def intra_node_bw_bytes_per_s(self) -> float:
        return self.intra_node_GBps * GIGA

    def runs_dtype(self, dtype: str) -> str:
        """The precision this device's GEMMs run in for a training dtype: fp8 training runs bf16 on a device
        without FP8 (an old family in a mixed plan)."""
        return "bf16" if dtype == "fp8" and self.peak_fp8_tflops is None else dtype

    def lacks_dtype(self, dtype: str) -> str:
        """Why this device cannot train in `dtype` ("v100 has no bf16 (nor FP8)"), or "" when it can. fp32 on a
        device whose fp32 peak is not published: it may run, but nothing can time it."""
        if dtype == "fp32" and self.peak_fp32_tflops is None:  # (a TF32 peak times fp32 only under fp32_matmul tf32)
            return f"{self.key} has no published fp32 peak"
        if self.runs_dtype(dtype) != "bf16" or self.supports_bf16:
            return ""
        return f"{self.key} has no bf16{' (nor FP8)' if dtype == 'fp8' else ''}"

    def trains_dtypes(self, instead_of: str) -> list[str]:
        """The dtypes this device trains in other than `instead_of`, the fastest first (bf16, fp16, fp32)."""
        return [dtype for dtype in ("bf16", "fp16", "fp32") if dtype != instead_of and not self.lacks_dtype(dtype)]

    def peak_flops_for_dtype(self, dtype: str, fp32_matmul: str = "ieee") -> float:
        """Peak matmul FLOP/s for the training dtype. fp32: the TF32/XF32 peak when the training allows it
        (`fp32_matmul: tf32`) and the device has one, else the IEEE fp32 peak, which must be published. fp8: the FP8
        peak where the device has one, else its 16-bit peak."""
        if dtype == "fp8" and self.peak_fp8_tflops is not None:
            return self.peak_fp8_tflops * TERA
        if dtype == "fp32":
            if fp32_matmul == "tf32" and self.peak_tf32_tflops is not None:
                return self.peak_tf32_tflops * TERA
            if self.peak_fp32_tflops is None:
                raise SpecError(
                    "device catalog",
                    f"{self.key}.peak_fp32_tflops",
                    "no fp32 peak is known, so fp32 training cannot be timed on it: choose bf16 or fp16 (--dtype, or "
                    "the training file's dtype)",
                )
            return self.peak_fp32_tflops * TERA
        return self.peak_flops_per_s

    def at_clock(self, fraction: float) -> DeviceSpec:
        """The device running at `fraction` of its datasheet clock (power caps, thermal limits): every peak scales,
        memory bandwidth does not."""
        if fraction == 1.0:
            return self
        scaled = {
            name: getattr(self, name) * fraction
            for name in ("peak_tflops", "peak_fp32_tflops", "peak_tf32_tflops", "peak_fp8_tflops")
            if getattr(self, name) is not None
        }
        return self.model_copy(update=scaled)


def _devices() -> Catalog[DeviceSpec]:
    return load_catalog("devices.yaml", DeviceSpec, "device")


def device_catalog() -> dict[str, DeviceSpec]:
    """All catalog devices by key."""
    return _devices().entries


def get_device(name: str, source: str = "get_device()", field: str = "name") -> DeviceSpec:
    """Look a device up by key or alias (case-insensitive)."""
    return _devices().get(name, source, field)
