"""The costs a command evaluates a saved plan with: by default the source the plan records (`cost_source`: its
predictor and profile files, checked by SHA-256), else what `--predictor` / `--profiles` name. One line says which
(and what the flags replaced); one line names each recorded file that changed since the plan was made, and a recorded
file that is gone is an error that asks the user to choose, never a silent switch to other costs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from planner.plan import CostSource, LoadedPlan, PredictorSource
from specs.errors import SpecError
from specs.loading import file_sha256
from specs.model import ModelSpec

if TYPE_CHECKING:
    from collections.abc import Collection

    from predictor.predictor import Predictor
    from profiler.profile import DeviceProfile

SHORT_HASH = 12  # characters of a SHA-256 shown in a message


@dataclass(frozen=True)
class PlanCosts:
    """What to evaluate a plan with, and the lines that say so (the first: where the costs come from)."""

    predictor: Predictor
    profiles: dict[str, DeviceProfile]
    lines: tuple[str, ...]


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


def _changed(what: str, path: str, recorded: str, now: str) -> str:
    return (
        f"{path}: {what} changed since the plan was made (sha256 {recorded[:SHORT_HASH]}, now {now[:SHORT_HASH]}): "
        "using it as it is now, so predictions differ from the plan's"
    )


def _recorded_predictor(plan: LoadedPlan, source: PredictorSource, notes: list[str]) -> Predictor:
    from predictor.predictor import default_predictor, load_predictor

    if source.kind == "shipped":
        chosen = default_predictor()
        now = (chosen.source or {}).get("key", "")
        if now != source.key:
            notes.append(
                f"{plan.source}: made with the shipped predictor {source.key[:SHORT_HASH]}; this hetplan ships "
                f"{now[:SHORT_HASH]}: using the one shipped now (pass --predictor FILE to choose another)"
            )
        return chosen
    if source.kind == "unsaved":
        notes.append(
            f"{plan.source}: made with predictor {source.name!r}, fitted while planning and never saved: using the "
            "shipped predictor (pass --predictor FILE to choose another)"
        )
        return default_predictor()
    path = Path(source.path)
    if not path.is_file():
        raise SpecError(
            plan.source,
            "cost_source.predictor.path",
            f"{path}, the predictor the plan was made with, is missing: restore it or choose one with --predictor FILE",
        )
    now = file_sha256(path)
    if now != source.sha256:
        notes.append(_changed("the plan's predictor", str(path), source.sha256, now))
    return load_predictor(path)


def _recorded_profiles(plan: LoadedPlan, recorded: CostSource, notes: list[str]) -> dict[str, DeviceProfile]:
    from profiler.profiles import load_profile_files

    paths, saved = [], []
    for index, entry in enumerate(recorded.profiles):
        if not entry.path:
            notes.append(
                f"{plan.source}: made with a {entry.device} profile that was never saved to a file: using the "
                f"predictor's costs for {entry.device} (pass --profiles DIR to choose)"
            )
            continue
        saved.append(entry)
        path = Path(entry.path)
        if not path.is_file():
            raise SpecError(
                plan.source,
                f"cost_source.profiles[{index}].path",
                f"{path}, the {entry.device} profile the plan was made from, is missing: restore it or choose the "
                "profiles with --profiles DIR",
            )
        now = file_sha256(path)
        if now != entry.sha256:
            notes.append(_changed(f"the plan's {entry.device} profile", str(path), entry.sha256, now))
        paths.append(path)
    loaded = load_profile_files(paths, plan.model, f"recorded in {plan.source}")
    for entry in saved:
        if entry.device not in loaded:
            raise SpecError(
                entry.path, "device.key", f"expected device {entry.device!r}, as the plan {plan.source} records"
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
        predictor = _recorded_predictor(plan, recorded.predictor, notes)
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
        profiles = _recorded_profiles(plan, recorded, notes)
        said += f", {describe_profiles(recorded_paths)} (as recorded in the plan)"
    if recorded is None:
        said += f"; {plan.source} records no cost source (made before plans recorded one)"
    return PlanCosts(predictor, profiles, (f"costs: {said}", *notes))
