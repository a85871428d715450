"""The costs a command evaluates a saved plan with: by default the source the plan records (`cost_source`: its
predictor and profile files, checked by SHA-256), else what `--predictor` / `--profiles` name. One line says which
(and what the flags replaced); one line names each recorded file that changed since the plan was made, and a recorded
file that is gone is an error that asks the user to choose, never a silent switch to other costs."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from planner.plan import CostSource, LoadedPlan, PredictorSource
from specs.errors import SpecError
from specs.loading import file_sha256
from specs.model import ModelSpec

if TYPE_CHECKING:
    from predictor.context import CostContext
    from predictor.predictor import Predictor
    from predictor.runs import Run
    from profiler.profile import DeviceProfile
    from specs.cluster import ClusterSpec
    from specs.training import TrainingSpec

SHORT_HASH = 12  # characters of a SHA-256 shown in a message


@dataclass(frozen=True)
class PlanCosts:
    """What to evaluate a plan with, and the lines that say so (the first: where the costs come from)."""

    predictor: Predictor
    profiles: dict[str, DeviceProfile]
    lines: tuple[str, ...]

    def context_in(self, cluster: ClusterSpec, model: ModelSpec, training: TrainingSpec) -> tuple[CostContext, str]:
        """These costs for another training than the plan's (an engine's dtype): the profiles whose layers are timed
        in the dtype each device then runs, the predictor's costs for the other devices, and a line naming those
        (empty when none)."""
        trains = cluster.trains_in(training.dtype)  # idle groups take no stage
        kept = {
            key: profile
            for key, profile in self.profiles.items()
            if all(g.device.runs_dtype(training.dtype) == profile.dtype for g in trains if g.device.key == key)
        }
        dropped = sorted(set(self.profiles) - set(kept))
        said = (
            f"note: the profiles of {', '.join(dropped)} time layers in {self.profiles[dropped[0]].dtype}: in "
            f"{training.dtype} their costs are the predictor's"
            if dropped
            else ""
        )
        return self.predictor.context(cluster, model, training, kept), said


def describe_predictor(source: PredictorSource | None) -> str:
    if source is None:
        return "no recorded predictor"
    if source.kind == "shipped":
        return f"the shipped predictor {source.key[:SHORT_HASH]}"
    if source.kind == "file":
        return f"predictor {source.path}"
    return f"predictor {source.name!r} (fitted while planning, never saved)"


def describe_profiles(paths: dict[str, str]) -> str:
    if not paths:
        return "no profiles (datasheet or learned layer costs)"
    return "profiles " + ", ".join(f"{device}={path or '(never saved)'}" for device, path in sorted(paths.items()))


@dataclass(frozen=True)
class Recorder:
    """The file that records a cost source, in a message's words: a plan ("the plan", made) or a run record ("the
    run", predicted), and the field the source sits under."""

    source: str
    what: str = "the plan"
    made: str = "made"
    field: str = "cost_source"


def _changed(recorder: Recorder, what: str, path: str, recorded: str, now: str) -> str:
    return (
        f"{path}: {what} changed since {recorder.what} was {recorder.made} (sha256 {recorded[:SHORT_HASH]}, now "
        f"{now[:SHORT_HASH]}): using it as it is now, so predictions differ from {recorder.what}'s"
    )


def _recorded_predictor(recorder: Recorder, source: PredictorSource, notes: list[str]) -> Predictor:
    from predictor.predictor import default_predictor, load_predictor

    if source.kind == "shipped":
        chosen = default_predictor()
        now = (chosen.source or {}).get("key", "")
        if now != source.key:
            notes.append(
                f"{recorder.source}: {recorder.made} with the shipped predictor {source.key[:SHORT_HASH]}; this "
                f"hetplan ships {now[:SHORT_HASH]}: using the one shipped now (pass --predictor FILE to choose another)"
            )
        return chosen
    if source.kind == "unsaved":
        notes.append(
            f"{recorder.source}: {recorder.made} with predictor {source.name!r}, fitted while planning and never "
            "saved: using the shipped predictor (pass --predictor FILE to choose another)"
        )
        return default_predictor()
    path = Path(source.path)
    if not path.is_file():
        raise SpecError(
            recorder.source,
            f"{recorder.field}.predictor.path",
            f"{path}, the predictor {recorder.what} was {recorder.made} with, is missing: restore it or choose one "
            "with --predictor FILE",
        )
    now = file_sha256(path)
    if now != source.sha256:
        notes.append(_changed(recorder, f"{recorder.what}'s predictor", str(path), source.sha256, now))
    return load_predictor(path)


def _recorded_profiles(
    recorder: Recorder, model: ModelSpec, recorded: CostSource, notes: list[str]
) -> dict[str, DeviceProfile]:
    from profiler.profiles import load_profile_files

    paths, saved = [], []
    for index, entry in enumerate(recorded.profiles):
        if not entry.path:
            notes.append(
                f"{recorder.source}: {recorder.made} with a {entry.device} profile that was never saved to a file: "
                f"using the predictor's costs for {entry.device} (pass --profiles DIR to choose)"
            )
            continue
        saved.append(entry)
        path = Path(entry.path)
        if not path.is_file():
            raise SpecError(
                recorder.source,
                f"{recorder.field}.profiles[{index}].path",
                f"{path}, the {entry.device} profile {recorder.what} was {recorder.made} from, is missing: restore "
                "it or choose the profiles with --profiles DIR",
            )
        now = file_sha256(path)
        if now != entry.sha256:
            notes.append(_changed(recorder, f"{recorder.what}'s {entry.device} profile", str(path), entry.sha256, now))
        paths.append(path)
    loaded = load_profile_files(paths, model, f"recorded in {recorder.source}")
    for entry in saved:
        if entry.device not in loaded:
            raise SpecError(
                entry.path,
                "device.key",
                f"expected device {entry.device!r}, as {recorder.what} {recorder.source} records",
            )
    return loaded


def plan_costs(
    plan: LoadedPlan,
    predictor_file: Path | None = None,
    profiles_dir: Path | None = None,
    model: ModelSpec | None = None,
    devices: Collection[str] | None = None,
) -> PlanCosts:
    """The predictor and profiles to evaluate `plan` with: the ones it records unless a flag names others (`model`:
    the model evaluated when it is not the plan's, e.g. `predict --strategy --model`; the plan's profiles time
    another layer then, so only the predictor is reused). `devices`: the cluster's device keys, whose profiles
    `profiles_dir` is read for (None: all)."""
    from predictor.predictor import default_predictor, load_predictor
    from profiler.profiles import SHAPE_FIELDS, load_profiles

    recorded = plan.cost_source
    model = model or plan.model
    notes: list[str] = []
    if predictor_file is not None:
        predictor = load_predictor(predictor_file)
        said = f"predictor {predictor_file} (--predictor"
        said += f"; the plan was made with {describe_predictor(recorded.predictor)})" if recorded else ")"
    elif recorded is None:
        predictor = default_predictor()
        said = "the shipped predictor"
    else:
        predictor = _recorded_predictor(Recorder(plan.source), recorded.predictor, notes)
        said = describe_predictor(recorded.predictor) + " (as recorded in the plan)"
    recorded_paths: dict[str, str] = {}
    for entry in recorded.profiles if recorded else ():  # a device's layer profile first, then its link profiles
        recorded_paths.setdefault(entry.device, entry.path)
    if profiles_dir is not None:
        profiles = load_profiles(profiles_dir, model, devices)
        said += f", {describe_profiles({k: p.path for k, p in profiles.items()})} from --profiles {profiles_dir}"
        if recorded is not None:
            said += f" (the plan was made with {describe_profiles(recorded_paths)})"
    elif recorded is None or not recorded.profiles:
        profiles = {}
        said += ", no profiles" + (" (as recorded in the plan)" if recorded else "")
    elif any(getattr(model, field) != getattr(plan.model, field) for field in SHAPE_FIELDS):
        profiles = {}
        said += f", no profiles (the plan's time {plan.model.key}'s layers, not {model.key}'s)"
    else:
        profiles = _recorded_profiles(Recorder(plan.source), plan.model, recorded, notes)
        said += f", {describe_profiles(recorded_paths)} (as recorded in the plan)"
    if recorded is None:
        said += f"; {plan.source} records no cost source (made before plans recorded one)"
    return PlanCosts(predictor, profiles, (f"costs: {said}", *notes))


def run_costs(runs: Sequence[Run], predictor_file: Path | None = None, profiles_dir: Path | None = None) -> PlanCosts:
    """What `validate` predicts run records with: what `--predictor` / `--profiles` name; else the cost source the
    records name (`hetplan run` writes the one its prediction came from) when every record names the same one; else
    the shipped predictor, with a line saying which records name another. Profiles time one model's layers, so the
    runs predicted from them must share its layer shape."""
    from predictor.predictor import default_predictor, load_predictor
    from profiler.profiles import load_profiles
    from specs.loading import validate

    recorded = {json.dumps(run.cost_source, sort_keys=True): run for run in runs if run.cost_source}
    with_record = sum(run.cost_source is not None for run in runs)
    if predictor_file is None and profiles_dir is None and len(recorded) == 1 and with_record == len(runs):
        run = runs[0]
        recorder = Recorder(run.path, "the run", "predicted", "measurements.cost_source")
        source = validate(CostSource, run.cost_source, run.path, prefix="measurements.cost_source")
        notes: list[str] = []
        predictor = _recorded_predictor(recorder, source.predictor, notes)
        profiles = _recorded_profiles(recorder, run.model, source, notes) if source.profiles else {}
        _check_shapes(runs, run.model, "the profiles the records name", profiles)
        paths: dict[str, str] = {}
        for entry in source.profiles:  # a device's layer profile first, then its link profiles
            paths.setdefault(entry.device, entry.path)
        said = f"{describe_predictor(source.predictor)}, {describe_profiles(paths)} (as recorded in the run record"
        said += "s)" if len(runs) > 1 else ")"
        if profiles:
            said += ", the predictor's calibration not applied (as `hetplan run` predicted)"
        return PlanCosts(predictor, profiles, (f"costs: {said}", *notes))
    predictor = load_predictor(predictor_file) if predictor_file is not None else default_predictor()
    said = f"predictor {predictor_file} (--predictor)" if predictor_file is not None else "the shipped predictor"
    profiles: dict[str, DeviceProfile] = {}
    flag_notes: list[str] = []
    if profiles_dir is not None and runs:
        devices = {group.device.key for run in runs for group in run.cluster.groups}
        profiles = load_profiles(profiles_dir, runs[0].model, devices)
        _check_shapes(runs, runs[0].model, f"--profiles {profiles_dir}", profiles)
        paths = {key: profile.path for key, profile in profiles.items()}
        said += f", {describe_profiles(paths)} from --profiles {profiles_dir}"
        said += ", the predictor's calibration not applied" if profiles else ""
        missing = sorted(devices - set(profiles))
        if missing:
            flag_notes.append(f"note: --profiles {profiles_dir} has no profile of {', '.join(missing)}: predicted from "
                         "the predictor's costs there")  # fmt: skip
    if recorded and predictor_file is None and profiles_dir is None:
        different = f", {len(recorded)} different ones" if len(recorded) > 1 else ""
        said += (
            f" ({with_record} of {len(runs)} run records name the costs `hetplan run` predicted them with"
            f"{different}: validate them apart to use those, or pass --predictor / --profiles)"
        )
    return PlanCosts(predictor, profiles, (f"costs: {said}", *flag_notes))


def _check_shapes(runs: Sequence[Run], model: ModelSpec, named: str, profiles: Mapping[str, DeviceProfile]) -> None:
    """Profiles time one model's layers: a run of another layer shape cannot be predicted from them."""
    from profiler.profiles import SHAPE_FIELDS

    if not profiles:
        return
    for run in runs:
        if any(getattr(run.model, field) != getattr(model, field) for field in SHAPE_FIELDS):
            raise SpecError(
                run.path,
                "model",
                f"run {run.name!r} trains {run.model.key}, whose layers {named} do not time (they time "
                f"{model.key}'s): validate it apart",
            )
