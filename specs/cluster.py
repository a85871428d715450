"""Cluster files: device groups (homogeneous nodes of one accelerator type) and the network between them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specs.device import DeviceSpec, get_device
from specs.errors import SpecError, expect_argument
from specs.loading import CLUSTER_FILE, StrictFloat, StrictInt, check_file_kind, read_mapping, validate
from specs.units import gbps_to_bytes_per_s

Topology = Literal["rail-optimized", "rail-only", "clos"]
Transport = Literal["rdma", "tcp"]

# Physical sanity limits of cluster files (well past any machine built or announced).
MAX_NODES = 1_000_000
MAX_DEVICES_PER_NODE = 4096
MAX_LINK_GBPS = 1e6  # 1 Pb/s
MAX_MEMORY_GB = 1e5
MAX_PEAK_TFLOPS = 1e6
# What a group of CPU devices gets when its file leaves the NIC out (its ranks talk over the host's loopback or one
# Ethernet port), and a cluster of one group or only CPU groups without a `network` section: written into the plan.
CPU_NICS_PER_NODE = 1
CPU_NIC_GBPS = 10.0
DEFAULT_TOPOLOGY: Topology = "clos"
Default = tuple[str, float | int | str]  # a field the file left out and the value assumed for it


class GroupSpec(BaseModel):
    """A set of identical nodes; overrides replace the catalog's figures for this group only. Bounds are physical
    sanity (a typo such as 1e12 devices per node is refused, not planned for minutes)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    device: str
    nodes: StrictInt = Field(ge=1, le=MAX_NODES)
    devices_per_node: StrictInt = Field(ge=1, le=MAX_DEVICES_PER_NODE)
    nics_per_node: StrictInt | None = Field(default=None, ge=1, le=MAX_DEVICES_PER_NODE)  # cpu groups: 1
    nic_gbps: StrictFloat | None = Field(
        default=None, gt=0, le=MAX_LINK_GBPS, description="line rate of one NIC, Gb/s (cpu groups: 10)"
    )
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
    network: NetworkSpec | None = None  # optional for one group or only cpu groups

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
    # < 1: the share of a core each rank gets, a local run's ranks outnumbering the cores (sharing_cores); already in
    # emulate_speed, kept apart to say why a group computes slower than its profile
    core_share: float = field(default=1.0, compare=False)
    # the cluster file's number of each node, in order, where nodes were removed or added since (`hetplan replan`:
    # without node 17 of 78, nodes 0..16, 18..77); empty: 0..nodes-1. Where a launch runs, not what a plan costs.
    node_ids: tuple[int, ...] = field(default=(), compare=False)

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def node_number(self, index: int) -> int:
        """The cluster file's number of the group's `index`-th node."""
        return self.node_ids[index] if self.node_ids else index

    @property
    def node_numbers(self) -> list[int]:
        return list(self.node_ids) if self.node_ids else list(range(self.nodes))

    @property
    def nic_bw_per_device_bytes_per_s(self) -> float:
        """Scale-out bandwidth one device gets when all devices of a node send at once (its rail share)."""
        return self.nics_per_node * self.nic_bw_bytes_per_s / self.devices_per_node

    def with_nodes(self, nodes: int) -> DeviceGroup:
        return replace(self, nodes=nodes, node_ids=())

    def with_node_numbers(self, numbers: list[int]) -> DeviceGroup:
        """The group of these nodes (the cluster file's numbers, in order)."""
        renumbered = numbers != list(range(len(numbers)))
        return replace(self, nodes=len(numbers), node_ids=tuple(numbers) if renumbered else ())


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    groups: tuple[DeviceGroup, ...]
    topology: Topology
    inter_group_bw_bytes_per_s: float
    source: str = ""
    # fields the file left out and the values assumed for them ("groups[0].nic_gbps", 10.0): the plan records them
    defaults: tuple[Default, ...] = ()

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
            replace(g, emulate_speed=g.emulate_speed * share, core_share=g.core_share * share)
            if g.device.key == "cpu"
            else g
            for g in self.groups
        )
        return replace(self, groups=groups)

    def trains_in(self, dtype: str) -> tuple[DeviceGroup, ...]:
        """The groups whose devices can train in `dtype` (bf16, and FP8 where it runs bf16, need bf16: not V100s)."""
        return tuple(group for group in self.groups if not group.device.lacks_dtype(dtype))

    def only(self, group: DeviceGroup) -> ClusterSpec:
        """The cluster restricted to one group (for homogeneous baselines)."""
        return ClusterSpec(
            self.name, (group,), self.topology, self.inter_group_bw_bytes_per_s, self.source, self.defaults
        )


def _nic(group: GroupSpec, device: DeviceSpec, index: int, source: str, defaults: list[Default]) -> tuple[int, float]:
    """The group's NICs (count, Gb/s): as written, else CPU_NICS_PER_NODE x CPU_NIC_GBPS for a cpu group (noted in
    `defaults`); an accelerator group must say (its NICs decide every cross-node transfer)."""
    chosen = []
    for name, value, fallback in (
        ("nics_per_node", group.nics_per_node, CPU_NICS_PER_NODE),
        ("nic_gbps", group.nic_gbps, CPU_NIC_GBPS),
    ):
        if value is None:
            if device.vendor != "cpu":
                raise SpecError(
                    source,
                    f"groups[{index}].{name}",
                    f"required for {device.key} devices (only cpu groups default to {CPU_NICS_PER_NODE} NIC of "
                    f"{CPU_NIC_GBPS:g} Gb/s)",
                )
            value = fallback
            defaults.append((f"groups[{index}].{name}", fallback))
        chosen.append(value)
    return int(chosen[0]), float(chosen[1])


def _network(spec: ClusterFile, groups: list[DeviceGroup], source: str, defaults: list[Default]) -> NetworkSpec:
    """The network as written, else (one group, or only cpu groups) a Clos at the slowest group's NIC rate."""
    if spec.network is not None:
        return spec.network
    if len(groups) > 1 and any(g.device.vendor != "cpu" for g in groups):
        raise SpecError(
            source,
            "network",
            "required for a cluster of several groups with accelerators: give topology and inter_group_gbps "
            "(only a one-group or cpu-only cluster may leave it out)",
        )
    gbps = min(g.nic_bw_bytes_per_s for g in groups) / gbps_to_bytes_per_s(1.0)
    defaults.extend([("network.topology", DEFAULT_TOPOLOGY), ("network.inter_group_gbps", gbps)])
    return NetworkSpec(topology=DEFAULT_TOPOLOGY, inter_group_gbps=gbps)


def resolve_cluster(spec: ClusterFile, source: str) -> ClusterSpec:
    groups = []
    defaults: list[Default] = []
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
        nics_per_node, nic_gbps = _nic(group, device, index, source, defaults)
        groups.append(
            DeviceGroup(
                name=group.name,
                device=device,
                nodes=group.nodes,
                devices_per_node=group.devices_per_node,
                nics_per_node=nics_per_node,
                nic_bw_bytes_per_s=gbps_to_bytes_per_s(nic_gbps),
                emulate_speed=group.emulate_speed or 1.0,
                transport=group.transport,
            )
        )
    network = _network(spec, groups, source, defaults)
    return ClusterSpec(
        name=spec.name,
        groups=tuple(groups),
        topology=network.topology,
        inter_group_bw_bytes_per_s=gbps_to_bytes_per_s(network.inter_group_gbps),
        source=source,
        defaults=tuple(defaults),
    )


def load_cluster(path: str | Path | Mapping[str, Any]) -> ClusterSpec:
    """Read and validate a cluster YAML/JSON file, or the mapping such a file holds (a launcher's own dict)."""
    if isinstance(path, Mapping):
        data, source = dict(path), "cluster mapping"
    else:
        taken = "a path of a cluster YAML/JSON file, or its mapping"
        expect_argument(path, (str, Path), "load_cluster()", "path", taken)
        data, source = read_mapping(Path(path)), str(path)
    check_file_kind(data, source, f"{CLUSTER_FILE} (name, groups, network)", (CLUSTER_FILE,))
    return resolve_cluster(validate(ClusterFile, data, source), source)
