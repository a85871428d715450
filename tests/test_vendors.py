"""The vendor registry (specs/catalog/vendors.yaml): every catalog device resolves to one vendor, unknown names fail in
one line, and devices, exports and the communicator take their vendor facts from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specs import SpecError, device_catalog, get_vendor, vendor_catalog
from specs.catalog import CATALOG_DIR, read_catalog
from specs.device import DeviceSpec


def _devices_file(tmp_path: Path, **changes: object) -> Path:
    """The shipped device catalog with the h100 entry changed."""
    entries = yaml.safe_load((CATALOG_DIR / "devices.yaml").read_text(encoding="utf-8"))
    entries["h100"].update(changes)
    path = tmp_path / "devices.yaml"
    path.write_text(yaml.safe_dump(entries, sort_keys=False), encoding="utf-8")
    return path


def test_every_catalog_device_resolves_to_exactly_one_vendor_and_speaks_its_library():
    vendors = vendor_catalog()
    for device in device_catalog().values():
        owners = [v.key for v in vendors.values() if device.vendor in (v.key, *v.aliases)]
        assert len(owners) == 1, (device.key, device.vendor, owners)
        assert get_vendor(device.vendor).key == owners[0]
        assert device.collective_library == vendors[owners[0]].collective_library


def test_the_catalogs_old_vendor_names_map_to_the_islands_comm_uses():
    assert get_vendor("huawei").key == "ascend" and get_vendor("HUAWEI ").key == "ascend"
    assert get_vendor("intel-habana").key == "habana"
    assert get_vendor("amd").visible_devices_env == "HIP_VISIBLE_DEVICES"
    assert get_vendor("huawei").visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert get_vendor("cpu").visible_devices_env is None
    assert [v.key for v in vendor_catalog().values()][-1] == "cpu"  # detection tries the cpu last


def test_an_unknown_vendor_is_one_line_naming_it_and_the_known_ones():
    with pytest.raises(SpecError) as err:
        get_vendor("acme", "cluster.yaml", "group g")
    message = str(err.value)
    assert "\n" not in message and message.startswith("cluster.yaml: group g: unknown vendor 'acme'")
    assert all(key in message for key in vendor_catalog())


def test_a_catalog_device_of_an_unknown_vendor_names_file_field_and_known_vendors(tmp_path):
    path = _devices_file(tmp_path, vendor="acme")
    with pytest.raises(SpecError) as err:
        read_catalog(path, DeviceSpec, "device")
    message = str(err.value)
    assert message.startswith(f"{path}: h100.vendor: unknown vendor 'acme'; expected one of: nvidia, amd")
    assert "\n" not in message


def test_a_device_library_that_contradicts_its_vendor_is_refused(tmp_path):
    with pytest.raises(SpecError, match=r"h100\.collective_library: nvidia devices use 'nccl'.*got 'rccl'"):
        read_catalog(_devices_file(tmp_path, collective_library="rccl"), DeviceSpec, "device")
    agreeing = read_catalog(_devices_file(tmp_path, collective_library="nccl"), DeviceSpec, "device")
    assert agreeing.entries["h100"] == device_catalog()["h100"]


def test_a_device_round_trips_through_its_dump():
    for device in device_catalog().values():
        assert DeviceSpec.model_validate(device.model_dump()) == device


def test_the_registries_import_without_torch():
    code = "import sys, specs, specs.vendors, specs.engines, planner.export; assert 'torch' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
