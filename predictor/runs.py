"""Measured runs: what calibration learns from (`hetplan fit --runs`).

A run record (`hetplan.run/1`) says what ran and how long an iteration took: the cluster (a file next to the
record, or inline), the model (catalog key, file, or inline shape), training settings, the strategy (Megatron-style
tp/pp/dp on one group, or a whole plan's pipelines as `hetplan run` writes them) and `measured_iteration_time_s`.
A file holds one record, or several under
`{"schema": "hetplan.runs/1", "runs": [...]}`. `hetplan run` writes them; published small runs fit too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specs.cluster import ClusterFile, ClusterSpec, load_cluster, resolve_cluster
from specs.errors import SpecError
from specs.layout import PipelineFile, Strategy, megatron_strategy, pipelines_from_files
from specs.loading import check_file_kind, quote, read_mapping, validate
from specs.model import ModelSpec, Recompute, load_model
from specs.training import TrainingSpec

RUN_SCHEMA = "hetplan.run/1"
RUNS_SCHEMA = "hetplan.runs/1"
CALIBRATION_SCHEMA = "calibration-runs/1"  # shared/reference/calibration-runs.json: one device type per row


class MegatronLayout(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    group: str | None = None
    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    dp: int = Field(default=1, ge=1)
    micro_batch_size: int = Field(default=1, ge=1)
    recompute: Recompute = "none"
    virtual_stages: int = Field(default=1, ge=1)
    cp: int = Field(default=1, ge=1, description="context-parallel degree (Megatron's --context-parallel-size)")


class PlanLayout(BaseModel):
    """A whole plan's strategy (as a plan file writes it): what `hetplan run` records."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    recompute: Recompute = "none"
    zero_stage: int = Field(default=0, ge=0, le=3)
    zero_shard: Literal["dp", "node"] = "dp"
    virtual_stages: int = Field(default=1, ge=1)
    sequence_parallel: bool = True
    pipelines: list[PipelineFile] = Field(min_length=1)

    def to_strategy(self) -> Strategy:
        pipelines = pipelines_from_files(self.pipelines, self.recompute, self.zero_stage)
        return Strategy(
            pipelines, self.recompute, self.zero_stage, self.virtual_stages, self.sequence_parallel, self.zero_shard
        )


class RunRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_: Literal["hetplan.run/1"] = Field(default="hetplan.run/1", alias="schema")
    name: str
    source: str = Field(description="where the number comes from: a citation, or the machine it was measured on")
    derivation: str = Field(default="", description="how the iteration time was derived from the published figure")
    notes: str = ""
    cluster: str | dict[str, Any]
    model: str | dict[str, Any]
    training: dict[str, Any] = {}
    strategy: MegatronLayout | PlanLayout
    measured_iteration_time_s: float = Field(gt=0)
    cpu_share: float = Field(
        default=1.0, gt=0, le=1, description="the share of a core each CPU rank had (local runs: cores / ranks)"
    )
    machine_slowdown: float = Field(
        default=1.0,
        gt=0,
        description="how much slower the machine ran its profile's reference layer around the run than when profiled "
        "(local runs: runtime/launch.py speed_check); recorded, not calibrated away (its own noise is as large)",
    )
    # what `hetplan run` adds beside the measurement (calibration reads only the fields above)
    predicted_iteration_time_s: float | None = None
    predicted_at_run_speed_s: float | None = None
    losses: list[float] = []
    reference_match: dict[str, Any] | None = None
    measurements: dict[str, Any] = {}
    elastic: dict[str, Any] | None = None  # checkpoints and interruptions (`run --checkpoint-dir / --max-restarts`)


@dataclass(frozen=True)
class Run:
    """A run record resolved into specs and a strategy."""

    name: str
    source: str
    cluster: ClusterSpec
    model: ModelSpec
    training: TrainingSpec
    strategy: Strategy
    measured_iteration_time_s: float
    path: str
    cpu_share: float = 1.0  # a local run's assumed share of a core per rank (predictor.host.local_run_context)
    machine_slowdown: float = 1.0  # the record's: how much slower the machine ran than when profiled
    cost_source: dict[str, Any] | None = None  # what `hetplan run` predicted it with (measurements.cost_source)


def _resolve(record: RunRecord, path: Path, where: str) -> Run:
    """The record resolved; `where` it sits in its file ("run": the file is the record, its fields top-level)."""

    def field(name: str) -> str:
        return name if where == "run" else f"{where}.{name}"

    if isinstance(record.cluster, str):
        cluster = load_cluster(path.parent / record.cluster)
    else:
        parsed = validate(ClusterFile, record.cluster, str(path), prefix=field("cluster"))
        cluster = resolve_cluster(parsed, str(path))
    if isinstance(record.model, str):
        candidate = path.parent / record.model
        model = load_model(str(candidate) if candidate.exists() else record.model, str(path), field("model"))
    else:
        model = validate(ModelSpec, record.model, str(path), prefix=field("model"))
    training = validate(TrainingSpec, record.training, str(path), prefix=field("training"))
    layout = record.strategy
    if isinstance(layout, PlanLayout):
        strategy = layout.to_strategy()  # checked against the cluster when calibration builds its context
    else:
        strategy = megatron_strategy(
            cluster,
            model,
            training,
            group=layout.group,
            tp=layout.tp,
            pp=layout.pp,
            dp=layout.dp,
            micro_batch_size=layout.micro_batch_size,
            recompute=layout.recompute,
            virtual_stages=layout.virtual_stages,
            context_parallel=layout.cp,
            source=f"{path}: {field('strategy')}",
        )
    return Run(
        record.name,
        record.source,
        cluster,
        model,
        training,
        strategy,
        record.measured_iteration_time_s,
        str(path),
        record.cpu_share,
        record.machine_slowdown,
        record.measurements.get("cost_source"),
    )


def check_runs_once(runs: Sequence[Run], bundled: str = "") -> None:
    """A run given twice (the same record in two files, or twice in one) would count twice: a calibration would weigh
    it double, a validation its error. Refused in one line naming both files (`bundled`: the file `fit` reads by
    default, which a copy of it repeats)."""
    seen: dict[tuple[str, str, float], Run] = {}
    for run in runs:
        key = (run.name, run.source, run.measured_iteration_time_s)
        earlier = seen.setdefault(key, run)
        if earlier is run:
            continue
        # the same record wherever it was read (a cluster written in it is named by its file)
        moved = replace(run, path=earlier.path, cluster=replace(run.cluster, source=earlier.cluster.source))
        if moved != earlier:
            continue
        named, other = (earlier, run) if run.path == bundled else (run, earlier)  # the user's file, not the bundled
        if named.path == other.path:
            where = "twice in this file"
        elif other.path == bundled:
            where = "also among the published runs `fit` reads unless --no-published-runs"
        else:
            where = f"also in {other.path}"
        raise SpecError(
            named.path,
            "runs",
            f"run {run.name!r} ({run.measured_iteration_time_s:g} s) is {where}: it would count twice, expected each "
            "run once (drop one)",
        )


def load_runs(path: str | Path) -> list[Run]:
    """Read one run record, or a `hetplan.runs/1` list of them."""
    path = Path(path)
    data = read_mapping(path)
    if data.get("schema") == CALIBRATION_SCHEMA:
        rows = data.get("runs")
        if not isinstance(rows, list) or not rows:
            raise SpecError(str(path), "runs", "expected a non-empty list of calibration rows")
        items = [
            (f"runs[{i}]", record_from_calibration_row(row, str(path), f"runs[{i}]")) for i, row in enumerate(rows)
        ]
    elif data.get("schema") == RUNS_SCHEMA:
        records = data.get("runs")
        if not isinstance(records, list) or not records:
            raise SpecError(str(path), "runs", "expected a non-empty list of run records")
        items = [(f"runs[{i}]", item) for i, item in enumerate(records)]
    elif data.get("schema") == RUN_SCHEMA:
        items = [("run", data)]
    else:
        run_kinds = ("a run record", "a file of run records", "a file of calibration runs")  # of another version
        check_file_kind(data, str(path), "a run record (what `hetplan run --out` writes)", run_kinds)
        expected = f"{RUN_SCHEMA!r}, {RUNS_SCHEMA!r} or {CALIBRATION_SCHEMA!r}"
        raise SpecError(str(path), "schema", f"expected {expected}, got {quote(data.get('schema'))}")
    runs = []
    for where, item in items:
        if not isinstance(item, dict):
            raise SpecError(str(path), where, "expected a run record (a mapping)")
        record = validate(RunRecord, item, str(path), prefix=where if where != "run" else "")
        runs.append(_resolve(record, path, where))
    return runs


class CalibrationRow(BaseModel):
    """A row of the calibration-runs/1 shape: a Megatron-style run on `gpus` devices of one type."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    source: str
    measured: str = ""
    notes: str = ""
    model: dict[str, Any]
    device: str
    gpus: int = Field(ge=1)
    devices_per_node: int = Field(ge=1)
    nics_per_node: int = Field(ge=1)
    nic_gbps: float = Field(gt=0)
    device_overrides: dict[str, Any] = {}
    transport: str | None = None
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    dp: int = Field(ge=1)
    global_batch: int = Field(ge=1)
    micro_batch: int = Field(ge=1)
    virtual_stages: int = Field(default=1, ge=1)
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    zero_stage: int = Field(default=0, ge=0, le=3)
    dtype: str = "bf16"
    seq_length: int = Field(ge=1)
    attention: str = "flash"
    training: dict[str, Any] = Field(default={}, description="further training fields (engine flags)")
    iteration_time_s: float = Field(gt=0)


def record_from_calibration_row(row: Any, source: str, where: str) -> dict[str, Any]:
    """A calibration-runs/1 row as a run record (one group of `gpus / devices_per_node` nodes)."""
    if not isinstance(row, dict):
        raise SpecError(source, where, "expected a calibration row (a mapping)")
    parsed = validate(CalibrationRow, row, source, prefix=where)
    if parsed.gpus % parsed.devices_per_node:
        raise SpecError(source, f"{where}.gpus", f"expected a multiple of devices_per_node ({parsed.devices_per_node})")
    group = {
        "name": parsed.device,
        "device": parsed.device,
        "nodes": parsed.gpus // parsed.devices_per_node,
        "devices_per_node": parsed.devices_per_node,
        "nics_per_node": parsed.nics_per_node,
        "nic_gbps": parsed.nic_gbps,
        **parsed.device_overrides,
        **({"transport": parsed.transport} if parsed.transport else {}),
    }
    training = {
        "global_batch_size": parsed.global_batch,
        "seq_length": parsed.seq_length,
        "dtype": parsed.dtype,
        "zero_stage": parsed.zero_stage,
        "sequence_parallel": parsed.sequence_parallel,
        "attention": parsed.attention,
        **parsed.training,
    }
    return {
        "schema": RUN_SCHEMA,
        "name": parsed.id,
        "source": parsed.source,
        "derivation": parsed.measured,
        "notes": parsed.notes,
        "cluster": {
            "name": parsed.id,
            "groups": [group],
            "network": {"topology": "clos", "inter_group_gbps": parsed.nic_gbps},
        },
        "model": {"key": parsed.id, **parsed.model},
        "training": training,
        "strategy": {
            "tp": parsed.tp,
            "pp": parsed.pp,
            "dp": parsed.dp,
            "micro_batch_size": parsed.micro_batch,
            "recompute": parsed.recompute,
            "virtual_stages": parsed.virtual_stages,
        },
        "measured_iteration_time_s": parsed.iteration_time_s,
    }


def fingerprint(paths: list[str]) -> str:
    """SHA-256 over the training files' names and bytes: which data a predictor was fitted on."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(Path(path).name.encode())
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def run_summary(run: Run) -> dict[str, Any]:
    return {
        "name": run.name,
        "source": run.source,
        "path": run.path,
        "devices": sum(p.replicas * sum(s.tp for s in p.stages) for p in run.strategy.pipelines),
        "measured_iteration_time_s": run.measured_iteration_time_s,
    }
