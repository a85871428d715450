"""Collective and point-to-point times over the link classes of a heterogeneous cluster.

Alpha-beta costs with nccl-tests conventions (shared/reference/collectives.md): a ring all-reduce of S bytes over
n ranks moves 2(n-1)/n*S per rank, reduce-scatter and all-gather (n-1)/n*S; bandwidths are bus bandwidths.
Hierarchical all-reduce (DESIGN.md): reduce-scatter inside the node, all-reduce of 1/r of the data across nodes
on each rail, all-gather inside. Latencies are estimates until `hetplan profile-comm` measures them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Literal

from specs.cluster import ClusterSpec, DeviceGroup

# "host": between processes of one machine (loopback), measured by local `hetplan profile-comm`: it stands for every
# link of its device's groups, as in a local run every rank is a process of this machine (CostContext's link lookup)
LinkClass = Literal["in_node", "rail", "cross_group", "host"]
Collective = Literal["all_reduce", "all_gather", "reduce_scatter"]

# nccl-tests: HDR 200 Gb/s NICs reach ~24 GB/s busbw of 25 GB/s, NDR 400 Gb/s 46-48 of 50 (collectives.md): RDMA.
NIC_EFFICIENCY = 0.92
IN_NODE_ALPHA_S = 5e-6
RAIL_ALPHA_S = 10e-6
CROSS_GROUP_ALPHA_S = 30e-6
# Collectives over TCP sockets (NCCL's socket transport, Gloo; clouds without RDMA): kernel copies and one stream per
# peer leave ~60% of the line rate, and every step pays a system-call round trip. Priors: calibration fits the scale
# (`transport:tcp`) where runs over TCP inform it.
TCP_NIC_EFFICIENCY = 0.6
TCP_ALPHA_S = 60e-6


@dataclass(frozen=True)
class Link:
    """Achievable bus bandwidth per rank and per-step latency of one link class.

    A fitted link (`hetplan fit --links`) may also say how the per-byte time grows with the group size
    (`slowdown_per_doubling`: +x per doubling of ranks beyond 2), carry its own point-to-point figures, and, measured
    between local processes, what each process per core beyond one adds to a step's latency and to the time per byte
    (`load_*`: the cores are shared, so a rank waits for a descheduled partner; `under_load`), and the share of an
    unloaded collective's time its ranks compute (`cpu_share`: reductions and copies on the cores they share), and
    how much longer per byte of bus volume an all-gather or a reduce-scatter takes than an all-reduce
    (`*_extra_s_per_byte`, negative when shorter: on a 2-core host Gloo reduce-scatters 4 MiB over two processes in
    6.4 ms, all-gathers it in 3.1 and all-reduces it in 4.0, 3.0, 1.5 and 0.9 ns per byte of bus volume).
    """

    link_class: LinkClass
    bw_bytes_per_s: float
    alpha_s: float
    slowdown_per_doubling: float = 0.0
    p2p_bw_bytes_per_s: float | None = None
    p2p_alpha_s: float | None = None
    load_alpha_s: float = 0.0
    load_s_per_byte: float = 0.0
    p2p_load_alpha_s: float = 0.0
    p2p_load_s_per_byte: float = 0.0
    cpu_share: float = 0.0  # measured between local processes: the share of a collective's time its ranks compute
    all_gather_extra_s_per_byte: float = 0.0
    reduce_scatter_extra_s_per_byte: float = 0.0

    def under_load(self, processes_per_core: float) -> Link:
        """The link while `processes_per_core` busy processes share each core of the host (at most one: itself)."""
        loads = (self.load_alpha_s, self.load_s_per_byte, self.p2p_load_alpha_s, self.p2p_load_s_per_byte)
        if processes_per_core <= 1.0 or not any(loads):
            return self
        return _under_load(self, processes_per_core)

    def seconds_per_byte(self, ranks: int, collective: Collective = "all_reduce") -> float:
        """Per byte of bus volume (nccl-tests' busbw) of `collective` over `ranks`."""
        doublings = max(0.0, math.log2(ranks / 2)) if ranks > 2 else 0.0
        extra = {"all_gather": self.all_gather_extra_s_per_byte, "reduce_scatter": self.reduce_scatter_extra_s_per_byte}
        return (1.0 + self.slowdown_per_doubling * doublings) * (1.0 / self.bw_bytes_per_s + extra.get(collective, 0.0))

    def p2p_time_s(self, size_bytes: float) -> float:
        alpha = self.alpha_s if self.p2p_alpha_s is None else self.p2p_alpha_s
        bw = self.bw_bytes_per_s if self.p2p_bw_bytes_per_s is None else self.p2p_bw_bytes_per_s
        return alpha + size_bytes / bw


@functools.lru_cache(maxsize=4096)
def _under_load(link: Link, processes_per_core: float) -> Link:
    """Link.under_load, made once per link and load (the cost model asks for it for every collective)."""
    excess = processes_per_core - 1.0
    p2p_alpha = link.alpha_s if link.p2p_alpha_s is None else link.p2p_alpha_s
    p2p_bw = link.bw_bytes_per_s if link.p2p_bw_bytes_per_s is None else link.p2p_bw_bytes_per_s
    return replace(
        link,
        alpha_s=link.alpha_s + excess * link.load_alpha_s,
        bw_bytes_per_s=1.0 / (1.0 / link.bw_bytes_per_s + excess * link.load_s_per_byte),
        p2p_alpha_s=p2p_alpha + excess * link.p2p_load_alpha_s,
        p2p_bw_bytes_per_s=1.0 / (1.0 / p2p_bw + excess * link.p2p_load_s_per_byte),
        load_alpha_s=0.0,
        load_s_per_byte=0.0,
        p2p_load_alpha_s=0.0,
        p2p_load_s_per_byte=0.0,
    )


def in_node_link(group: DeviceGroup) -> Link:
    device = group.device
    return Link("in_node", device.intra_node_bw_bytes_per_s * device.intra_node_efficiency, IN_NODE_ALPHA_S)


def rail_link(group: DeviceGroup) -> Link:
    """A device's share of its node's NICs (every device of the node sends at once: 8 ranks on one NIC get 1/8 each),
    at the efficiency and latency of the group's transport."""
    if group.transport == "tcp":
        return Link("rail", group.nic_bw_per_device_bytes_per_s * TCP_NIC_EFFICIENCY, TCP_ALPHA_S)
    return Link("rail", group.nic_bw_per_device_bytes_per_s * NIC_EFFICIENCY, RAIL_ALPHA_S)


def cross_group_link(cluster: ClusterSpec, a: DeviceGroup, b: DeviceGroup) -> Link:
    """The path between two groups: the configured inter-group rate, capped by either side's NIC share; TCP when
    either side's NICs run TCP."""
    bw = min(cluster.inter_group_bw_bytes_per_s, a.nic_bw_per_device_bytes_per_s, b.nic_bw_per_device_bytes_per_s)
    if "tcp" in (a.transport, b.transport):
        return Link("cross_group", bw * TCP_NIC_EFFICIENCY, max(CROSS_GROUP_ALPHA_S, TCP_ALPHA_S))
    return Link("cross_group", bw * NIC_EFFICIENCY, CROSS_GROUP_ALPHA_S)


def all_reduce_time_s(size_bytes: float, ranks: int, link: Link) -> float:
    if ranks <= 1 or size_bytes <= 0:
        return 0.0
    return 2 * (ranks - 1) / ranks * size_bytes * link.seconds_per_byte(ranks) + 2 * (ranks - 1) * link.alpha_s


def reduce_scatter_time_s(
    size_bytes: float, ranks: int, link: Link, collective: Collective = "reduce_scatter"
) -> float:
    """Reduce-scatter of a `size_bytes` array over `ranks` (or with `collective` all_gather, the all-gather of one:
    the same volume and steps)."""
    if ranks <= 1 or size_bytes <= 0:
        return 0.0
    return (ranks - 1) / ranks * size_bytes * link.seconds_per_byte(ranks, collective) + (ranks - 1) * link.alpha_s


def all_gather_time_s(size_bytes: float, ranks: int, link: Link) -> float:
    """All-gather of a `size_bytes` array over `ranks`."""
    return reduce_scatter_time_s(size_bytes, ranks, link, "all_gather")


def hierarchical_all_reduce_time_s(
    size_bytes: float, ranks_per_node: int, nodes: int, inner: Link, outer: Link
) -> float:
    """Two-level all-reduce; falls back to a flat ring over the slow link when that is faster."""
    if nodes <= 1:
        return all_reduce_time_s(size_bytes, ranks_per_node, inner)
    inside = reduce_scatter_time_s(size_bytes, ranks_per_node, inner) + all_gather_time_s(
        size_bytes, ranks_per_node, inner
    )
    two_level = inside + all_reduce_time_s(size_bytes / ranks_per_node, nodes, outer)
    flat = all_reduce_time_s(size_bytes, ranks_per_node * nodes, outer)
    return min(two_level, flat)


def hierarchical_reduce_scatter_time_s(
    size_bytes: float,
    ranks_per_node: int,
    nodes: int,
    inner: Link,
    outer: Link,
    collective: Collective = "reduce_scatter",
) -> float:
    """Reduce-scatter inside the node, then across nodes on each rail with 1/r of the data (the same for an
    all-gather, `collective`, in the other order)."""
    if nodes <= 1:
        return reduce_scatter_time_s(size_bytes, ranks_per_node, inner, collective)
    two_level = reduce_scatter_time_s(size_bytes, ranks_per_node, inner, collective) + reduce_scatter_time_s(
        size_bytes / ranks_per_node, nodes, outer, collective
    )
    return min(two_level, reduce_scatter_time_s(size_bytes, ranks_per_node * nodes, outer, collective))
