"""Cluster files: device groups (homogeneous nodes of one accelerator type) and the network between them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specs.device import DeviceSpec, get_device
from specs.errors import SpecError
from specs.loading import StrictFloat, StrictInt, read_mapping, validate
from specs.units import gbps_to_bytes_per_s

Topology = Literal["rail-optimized", "rail-only", "clos"]
Transport = Literal["rdma", "tcp"]

# Physical sanity limits of cluster files (well past any machine built or announced).
MAX_NODES = 1_000_000
MAX_DEVICES_PER_NODE = 4096
MAX_LINK_GBPS = 1e6  # 1 Pb/s
MAX_MEMORY_GB = 1e5
MAX_PEAK_TFLOPS = 1e6


class GroupSpec(BaseModel):
    """A set of identical nodes; overrides replace the catalog's figures for this group only. Bounds are physical
    sanity (a typo such as 1e12 devices per node is refused, not planned for minutes)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    device: str
    nodes: StrictInt = Field(ge=1, le=MAX_NODES)
    devices_per_node: StrictInt = Field(ge=1, le=MAX_DEVICES_PER_NODE)
    nics_per_node: StrictInt = Field(ge=1, le=MAX_DEVICES_PER_NODE)
    nic_gbps: StrictFloat = Field(gt=0, le=MAX_LINK_GBPS, description="line rate of one NIC, Gb/s")
    intra_node_GBps: StrictFloat | None = Field(default=None, gt=0, le=MAX_LINK_GBPS / 8)
    memory_GB: StrictFloat | None = Field(default=None, gt=0, le=MAX_MEMORY_GB)
    peak_tflops: StrictFloat | None = Field(default=None, gt=0, le=MAX_PEAK_TFLOPS)
    transport: Transport = Field(
        default="rdma",
        description="how the NICs carry collectives: rdma (InfiniBand, RoCE, Slingshot, EFA) or tcp (sockets over "
        "Ethernet, e.g. cloud instances without RDMA); each has its own efficiency and latency",
    )
    clock_fraction: StrictFloat = Field(
        default=1.0,
        gt=0,
        le=1,
        description="sustained clock / datasheet clock (power-capped or thermally limited devices): scales the peaks",
    )
    emulate_speed: StrictFloat | None = Field(
        default=None,
        gt=0,
        le=1,
        description="cpu groups only: run (and predict) this group's compute at this fraction of the host's speed",
    )


class NetworkSpec(BaseModel):
    """The scale-out network. `inter_group_gbps` is one device's path to a device of another group, Gb/s."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    topology: Topology = "rail-optimized"
    inter_group_gbps: StrictFloat = Field(gt=0, le=MAX_LINK_GBPS)


class ClusterFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    groups: list[GroupSpec] = Field(min_length=1)
    network: NetworkSpec

    @field_validator("groups")
    @classmethod
    def _unique_group_names(cls, groups: list[GroupSpec]) -> list[GroupSpec]:
        seen: set[str] = set()
        for group in groups:
            if group.name in seen:
                raise ValueError(f"group name {group.name!r} is used twice; names must be unique")
            seen.add(group.name)
        return groups


@dataclass(frozen=True)
class DeviceGroup:
    """A cluster group with its catalog device resolved and overrides applied."""

    name: str
    device: DeviceSpec
    nodes: int
    devices_per_node: int
    nics_per_node: int
    nic_bw_bytes_per_s: float
    emulate_speed: float = 1.0  # < 1: a CPU group emulating a slower device type (compute really repeated)
    transport: Transport = "rdma"

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def nic_bw_per_device_bytes_per_s(self) -> float:
        """Scale-out bandwidth one device gets when all devices of a node send at once (its rail share)."""
        return self.nics_per_node * self.nic_bw_bytes_per_s / self.devices_per_node

    def with_nodes(self, nodes: int) -> DeviceGroup:
        return replace(self, nodes=nodes)


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    groups: tuple[DeviceGroup, ...]
    topology: Topology
    inter_group_bw_bytes_per_s: float
    source: str = ""

    @property
    def num_devices(self) -> int:
        return sum(group.num_devices for group in self.groups)

    def group(self, name: str) -> DeviceGroup:
        for group in self.groups:
            if group.name == name:
                return group
        raise SpecError(self.source or "cluster", "group", f"no group named {name!r} in cluster {self.name!r}")

    def sharing_cores(self, share: float) -> ClusterSpec:
        """The cluster as a local run sees it when its ranks outnumber the cores: each CPU rank computes at `share`
        of a core (the profiles are taken with one thread per process, as the ranks run)."""
        if share >= 1.0:
            return self
        groups = tuple(
            replace(g, emulate_speed=g.emulate_speed * share) if g.device.key == "cpu" else g for g in self.groups
        )
        return replace(self, groups=groups)

    def only(self, group: DeviceGroup) -> ClusterSpec:
        """The cluster restricted to one group (for homogeneous baselines)."""
        return ClusterSpec(self.name, (group,), self.topology, self.inter_group_bw_bytes_per_s, self.source)


def resolve_cluster(spec: ClusterFile, source: str) -> ClusterSpec:
    groups = []
    for index, group in enumerate(spec.groups):
        device = get_device(group.device, source, f"groups[{index}].device")
        overrides = {
            field: getattr(group, field)
            for field in ("intra_node_GBps", "memory_GB", "peak_tflops")
            if getattr(group, field) is not None
        }
        if overrides:
            device = device.model_copy(update=overrides)
        device = device.at_clock(group.clock_fraction)
        if group.emulate_speed is not None and device.key != "cpu":
            raise SpecError(
                source,
                f"groups[{index}].emulate_speed",
                f"speed emulation is for cpu groups (this one is {device.key}): a real device runs at its own speed",
            )
        groups.append(
            DeviceGroup(
                name=group.name,
                device=device,
                nodes=group.nodes,
                devices_per_node=group.devices_per_node,
                nics_per_node=group.nics_per_node,
                nic_bw_bytes_per_s=gbps_to_bytes_per_s(group.nic_gbps),
                emulate_speed=group.emulate_speed or 1.0,
                transport=group.transport,
            )
        )
    return ClusterSpec(
        name=spec.name,
        groups=tuple(groups),
        topology=spec.network.topology,
        inter_group_bw_bytes_per_s=gbps_to_bytes_per_s(spec.network.inter_group_gbps),
        source=source,
    )


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster YAML/JSON file."""
    path = Path(path)
    data = read_mapping(path)
    return resolve_cluster(validate(ClusterFile, data, str(path)), str(path))
