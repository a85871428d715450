"""The device profile: per-layer forward/backward time and activation bytes, as versioned JSON.

Simulated profiles (from datasheets) and measured ones (from `hetplan profile`) share this shape, so every
consumer reads one format:

    {"schema": "hetplan.profile/1", "source": "simulated"|"measured", "device": {...}, "model": {...},
     "dtype": "bf16", "seq_length": 4096, "environment": {...},
     "entries": [{"layer": "decoder"|"embedding"|"lm_head", "micro_batch_size": 1, "tp": 1,
                  "recompute": "none"|"selective"|"full", "forward_time_s": ..., "backward_time_s": ...,
                  "activation_bytes": ...}, ...]}

`backward_time_s` includes the recomputed forward work of the entry's recompute mode. A measured profile may also
carry a `host` section (`HostCosts`, its own schema "hetplan.host/1"): what a training step costs on the measured host
besides its layers and collectives, which a local run on CPU processes needs.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specs.errors import SpecError
from specs.loading import (
    KIND_BY_SCHEMA,
    TRAINING_FILE,
    check_file_kind,
    file_kind,
    file_sha256,
    read_mapping,
    validate,
)
from specs.model import Recompute
from specs.outputs import write_text_atomic

PROFILE_SCHEMA = "hetplan.profile/1"
HOST_SCHEMA = "hetplan.host/1"
LayerKind = Literal["decoder", "embedding", "lm_head"]


@dataclass(frozen=True)
class LayerCost:
    """Time and memory of one layer (TP shard) for one micro-batch on one device."""

    forward_time_s: float
    backward_time_s: float
    activation_bytes: float

    @property
    def time_s(self) -> float:
        return self.forward_time_s + self.backward_time_s


class LayerCostSource(Protocol):
    """Anything that knows layer costs on one device type: a simulated device, a profile, a predictor."""

    @property
    def identity(self) -> str: ...

    def layer_cost(self, layer: LayerKind, micro_batch_size: int, tp: int, recompute: Recompute) -> LayerCost: ...


@dataclass
class ScaledLayerCosts:
    """A layer cost source whose times are multiplied by a factor (activation bytes unchanged): a calibrated one, an
    emulated group's or a shared core's; `why` says which in its identity (none: calibrated)."""

    inner: LayerCostSource
    factor: float
    why: str = ""
    _costs: dict[tuple[str, int, int, str], LayerCost] = field(default_factory=dict, repr=False)

    @property
    def identity(self) -> str:
        return f"{self.inner.identity} x{self.factor:.3f}{f' ({self.why})' if self.why else ''}"

    def tp_degrees(self) -> tuple[int, ...] | None:
        """The TP degrees the inner source covers (a profile's), None where it answers any: scaled (calibrated, or an
        emulated group's), a profile must still keep the search to what it timed."""
        covered = getattr(self.inner, "tp_degrees", None)
        return covered() if callable(covered) else None

    def layer_cost(self, layer: LayerKind, micro_batch_size: int, tp: int, recompute: Recompute) -> LayerCost:
        key = (layer, micro_batch_size, tp, recompute)
        cost = self._costs.get(key)
        if cost is None:
            inner = self.inner.layer_cost(layer, micro_batch_size, tp, recompute)
            factor = self.factor
            cost = LayerCost(inner.forward_time_s * factor, inner.backward_time_s * factor, inner.activation_bytes)
            self._costs[key] = cost
        return cost


class ProfileEntry(BaseModel):
    """One measured (or simulated) point. A size that did not fit the device is kept with `fits: false`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layer: LayerKind
    micro_batch_size: int = Field(ge=1)
    tp: int = Field(ge=1)
    recompute: Recompute = "none"
    fits: bool = True
    forward_time_s: float | None = Field(default=None, gt=0)
    backward_time_s: float | None = Field(default=None, gt=0)
    activation_bytes: float | None = Field(default=None, ge=0)
    forward_time_min_s: float | None = Field(default=None, ge=0)
    forward_time_max_s: float | None = Field(default=None, ge=0)
    backward_time_min_s: float | None = Field(default=None, ge=0)
    backward_time_max_s: float | None = Field(default=None, ge=0)
    repeats: int | None = Field(default=None, ge=1)
    peak_memory_bytes: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _measured_if_fits(self) -> ProfileEntry:
        if self.fits and None in (self.forward_time_s, self.backward_time_s, self.activation_bytes):
            raise ValueError("an entry that fits needs forward_time_s, backward_time_s and activation_bytes")
        return self


class ConcurrencyPoint(BaseModel):
    """A decoder layer pass's busy (CPU) time while `processes` processes (one thread each) compute at once on the
    host, over its busy time alone: what they do to each other's caches and memory bandwidth. (The wait for a core
    when they outnumber the cores is time slicing, which HostCosts.stretch adds.)"""

    model_config = ConfigDict(frozen=True, extra="forbid")

    processes: int = Field(ge=1)
    busy_stretch: float = Field(gt=0)


class HostCosts(BaseModel):
    """What a training step costs on the profiled host besides its layers and collectives, measured by
    `hetplan profile` (profiler/host.py) with one thread per process, as the runtime's ranks run:

    concurrency              a layer's busy time with N processes computing at once (N up to twice the cores) over
                             alone: how ranks slow each other through caches and memory bandwidth (busy time, i.e.
                             CPU time, is what the other users of a shared machine do not inflate);
    optimizer_s_per_param    the AdamW update, per parameter of the rank's optimizer shard;
    flatten_s_per_param      gathering the rank's gradients and parameters into flat buffers and the updated
                             parameters back, per parameter it holds;
    gather_s_per_param       with the optimizer state sharded (ZeRO-1), padding the shard and joining the gathered
                             pieces, per parameter held (the all-gather itself is a collective);
    microbatch_overhead_s    running a stage (embedding, layers, head) as one module, per micro-batch, beyond its
                             layers' own times (one autograd pass instead of one per layer; may be negative);
    layer_overhead_s         the same per decoder layer of the stage (weights fetched cold, one after the other);
    tp_collective_overhead_s, tp_collective_overhead_s_per_byte  what a TP rank computes around each of its
                             collectives beyond the collective itself (waking from it with cold caches, the autograd
                             boundary, the copy it reduces), fixed and per byte reduced, timed with two processes and
                             real Gloo all-reduces; 0 in profiles made before it was measured;
    tp_all_reduce_alpha_s, tp_all_reduce_bw_bytes_per_s  those all-reduces' per-step latency and bus bandwidth, fitted
                             at three activation sizes between layers (caches cold, unlike `profile-comm`'s back-to-back
                             loop): the TP collectives of local runs use them (none: the link profile's);
    tp_all_reduce_load_alpha_s, tp_all_reduce_load_s_per_byte  what each busy process per core beyond one adds to
                             those all-reduces' latency and time per byte, timed with processes computing beside the
                             two ranks (none: the host link's load terms);
    family_sync_s_per_param  the work around the collectives when gradients meet across pipeline families (padding,
                             indexing the chunk to swap, adding what comes back), per parameter held;
    cold_forward_s, cold_backward_s  what a stage's forward and backward take beyond back to back when another
                             process has just used their core (its data in the caches): with more ranks than cores
                             every pass starts so; timed on a stage of up to 4 layers with the embedding and head, two
                             processes pinned to one core taking turns; 0 in profiles made before it was measured;
    batch_s, batch_s_per_sample  making a step's token batch (the runtime's synthetic data) at the profile's sequence.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    schema_: Literal["hetplan.host/1"] = Field(default=HOST_SCHEMA, alias="schema")
    cores: int = Field(ge=1)
    concurrency: list[ConcurrencyPoint] = Field(min_length=1)
    optimizer_s_per_param: float = Field(ge=0)
    flatten_s_per_param: float = Field(ge=0)
    gather_s_per_param: float = Field(default=0.0, ge=0)
    microbatch_overhead_s: float
    layer_overhead_s: float
    tp_collective_overhead_s: float = 0.0
    tp_collective_overhead_s_per_byte: float = Field(default=0.0, ge=0)
    tp_all_reduce_alpha_s: float | None = Field(default=None, ge=0)
    tp_all_reduce_bw_bytes_per_s: float | None = Field(default=None, gt=0)
    tp_all_reduce_load_alpha_s: float | None = Field(default=None, ge=0)
    tp_all_reduce_load_s_per_byte: float | None = Field(default=None, ge=0)
    family_sync_s_per_param: float = Field(default=0.0, ge=0)
    cold_forward_s: float = Field(default=0.0, ge=0)
    cold_backward_s: float = Field(default=0.0, ge=0)
    batch_s: float = Field(ge=0)
    batch_s_per_sample: float = Field(ge=0)

    def busy_stretch(self, processes: float) -> float:
        """A layer's busy time with `processes` computing at once over alone: the measured points interpolated
        linearly (1 at one process; a point below 1 counts as 1, processes computing at once do not speed each other
        up), the last point's value past it."""
        points = sorted({(1, 1.0), *((p.processes, max(1.0, p.busy_stretch)) for p in self.concurrency)})
        for (low, low_stretch), (high, high_stretch) in itertools.pairwise(points):
            if processes <= high:
                return low_stretch + (max(processes, low) - low) / (high - low) * (high_stretch - low_stretch)
        return points[-1][1]

    def stretch(self, processes: float) -> float:
        """What `processes` computing at once on this host do to each one's compute time: their busy stretch, and
        time slicing when they outnumber the cores (each gets cores / processes of one)."""
        return self.busy_stretch(processes) * max(1.0, processes / self.cores)

    def data_time_s(self, global_batch: int) -> float:
        """Making one step's batch of `global_batch` sequences."""
        return self.batch_s + global_batch * self.batch_s_per_sample


class ProfileFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_: Literal["hetplan.profile/1"] = Field(alias="schema")
    source: Literal["simulated", "measured"]
    device: dict[str, Any]
    model: dict[str, Any]
    dtype: str
    seq_length: int = Field(ge=1)
    environment: dict[str, Any] = {}
    entries: list[ProfileEntry] = Field(min_length=1)
    host: HostCosts | None = None


@dataclass(frozen=True)
class LinkFileRecord:
    """A link profile file read beside a device profile: where it is, its SHA-256 and its data."""

    path: str
    sha256: str
    data: dict[str, Any]


@dataclass
class DeviceProfile:
    """A profile read from (or written to) JSON; answers layer costs by lookup and interpolation."""

    source: Literal["simulated", "measured"]
    device: dict[str, Any]
    model: dict[str, Any]
    dtype: str
    seq_length: int
    entries: list[ProfileEntry]
    environment: dict[str, Any] = field(default_factory=dict)
    path: str = ""
    sha256: str = ""  # of the file it was read from (a plan records it: planner.cost_source)
    host: HostCosts | None = None  # measured host costs (local runs on CPU processes), when profiled
    # link profiles (`hetplan profile-comm`) of this device found beside the profile: path, SHA-256 and the file's
    # data; predictor.context fits them (profiler.profiles.load_profile_files attaches them)
    link_files: list[LinkFileRecord] = field(default_factory=list)

    @property
    def identity(self) -> str:
        return f"{self.source} profile {self.path or self.device.get('key', '?')}"

    def to_json(self) -> str:
        body = {
            "schema": PROFILE_SCHEMA,
            "source": self.source,
            "device": self.device,
            "model": self.model,
            "dtype": self.dtype,
            "seq_length": self.seq_length,
            "environment": self.environment,
            "entries": [entry.model_dump(exclude_none=True) for entry in self.entries],
        }
        if self.host is not None:
            body["host"] = self.host.model_dump(by_alias=True)
        return json.dumps(body, indent=2, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, self.to_json())

    def layer_cost(self, layer: LayerKind, micro_batch_size: int, tp: int, recompute: Recompute) -> LayerCost:
        """Exact entry, or linear interpolation/extrapolation in micro-batch size between profiled points."""
        mode = recompute if layer == "decoder" else "none"
        points = sorted(
            (e for e in self.entries if e.fits and e.layer == layer and e.tp == tp and e.recompute == mode),
            key=lambda e: e.micro_batch_size,
        )
        if not points:
            have = sorted({(e.tp, e.recompute) for e in self.entries if e.layer == layer})
            raise SpecError(
                self.path or "profile",
                "entries",
                f"no {layer} entry for tp={tp}, recompute={mode}; profiled (tp, recompute): {have} (profile it, "
                f"hetplan profile --tp {tp} --recompute {mode}, or plan within what was profiled: --recompute)",
            )
        for point in points:
            if point.micro_batch_size == micro_batch_size:
                return _cost(point)
        if len(points) == 1:
            scale = micro_batch_size / points[0].micro_batch_size
            only = _cost(points[0])
            return LayerCost(only.forward_time_s * scale, only.backward_time_s * scale, only.activation_bytes * scale)
        below = [p for p in points if p.micro_batch_size < micro_batch_size]
        above = [p for p in points if p.micro_batch_size > micro_batch_size]
        if below and above:
            lo, hi = below[-1], above[0]
        elif above:
            lo, hi = points[0], points[1]
        else:
            lo, hi = points[-2], points[-1]
        weight = (micro_batch_size - lo.micro_batch_size) / (hi.micro_batch_size - lo.micro_batch_size)

        def blend(a: float, b: float) -> float:
            return max(a + weight * (b - a), 0.0)

        low, high = _cost(lo), _cost(hi)
        return LayerCost(
            blend(low.forward_time_s, high.forward_time_s),
            blend(low.backward_time_s, high.backward_time_s),
            blend(low.activation_bytes, high.activation_bytes),
        )

    def tp_degrees(self) -> tuple[int, ...]:
        return tuple(sorted({e.tp for e in self.entries if e.layer == "decoder" and e.fits}))


def _cost(entry: ProfileEntry) -> LayerCost:
    assert entry.forward_time_s is not None and entry.backward_time_s is not None
    assert entry.activation_bytes is not None
    return LayerCost(entry.forward_time_s, entry.backward_time_s, entry.activation_bytes)


def load_profile(path: str | Path) -> DeviceProfile:
    """Read and validate a profile JSON file."""
    path = Path(path)
    data = read_mapping(path)
    kind = KIND_BY_SCHEMA["hetplan.profile"]  # a plan given for a profile: its fields all read as misspelt
    # without a schema a profile's `dtype` would read as a training file's; a config.json in a profiles directory read
    # as a profile of misspelt fields ("architectures: unknown field")
    if "schema" in data or file_kind(data) not in ("", TRAINING_FILE):
        check_file_kind(data, str(path), f"{kind} (what `hetplan profile` writes)", (kind,))
    parsed = validate(ProfileFile, data, str(path))
    return DeviceProfile(
        source=parsed.source,
        device=parsed.device,
        model=parsed.model,
        dtype=parsed.dtype,
        seq_length=parsed.seq_length,
        entries=list(parsed.entries),
        environment=parsed.environment,
        path=str(path),
        sha256=file_sha256(path),
        host=parsed.host,
    )
