"""The cost model's inputs: the specs, the layer-cost source of every group, fitted links and the end-to-end terms
calibration learns. Links carry the transport's efficiency and the calibrated network scales."""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from predictor.comm_model import Link, cross_group_link, in_node_link, rail_link
from predictor.context_parallel import ContextParallelCosts
from profiler.profile import DeviceProfile, HostCosts, LayerCostSource, ScaledLayerCosts
from profiler.simulated import SimulatedDevice
from specs.cluster import ClusterSpec, DeviceGroup
from specs.errors import SpecError, expect_argument
from specs.layout import Strategy, check_strategy
from specs.model import ModelSpec
from specs.training import TrainingSpec, splits_for_context_parallel


@functools.lru_cache(maxsize=256)
def _measured(
    link: Link,
    alpha_s: float,
    bw_bytes_per_s: float,
    load_alpha_s: float | None = None,
    load_s_per_byte: float | None = None,
) -> Link:
    """`link` with a measured latency and bandwidth, and load terms where measured too (made once: the cost model
    asks for it for every collective)."""
    measured = replace(link, alpha_s=alpha_s, bw_bytes_per_s=bw_bytes_per_s)
    if load_alpha_s is None or load_s_per_byte is None:
        return measured
    return replace(measured, load_alpha_s=load_alpha_s, load_s_per_byte=load_s_per_byte)


@dataclass(frozen=True)
class EndToEndTerms:
    """Whole-iteration effects per-layer profiles cannot see; `hetplan fit --runs` learns them from measured runs.

    The scales multiply the modelled times of TP collectives, transfers over a device generation's in-node fabric
    (NVLink, xGMI, HCCS: `in_node_scale`, on top of `tp_comm_scale` for TP), network transfers (p2p and DP sync;
    `tcp_scale` again on links whose NICs run TCP rather than RDMA) and the optimizer step; `dp_overlap` is the
    fraction of a micro-batch's backward (forward, for weight gathers) that the overlapped DP traffic hides behind
    (1: all of it, as the engines' bucketed overlap aims for); `iteration_overhead_s` is a fixed cost per
    iteration (launch, data, logging).
    """

    tp_comm_scale: float = 1.0
    in_node_scale: tuple[tuple[str, float], ...] = ()  # (generation, scale of its in-node fabric's time)
    network_scale: float = 1.0
    tcp_scale: float = 1.0
    optimizer_scale: float = 1.0
    dp_overlap: float = 1.0
    iteration_overhead_s: float = 0.0


@dataclass(frozen=True)
class CostContext:
    """Everything the cost model needs besides the strategy."""

    cluster: ClusterSpec
    model: ModelSpec
    training: TrainingSpec
    sources: Mapping[str, LayerCostSource]  # by group name
    terms: EndToEndTerms = EndToEndTerms()
    links: Mapping[str, Link] = field(default_factory=dict)  # fitted, by "device key/link class"; else datasheet
    identity: str = ""  # the predictor's, when one made this context
    # where the costs come from, as a plan records it (Predictor.cost_source): the predictor and the profile files
    cost_source: Mapping[str, Any] | None = None
    # the context-parallel degree the costs are for (evaluate takes it from the strategy, the search per degree)
    context_parallel: int = 1
    _cp_sources: dict[str, LayerCostSource] = field(default_factory=dict, init=False, repr=False, compare=False)
    # measured host costs by device key (profiles' `host` sections): their groups are processes of one host, local
    # runs that share its cores (predictor/host.py); a context made for one strategy records how they share them
    host: Mapping[str, HostCosts] = field(default_factory=dict)
    processes_per_core: float = 0.0  # busy processes per core of the host (0: not evaluated as a local run)
    compute_stretch: float = 1.0  # what sharing the cores does to compute (HostCosts.stretch)
    # contexts made from this one for a number of busy processes (predictor.host.on_host); fresh on every replace
    loaded: dict[tuple[float, float], CostContext] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def seq_length(self) -> int:
        return self.training.seq_length or self.model.seq_length

    def source(self, group: str | DeviceGroup) -> LayerCostSource:
        """The group's layer costs per rank: under context parallelism, per CP rank with the ring's exposed
        transfers (predictor.context_parallel). Given the group itself, it need not be in this context's cluster
        (the planner's row tables serve subsets of the groups with one context)."""
        name = group if isinstance(group, str) else group.name
        if self.context_parallel == 1:
            return self.sources[name]
        found = self._cp_sources.get(name)
        if found is None:
            device_group = self.cluster.group(name) if isinstance(group, str) else group
            found = self._cp_sources[name] = ContextParallelCosts(self, device_group, self.sources[name])
        return found

    def at_context_parallel(self, degree: int) -> CostContext:
        """This context for plans whose families split sequences over `degree` ranks."""
        return self if degree == self.context_parallel else replace(self, context_parallel=degree)

    def gradient_ranks(self, replicas: int) -> int:
        """Ranks a stage's gradients are reduced (and ZeRO-sharded) over: its replicas and their CP ranks."""
        return replicas * self.context_parallel

    @property
    def predictor_identity(self) -> str:
        names = sorted({source.identity for source in self.sources.values()})
        base = "analytic cost model over " + "; ".join(names)
        return f"{self.identity}: {base}" if self.identity else base

    def check_strategy(self, strategy: Strategy, source: str = "strategy") -> None:
        """The layout's structural checks against this context's cluster, model and global batch, and a sequence
        that splits into the 2 * cp chunks of causal load balancing."""
        check_strategy(strategy, self.cluster, self.model, self.training.global_batch_size, source)
        check_dtype(self.cluster, self.training, {stage.group for p in strategy.pipelines for stage in p.stages})
        cp = strategy.context_parallel
        if not splits_for_context_parallel(self.seq_length, cp):
            raise SpecError(
                source,
                "pipelines.context_parallel",
                f"sequences of {self.seq_length} tokens do not split into 2 x {cp} equal chunks (causal load balance)",
            )

    def fitted_link(self, key: str, link_class: str) -> Link | None:
        """A fitted link of a device and class, else its `host` link (measured between this machine's processes:
        every link of a local run), under the context's load of processes per core."""
        link = self.links.get(f"{key}/{link_class}") or self.links.get(f"{key}/host")
        return link.under_load(self.processes_per_core) if link is not None else None

    def in_node_link(self, group: DeviceGroup) -> Link:
        link = self.fitted_link(group.device.key, "in_node") or in_node_link(group)
        scale = dict(self.terms.in_node_scale).get(group.device.generation, 1.0)
        return link if scale == 1.0 else _slower(link, scale)

    def tp_link(self, group: DeviceGroup) -> Link:
        """The link a group's TP collectives run over: inside the node, or, on a host whose profile timed TP
        all-reduces between layers (HostCosts.tp_all_reduce_*), those measured latency and bandwidth under the
        context's load of processes per core (by the load terms timed with them, else the host link's)."""
        host = self.host.get(group.device.key)
        if host is None or host.tp_all_reduce_alpha_s is None or host.tp_all_reduce_bw_bytes_per_s is None:
            return self.in_node_link(group)
        link = self.links.get(f"{group.device.key}/host") or in_node_link(group)
        measured = _measured(
            link,
            host.tp_all_reduce_alpha_s,
            host.tp_all_reduce_bw_bytes_per_s,
            host.tp_all_reduce_load_alpha_s,
            host.tp_all_reduce_load_s_per_byte,
        )
        return measured.under_load(self.processes_per_core)

    def rail_link(self, group: DeviceGroup) -> Link:
        link = self.fitted_link(group.device.key, "rail") or rail_link(group)
        return self._over_nics(link, group.transport == "tcp")

    def cross_group_link(self, a: DeviceGroup, b: DeviceGroup) -> Link:
        fitted = self.links.get(f"{a.device.key}/cross_group") or self.links.get(f"{b.device.key}/cross_group")
        if fitted is not None:
            fitted = fitted.under_load(self.processes_per_core)
        elif a.device.key == b.device.key:
            fitted = self.fitted_link(a.device.key, "cross_group")
        link = fitted or cross_group_link(self.cluster, a, b)
        return self._over_nics(link, "tcp" in (a.transport, b.transport))

    def _over_nics(self, link: Link, tcp: bool) -> Link:
        """A link through the NICs with the calibrated TCP scale applied to its bandwidth when it runs over TCP."""
        if not tcp or self.terms.tcp_scale == 1.0:
            return link
        return replace(
            link,
            bw_bytes_per_s=link.bw_bytes_per_s / self.terms.tcp_scale,
            p2p_bw_bytes_per_s=None
            if link.p2p_bw_bytes_per_s is None
            else link.p2p_bw_bytes_per_s / self.terms.tcp_scale,
        )


@functools.lru_cache(maxsize=1024)
def _slower(link: Link, scale: float) -> Link:
    """The link with its bandwidth divided by a calibrated scale (made once: asked for by every collective)."""
    return replace(link, bw_bytes_per_s=link.bw_bytes_per_s / scale)


def emulated(group: DeviceGroup, source: LayerCostSource) -> LayerCostSource:
    """A CPU group emulating a slower device (`emulate_speed` < 1), or whose ranks share the cores (`core_share` < 1,
    within emulate_speed), computes 1/speed times as long."""
    if group.emulate_speed == 1.0:
        return source
    own_speed = group.emulate_speed / group.core_share
    why = [f"emulated at {own_speed:g} speed"] if own_speed != 1.0 else []
    if group.core_share < 1.0:
        why.append(f"{group.core_share:.2f} of a core per rank")
    return ScaledLayerCosts(source, 1.0 / group.emulate_speed, ", ".join(why))


def check_dtype(cluster: ClusterSpec, training: TrainingSpec, groups: Collection[str] | None = None) -> None:
    """The training's dtype on every group of `groups` (default: the cluster's): a device without bf16 cannot run
    bf16 (nor FP8, which falls back to bf16 where a device lacks it), nor fp32 one without a published fp32 peak. A
    plan on other groups of the cluster can. The error names a dtype the checked groups all train in, where one does."""
    checked = [group for group in cluster.groups if groups is None or group.name in groups]
    for group in checked:
        lacks = group.device.lacks_dtype(training.dtype)
        if lacks:
            others = group.device.trains_dtypes(training.dtype)
            common = [d for d in others if not any(g.device.lacks_dtype(d) for g in checked)]
            other = (common or others)[0]
            raise SpecError(
                cluster.source or "cluster", f"group {group.name}", f"{lacks}: train in {other} (--dtype {other})"
            )


def build_context(
    cluster: ClusterSpec,
    model: ModelSpec,
    training: TrainingSpec,
    profiles: Mapping[str, DeviceProfile] | None = None,
    noise: float = 0.0,
    seed: int = 0,
) -> CostContext:
    """Use a measured profile for each device type that has one (by device key), simulated ones elsewhere."""
    expect_argument(cluster, ClusterSpec, "build_context()", "cluster", "a ClusterSpec: specs.load_cluster(path)")
    expect_argument(model, ModelSpec, "build_context()", "model", "a ModelSpec: specs.load_model(name or path)")
    taken = "a TrainingSpec: specs.load_training(path or None, overrides)"
    expect_argument(training, TrainingSpec, "build_context()", "training", taken)
    seq_length = training.seq_length or model.seq_length
    if model.learned_positions and seq_length > model.seq_length:  # the run would fail at its first step
        raise SpecError(
            "training",
            "seq_length",
            f"expected at most {model.seq_length} tokens (--seq-len, or the training file's seq_length): "
            f"{model.name} learns one position embedding for each of its {model.seq_length} positions, got "
            f"{seq_length}",
        )
    sources: dict[str, LayerCostSource] = {}
    host: dict[str, HostCosts] = {}
    links: dict[str, Link] = {}
    for group in cluster.groups:
        profile = (profiles or {}).get(group.device.key)
        if group.device.lacks_dtype(training.dtype):  # it can take no stage (check_dtype): its profile says nothing
            profile = None
        if profile is not None:
            if profile.seq_length != seq_length:
                raise SpecError(
                    profile.path, "seq_length", f"profiled at {profile.seq_length}, training uses {seq_length}"
                )
            runs = group.device.runs_dtype(training.dtype)
            if profile.dtype != runs:
                raise SpecError(profile.path, "dtype", f"profiled in {profile.dtype}, training runs {runs} there")
            sources[group.name] = emulated(group, profile)
            if profile.host is not None:
                host[group.device.key] = profile.host
            links.update(profile_links(profile))
        else:
            simulated = SimulatedDevice(
                group.device,
                model,
                seq_length,
                group.device.runs_dtype(training.dtype),
                noise=noise,
                seed=seed,
                sequence_parallel=training.sequence_parallel,
                flash_attention=training.attention == "flash",
                fp32_matmul=training.fp32_matmul,
            )
            sources[group.name] = emulated(group, simulated)
    return CostContext(cluster, model, training, sources, links=links, host=host)


def profile_links(profile: DeviceProfile) -> dict[str, Link]:
    """The links fitted from the link profiles found beside a device profile, by "device key/link class"."""
    if not profile.link_files:
        return {}
    from predictor.link_model import fit_link, link_points  # scikit-learn: only when there are links to fit

    links = {}
    for record in profile.link_files:
        device, link_class, points = link_points(record.data, record.path)
        links[f"{device}/{link_class}"] = fit_link(link_class, points, record.path)[0]
    return links
