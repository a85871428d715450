"""The shared vocabulary: cluster, model and training specs and the device/model catalogs."""

from specs.cluster import ClusterSpec, DeviceGroup, load_cluster
from specs.device import DeviceSpec, device_catalog, get_device
from specs.errors import DoesNotFitError, HetplanError, SpecError, TorchMissingError
from specs.model import RECOMPUTE_MODES, ModelSpec, Recompute, load_model, model_catalog
from specs.training import TrainingSpec, load_training

__all__ = [
    "RECOMPUTE_MODES",
    "ClusterSpec",
    "DeviceGroup",
    "DeviceSpec",
    "DoesNotFitError",
    "HetplanError",
    "ModelSpec",
    "Recompute",
    "SpecError",
    "TorchMissingError",
    "TrainingSpec",
    "device_catalog",
    "get_device",
    "load_cluster",
    "load_model",
    "load_training",
    "model_catalog",
]
