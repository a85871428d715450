"""The shared vocabulary: cluster, model and training specs, the device/model catalogs, vendor and engine registries."""

from specs.cluster import ClusterSpec, DeviceGroup, load_cluster
from specs.device import DeviceSpec, device_catalog, get_device
from specs.engines import Engine, engine_catalog, get_engine
from specs.errors import DoesNotFitError, HetplanError, SpecError, TorchMissingError
from specs.model import RECOMPUTE_MODES, ModelSpec, Recompute, load_model, model_catalog
from specs.training import TrainingSpec, load_training
from specs.vendors import VendorInfo, get_vendor, vendor_catalog

__all__ = [
    "RECOMPUTE_MODES",
    "ClusterSpec",
    "DeviceGroup",
    "DeviceSpec",
    "DoesNotFitError",
    "Engine",
    "HetplanError",
    "ModelSpec",
    "Recompute",
    "SpecError",
    "TorchMissingError",
    "TrainingSpec",
    "VendorInfo",
    "device_catalog",
    "engine_catalog",
    "get_device",
    "get_engine",
    "get_vendor",
    "load_cluster",
    "load_model",
    "load_training",
    "model_catalog",
    "vendor_catalog",
]
