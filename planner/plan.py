"""The Plan: a strategy plus everything predicted about it, as versioned JSON ("hetplan.plan/1")."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from predictor.calibration import Interval
from predictor.cost_model import CostContext, Evaluation
from specs.errors import SpecError, also_wrong, expect_argument
from specs.layout import PipelineFile, PipelineStrategy, Strategy, pipelines_from_files, without_figures
from specs.loading import PLAN_FILE, StrictBool, StrictInt, file_kind, read_mapping, validate
from specs.model import ModelSpec, Recompute
from specs.outputs import check_writable, write_text_atomic
from specs.training import TrainingSpec

PLAN_SCHEMA = "hetplan.plan/1"


def _round(value: float) -> float:
    """Six significant digits: readable, and stable across runs of the same inputs."""
    return float(f"{value:.6g}")


@dataclass(frozen=True)
class Bounds:
    upper_bound_tokens_per_s: float
    compute_bound_tokens_per_s: float
    per_group_upper_bound_tokens_per_s: dict[str, float] = field(default_factory=dict)
    scaled_groups: tuple[str, ...] = ()  # groups too small to hold the model alone (see planner.yardsticks)


@dataclass(frozen=True)
class Plan:
    context: CostContext
    evaluation: Evaluation
    bounds: Bounds
    search_time_s: float
    search_stats: dict[str, Any]
    alternatives: tuple[Evaluation, ...] = ()
    interval: Interval | None = None
    lower_bound_s: float | None = None  # least iteration time of any plan in the search space (when asked)

    @property
    def strategy(self) -> Strategy:
        return self.evaluation.strategy

    def to_dict(self) -> dict[str, Any]:
        body = plan_dict(
            self.context, self.evaluation, self.bounds, self.search_time_s, self.search_stats, self.alternatives
        )
        if self.interval is not None:
            body["iteration_time_interval_s"] = interval_dict(self.interval)
        if self.lower_bound_s is not None:
            body["iteration_time_lower_bound_s"] = _round(self.lower_bound_s)
            body["gap_to_lower_bound"] = _round(1 - self.lower_bound_s / self.evaluation.iteration_time_s)
        return body

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        """Write the plan file, creating its directory as `hetplan plan --out` does (a path it cannot write is a
        one-line SpecError)."""
        expect_argument(path, (str, os.PathLike), "Plan.save()", "path", "a path of the plan JSON file to write")
        write_text_atomic(check_writable(path, "Plan.save"), self.to_json())


def evaluation_dict(ctx: CostContext, evaluation: Evaluation) -> dict[str, Any]:
    """The fields shared by `plan` and `predict`: metrics, strategy and per-stage memory."""
    strategy = evaluation.strategy
    pipelines = []
    for family, pipeline in enumerate(strategy.pipelines):
        stages = []
        for stage_eval in (e for e in evaluation.stages if e.family == family):
            stage = stage_eval.stage
            memory = stage_eval.memory
            stages.append(
                {
                    "group": stage.group,
                    "device": ctx.cluster.group(stage.group).device.key,
                    "layers": [stage.layer_start, stage.layer_end],
                    "tp": stage.tp,
                    "recompute": strategy.stage_recompute(stage),
                    "devices": pipeline.stage_devices(stage),
                    "device_offset": stage.device_offset,
                    "compute_time_s": _round(stage_eval.compute_time_s),
                    "p2p_time_s": _round(stage_eval.p2p_time_s),
                    "dp_sync_time_s": _round(stage_eval.dp_sync_time_s),
                    "memory_bytes": int(memory.total_bytes),
                    "memory_capacity_bytes": int(stage_eval.memory_capacity_bytes),
                    "memory_usable_bytes": int(stage_eval.memory_usable_bytes),
                    "memory_breakdown_bytes": {
                        "weights": int(memory.weights_bytes),
                        "grads": int(memory.grads_bytes),
                        "optimizer": int(memory.optimizer_bytes),
                        "activations": int(memory.activation_bytes),
                    },
                    "fits": stage_eval.fits,
                }
            )
        pipelines.append(
            {
                "replicas": pipeline.replicas,
                "micro_batch_size": pipeline.micro_batch_size,
                "num_microbatches": pipeline.num_microbatches,
                "samples_per_replica": pipeline.samples_per_replica,
                "batch_weight": _round(pipeline.samples_per_replica / ctx.training.global_batch_size),
                "family_samples": pipeline.samples,
                "total_microbatches": pipeline.microbatch_total,
                "context_parallel": pipeline.context_parallel,
                "zero_stage": strategy.family_zero_stage(pipeline),
                "replica_batches": _replica_batches(pipeline, ctx.training.global_batch_size),
                "stages": stages,
            }
        )
    return {
        "iteration_time_s": _round(evaluation.iteration_time_s),
        "tokens_per_s": _round(evaluation.tokens_per_s),
        "samples_per_s": _round(evaluation.samples_per_s),
        "mfu": _round(evaluation.mfu),
        "fits": evaluation.fits,
        "devices_used": evaluation.devices_used,
        "recompute": strategy.recompute,
        "recompute_summary": strategy.recompute_summary,
        "zero_stage": strategy.zero_stage,
        "zero_shard": strategy.zero_shard,
        "schedule": schedule_name(strategy.virtual_stages),
        "virtual_stages": strategy.virtual_stages,
        "context_parallel": strategy.context_parallel,
        "sequence_parallel": strategy.sequence_parallel,
        "time_breakdown_s": {
            "pipeline": _round(evaluation.pipeline_time_s),
            "bubble": _round(evaluation.bubble_time_s),
            "dp_sync_and_optimizer": _round(evaluation.tail_time_s),
            "dp_sync_overlapped": _round(evaluation.dp_sync_overlapped_s),  # (not in the iteration: hidden)
        },
        "pipelines": pipelines,
    }


def schedule_name(virtual_stages: int) -> str:
    return "1f1b" if virtual_stages == 1 else "interleaved-1f1b"


def _replica_batches(pipeline: PipelineStrategy, global_batch_size: int) -> list[dict[str, Any]]:
    """How the global batch is split: replicas with the same share, their samples and gradient weight."""
    counts = pipeline.replica_microbatches()
    out = []
    for microbatches in sorted(set(counts), reverse=True):
        samples = microbatches * pipeline.micro_batch_size
        out.append(
            {
                "replicas": counts.count(microbatches),
                "first_replica": counts.index(microbatches),
                "samples": samples,
                "gradient_weight": _round(samples / global_batch_size),
            }
        )
    return out


def interval_dict(interval: Interval) -> dict[str, Any]:
    return {
        "low": _round(interval.low_s),
        "high": _round(interval.high_s),
        "confidence": 0.9,
        "log_sd": round(interval.log_sd, 4),
        "basis": interval.basis,
    }


def header_dict(ctx: CostContext) -> dict[str, Any]:
    return {
        "schema": PLAN_SCHEMA,
        "cluster": ctx.cluster.name,
        "model": ctx.model.model_dump(exclude={"aliases", "source"}),
        "training": ctx.training.model_dump(mode="json"),
        "global_batch_size": ctx.training.global_batch_size,
        "seq_length": ctx.seq_length,
        "predictor": ctx.predictor_identity,
        **({"cost_source": dict(ctx.cost_source)} if ctx.cost_source else {}),
        **({"cluster_defaults": dict(ctx.cluster.defaults)} if ctx.cluster.defaults else {}),
    }


def plan_dict(
    ctx: CostContext,
    evaluation: Evaluation,
    bounds: Bounds,
    search_time_s: float,
    search_stats: dict[str, Any],
    alternatives: tuple[Evaluation, ...] = (),
) -> dict[str, Any]:
    body = header_dict(ctx)
    body.update(evaluation_dict(ctx, evaluation))
    body.update(
        {
            "upper_bound_tokens_per_s": _round(bounds.upper_bound_tokens_per_s),
            "fraction_of_upper_bound": _round(evaluation.tokens_per_s / bounds.upper_bound_tokens_per_s),
            "compute_bound_tokens_per_s": _round(bounds.compute_bound_tokens_per_s),
            "fraction_of_compute_bound": _round(evaluation.tokens_per_s / bounds.compute_bound_tokens_per_s),
            "upper_bound_by_group_tokens_per_s": {
                k: _round(v) for k, v in bounds.per_group_upper_bound_tokens_per_s.items()
            },
            "upper_bound_scaled_groups": list(bounds.scaled_groups),
            "search_time_s": round(search_time_s, 3),
            "search": search_stats,
            "alternatives": [
                {
                    "iteration_time_s": _round(alt.iteration_time_s),
                    "tokens_per_s": _round(alt.tokens_per_s),
                    "summary": describe_strategy(alt.strategy),
                }
                for alt in alternatives
            ],
        }
    )
    return body


def describe_stages(pipeline: PipelineStrategy) -> str:
    """'amd tp8 L0-4 | ascend tp8 L5-14': a family's stages in pipeline order."""
    return " | ".join(f"{s.group} tp{s.tp} L{s.layer_start}-{s.layer_end - 1}" for s in pipeline.stages)


def layout_changes(before: Strategy, after: Strategy) -> list[str]:
    """What differs between two plans of one cluster, one item per part ('micro-batch 1 -> 2'), for a user told that
    one stands in for the other (an export's engine's best plan in place of the plan)."""
    changes: list[str] = []

    def compare(what: str, old: object, new: object) -> None:
        if old != new:
            changes.append(f"{what} {old} -> {new}")

    if len(before.pipelines) != len(after.pipelines):  # no part stays in place: the other plan as a whole
        compare("pipeline families", len(before.pipelines), len(after.pipelines))
        changes.append(f"now {describe_strategy(after)}")
        return changes
    several = len(before.pipelines) > 1
    for index, (old, new) in enumerate(zip(before.pipelines, after.pipelines, strict=True)):
        family = f"family {index}: " if several else ""
        compare(f"{family}stages", f"[{describe_stages(old)}]", f"[{describe_stages(new)}]")
        compare(f"{family}replicas", old.replicas, new.replicas)
        compare(f"{family}micro-batch", old.micro_batch_size, new.micro_batch_size)
        compare(f"{family}micro-batches per replica", old.num_microbatches, new.num_microbatches)
    compare("recompute", before.recompute_summary, after.recompute_summary)
    compare("ZeRO", before.zero_summary.removeprefix("ZeRO-"), after.zero_summary.removeprefix("ZeRO-"))
    compare("ZeRO sharding over", before.zero_shard, after.zero_shard)
    compare("interleaving (virtual stages)", before.virtual_stages, after.virtual_stages)
    compare("context parallel", before.context_parallel, after.context_parallel)
    compare("sequence parallel", before.sequence_parallel, after.sequence_parallel)
    return changes


def describe_strategy(strategy: Strategy) -> str:
    """One line: 'dp 8 x [amd tp8 L0-4 | ascend tp8 L5-14 ...], mbs 1, recompute selective, zero 1'; several
    pipeline families are joined with ' + ', each with its share of the batch."""
    families = []
    for pipeline in strategy.pipelines:
        stages = describe_stages(pipeline)
        microbatches = str(pipeline.num_microbatches)
        if pipeline.uneven:
            microbatches = f"{pipeline.num_microbatches - 1}-{pipeline.num_microbatches} (uneven)"
        share = (
            f" ({pipeline.micro_batch_size * pipeline.microbatch_total} samples)" if len(strategy.pipelines) > 1 else ""
        )
        families.append(f"dp {pipeline.replicas} x [{stages}], mbs {pipeline.micro_batch_size} x {microbatches}{share}")
    return (
        " + ".join(families)
        + f", recompute {strategy.recompute_summary}, {strategy.zero_summary.lower()}, v {strategy.virtual_stages}"
        + (f", cp {strategy.context_parallel}" if strategy.context_parallel > 1 else "")
    )


# ---- reading a plan back (predict --strategy) -------------------------------------------------------------
def sha256_digest(value: str, what: str) -> str:
    """A recorded file hash: empty (never saved) or 64 hex digits."""
    if value and not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ValueError(f"expected the {what} file's SHA-256: 64 hex digits (0-9, a-f), got {value!r}")
    return value


class PredictorSource(BaseModel):
    """The predictor a plan was made with: the shipped one (its cache key), a file (path, SHA-256) or one fitted in
    the planning process and never saved (its name)."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["shipped", "file", "unsaved"]
    key: str = ""
    path: str = ""
    sha256: str = ""
    name: str = ""

    _hex_digest = field_validator("sha256")(lambda value: sha256_digest(value, "predictor"))

    @model_validator(mode="after")
    def _complete(self) -> PredictorSource:
        needed = {"shipped": ("key",), "file": ("path", "sha256"), "unsaved": ()}[self.kind]
        missing = [name for name in needed if not getattr(self, name)]
        if missing:
            raise ValueError(f"a {self.kind!r} predictor needs {' and '.join(missing)}")
        return self


class ProfileSource(BaseModel):
    """A profile file a plan's costs came from: its device, absolute path and SHA-256 (both empty for a profile
    made in memory and never saved, e.g. by the Python API)."""

    model_config = ConfigDict(extra="forbid")
    device: str
    path: str = ""
    sha256: str = ""

    _hex_digest = field_validator("sha256")(lambda value: sha256_digest(value, "profile"))

    @model_validator(mode="after")
    def _both_or_neither(self) -> ProfileSource:
        if bool(self.path) != bool(self.sha256):
            raise ValueError("expected both path and sha256 (a saved profile) or neither (one never saved)")
        return self


class CostSource(BaseModel):
    """Where a plan's costs came from (`cost_source` in the plan JSON): planner.cost_source reads it back."""

    model_config = ConfigDict(extra="forbid")
    predictor: PredictorSource
    profiles: list[ProfileSource] = Field(default_factory=list)


# what a plan file writes beside its settings for its readers (header_dict, evaluation_dict, plan_dict, to_dict and
# predict's interval): read back they are skipped (_check_summaries checks the ones a reader could mistake for
# settings); any other key is an error, since a misspelt setting would otherwise change nothing
PLAN_FIGURES = frozenset(
    {
        "global_batch_size",
        "seq_length",
        "predictor",
        "cluster_defaults",
        "iteration_time_s",
        "tokens_per_s",
        "samples_per_s",
        "mfu",
        "fits",
        "devices_used",
        "recompute_summary",
        "schedule",
        "context_parallel",
        "time_breakdown_s",
        "upper_bound_tokens_per_s",
        "fraction_of_upper_bound",
        "compute_bound_tokens_per_s",
        "fraction_of_compute_bound",
        "upper_bound_by_group_tokens_per_s",
        "upper_bound_scaled_groups",
        "search_time_s",
        "alternatives",
        "iteration_time_interval_s",
        "iteration_time_lower_bound_s",
        "gap_to_lower_bound",
    }
)


class _PlanFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_: Literal["hetplan.plan/1"] = Field(alias="schema")
    cluster: str = ""
    model: dict[str, Any]
    training: dict[str, Any]
    recompute: Recompute
    zero_stage: StrictInt = Field(ge=0, le=3)
    zero_shard: Literal["dp", "node"] = "dp"
    virtual_stages: StrictInt = Field(default=1, ge=1)
    sequence_parallel: StrictBool = True
    pipelines: list[PipelineFile] = Field(min_length=1)
    cost_source: CostSource | None = None  # plans made before hetplan recorded it have none
    search: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _skip_figures(cls, data: object) -> object:
        return without_figures(data, PLAN_FIGURES)


@dataclass(frozen=True)
class LoadedPlan:
    strategy: Strategy
    model: ModelSpec
    training: TrainingSpec
    source: str
    cluster_name: str = ""
    cost_source: CostSource | None = None
    engine: str | None = None  # the engine it was planned for (`plan --engine`), by its registry key
    # each family's stages' `device` as written ("" where not): planner.what_if checks them against the cluster
    written_devices: tuple[tuple[str, ...], ...] = ()
    training_names_engine: bool = False  # its training named the kernels (`engine`): an export keeps them
    # `hetplan replan`'s changes to the cluster file, in order ((without, add) each; none for a plan as planned),
    # and the nodes they left by group, by the cluster file's numbers: the nodes the plan is for
    # (planner.what_if.recorded_cluster). None: not recorded (a plan from before, or an export's nodes alone)
    cluster_changes: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] | None = None
    cluster_nodes: tuple[tuple[str, tuple[int, ...]], ...] = ()


class _ClusterChange(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    without: list[str] = []
    add: list[str] = []


class _ClusterChanges(BaseModel):
    """What a plan records of its cluster (search.cluster_changes: a re-plan's changes to the cluster file, none as
    planned; search.cluster_nodes: each group's node numbers)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    cluster_changes: list[_ClusterChange] = []
    cluster_nodes: dict[str, list[Annotated[int, Field(ge=0)]]] = {}

    @model_validator(mode="after")
    def _both(self) -> _ClusterChanges:
        if "cluster_changes" in self.model_fields_set and not self.cluster_nodes:
            raise ValueError("cluster_changes go with cluster_nodes, the nodes they leave (a plan writes both)")
        if any(len(set(numbers)) != len(numbers) for numbers in self.cluster_nodes.values()):
            raise ValueError("cluster_nodes: a node number given twice")
        return self


def _check_summaries(
    data: dict[str, Any], model: ModelSpec, training: TrainingSpec, strategy: Strategy, source: str
) -> None:
    """The figures a plan file repeats for its readers (the batch, the sequence, CP, each family's samples per
    replica, its share of the batch and its replicas' split of it) agree with the training and layout they
    summarise: edited by hand they would change nothing, so a disagreement is named rather than ignored (the first,
    the fields of the others after it: a tp edited by hand leaves several)."""
    # (the mapping the figure is written in, its key, its name in the message, the value, what decides it)
    figures: list[tuple[Any, str, str, object, str]] = [
        (data, "global_batch_size", "global_batch_size", training.global_batch_size, "training.global_batch_size"),
        (
            data,
            "seq_length",
            "seq_length",
            training.seq_length or model.seq_length,
            "training.seq_length (or the model's)",
        ),
        (data, "context_parallel", "context_parallel", strategy.context_parallel, "pipelines[].context_parallel"),
        (data, "schedule", "schedule", schedule_name(strategy.virtual_stages), "virtual_stages"),
    ]
    hints: dict[str, str] = {}  # by figure: what a disagreement may come from
    for index, (written, pipeline) in enumerate(zip(data.get("pipelines") or [], strategy.pipelines, strict=False)):
        name = f"pipelines[{index}]"
        by = f"{name}'s micro-batch size and counts"
        figures.append(
            (written, "samples_per_replica", f"{name}.samples_per_replica", pipeline.samples_per_replica, by)
        )
        figures.append((written, "family_samples", f"{name}.family_samples", pipeline.samples, by))
        weight = _round(pipeline.samples_per_replica / training.global_batch_size)
        figures.append((written, "batch_weight", f"{name}.batch_weight", weight, by))
        split = _replica_batches(pipeline, training.global_batch_size)
        figures.append((written, "replica_batches", f"{name}.replica_batches", split, by))
        stages = written.get("stages") if isinstance(written, dict) else None
        for number, (stage_written, stage) in enumerate(zip(stages or [], pipeline.stages, strict=False)):
            devices_by = (
                f"{name}'s replicas x its context_parallel x the stage's tp ({pipeline.replicas} x "
                f"{pipeline.context_parallel} x {stage.tp})"
            )
            devices = pipeline.stage_devices(stage)
            figures.append((stage_written, "devices", f"{name}.stages[{number}].devices", devices, devices_by))
            written_devices = stage_written.get("devices") if isinstance(stage_written, dict) else None
            rest = pipeline.replicas * pipeline.context_parallel
            if isinstance(written_devices, int) and written_devices % rest == 0 and written_devices // rest != stage.tp:
                # the devices another tp gives: a tp edited by hand (whether it fits a node is checked later)
                unsplit = (
                    ""
                    if model.splits_for_tp(stage.tp)
                    else f"tp {stage.tp} does not split {model.unsplit_by_tp(stage.tp)} into equal parts (a stage's TP "
                    "must); "
                )
                hints[f"{name}.stages[{number}].devices"] = (
                    f"{unsplit}{written_devices} is what tp {written_devices // rest} gives: if tp was edited from "
                    f"{written_devices // rest}, change replicas with it to keep the stage's devices, or make this "
                    "figure agree"
                )
    wrong: list[tuple[str, str]] = []  # (field, message) of each disagreement, in the file's order
    for mapping, key, name, value, by in figures:
        written = mapping.get(key) if isinstance(mapping, dict) else None
        if isinstance(written, list) and isinstance(value, list) and len(written) == len(value):
            name, written, value = _first_difference(name, written, value)
        if written is not None and written != value:
            fix = f"; {hints[name]}" if name in hints else (" (edit that; a figure written for readers changes "
                                                             "nothing: make it agree or delete it)")  # fmt: skip
            shown, deciding = _figure_text(written), _figure_text(value)
            if shown == deciding:  # (they differ where the short text does not show: a weight)
                shown, deciding = repr(written), repr(value)
            wrong.append((name, f"{shown} disagrees with {by}, {deciding}, which decides it{fix}"))
    if wrong:
        (name, message), others = wrong[0], [field for field, _ in wrong[1:]]
        raise SpecError(source, name, message + also_wrong(others))


def _figure_text(value: object) -> str:
    """A figure as a message shows it: a replica split as its replicas x samples ("5 x 12 + 12 x 11 samples"; its
    dicts ran past the message's length and were cut in a word), anything else as written."""
    if (
        isinstance(value, list)
        and value
        and all(isinstance(v, dict) and {"replicas", "samples"} <= v.keys() for v in value)
    ):
        return " + ".join(f"{v['replicas']} x {v['samples']}" for v in value) + " samples"
    return repr(value)


def _check_defaults(parsed: _PlanFile, training: TrainingSpec, source: str) -> None:
    """A plan's `zero_stage` and `recompute` are the defaults of the families and stages that do not set their own
    (a plan writes every one's): where each sets its own, a default none of them has decides nothing, and edited by
    hand it would change nothing without a word. So would its training's ZeRO stage and sharding scope (the search's,
    written as the plan's own): they must agree with the plan's."""
    families = [pipeline.zero_stage for pipeline in parsed.pipelines]
    if None not in families and parsed.zero_stage not in families:
        raise SpecError(
            source, "zero_stage", f"{parsed.zero_stage} is no family's (each sets its own pipelines[].zero_stage: "
            f"{', '.join(str(z) for z in families)}): edit those, or make it agree"
        )  # fmt: skip
    modes = [stage.recompute for pipeline in parsed.pipelines for stage in pipeline.stages]
    if None not in modes and parsed.recompute not in modes:
        raise SpecError(
            source, "recompute", f"{parsed.recompute!r} is no stage's (each sets its own pipelines[].stages[]."
            f"recompute: {', '.join(sorted({str(m) for m in modes}))}): edit those, or make it agree"
        )  # fmt: skip
    for name in ("zero_stage", "zero_shard"):
        if getattr(training, name) != getattr(parsed, name):
            also = " (and pipelines[].zero_stage)" if name == "zero_stage" else ""
            raise SpecError(
                source, f"training.{name}", f"{getattr(training, name)} is not the plan's {name} "
                f"({getattr(parsed, name)}), which its families take: edit {name}{also}, or make this agree"
            )  # fmt: skip


def _first_difference(name: str, written: list[Any], value: list[Any]) -> tuple[str, Any, Any]:
    """The first entry (or an entry's field) where a written list of figures differs from its value, named:
    ("replica_batches[0].samples", -40, 40); the whole lists when no entry differs by itself."""
    for index, (entry, expected) in enumerate(zip(written, value, strict=True)):
        if entry == expected:
            continue
        if isinstance(entry, dict) and isinstance(expected, dict):
            for field in expected:
                if entry.get(field) != expected[field]:
                    return f"{name}[{index}].{field}", entry.get(field), expected[field]
        return f"{name}[{index}]", entry, expected
    return name, written, value


def load_plan(path: str | Path) -> LoadedPlan:
    """Read any plan in the plan schema back into a strategy, model and training spec."""
    expect_argument(
        path, (str, os.PathLike), "load_plan()", "path", "a path of a plan JSON file (`hetplan plan --out`)"
    )
    path = Path(path)
    source = str(path)
    data = read_mapping(path)
    kind = file_kind(data)  # a cluster, model or profile given for the plan: its fields all read as misspelt
    if "schema" not in data or kind not in ("", PLAN_FILE):  # (another schema, or another plan version: validate's)
        raise SpecError(source, "schema", f"expected {PLAN_SCHEMA!r}: a plan, as `hetplan plan --out` writes (got "
                        f"{kind or 'no schema'})")  # fmt: skip
    parsed = validate(_PlanFile, data, source)
    model = validate(ModelSpec, parsed.model, source, prefix="model")
    training = validate(TrainingSpec, parsed.training, source, prefix="training")
    _check_defaults(parsed, training, source)
    pipelines = pipelines_from_files(parsed.pipelines, parsed.recompute, parsed.zero_stage)
    strategy = Strategy(
        pipelines,
        parsed.recompute,
        parsed.zero_stage,
        parsed.virtual_stages,
        parsed.sequence_parallel,
        parsed.zero_shard,
    )
    _check_summaries(data, model, training, strategy, source)
    engine = parsed.search.get("engine")
    if engine is not None and not isinstance(engine, str):
        raise SpecError(source, "search.engine", f"expected an engine name, got {engine!r}")
    named = parsed.search.get("training_names_engine", False)
    if not isinstance(named, bool):
        raise SpecError(source, "search.training_names_engine", f"expected true or false, got {named!r}")
    written_devices = tuple(tuple(stage.device or "" for stage in pipeline.stages) for pipeline in parsed.pipelines)
    recorded = {key: parsed.search[key] for key in ("cluster_changes", "cluster_nodes") if key in parsed.search}
    changes = validate(_ClusterChanges, recorded, source, prefix="search")
    return LoadedPlan(
        strategy,
        model,
        training,
        source,
        parsed.cluster,
        parsed.cost_source,
        engine,
        written_devices,
        named,
        (
            tuple((tuple(change.without), tuple(change.add)) for change in changes.cluster_changes)
            if "cluster_changes" in changes.model_fields_set
            else None
        ),
        tuple((name, tuple(numbers)) for name, numbers in changes.cluster_nodes.items()),
    )
