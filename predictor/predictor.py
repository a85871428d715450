"""The predictor: learned layer models, fitted links and calibration, composed by the analytic cost model.

`hetplan fit` builds one from profiles (per device type, `predictor.layer_model`), link profiles
(`predictor.link_model`) and measured runs (`predictor.calibration`); `plan` and `predict` use it through
`Predictor.context`. Saved with joblib: a header (schema, library versions, training-data fingerprint) next to the
pickled predictor, so a file from another scikit-learn version is refused with a clear message before anything of
it is unpickled. Without a file, `default_predictor()` is used: datasheet-simulated layer costs calibrated on the
published small run bundled in predictor/data (shared/reference/calibration.md).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import pickle
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from predictor.calibration import Calibration, Interval, apply, fit_calibration, prediction_interval
from predictor.comm_model import Link
from predictor.cost_model import CostContext, build_context, emulated
from predictor.host import local_run_context
from predictor.runs import Run, check_runs_once, fingerprint, load_runs
from profiler.profile import DeviceProfile, HostCosts, load_profile
from specs.cluster import ClusterSpec
from specs.errors import SpecError, expect_argument, expect_list
from specs.layout import Strategy
from specs.loading import file_sha256
from specs.model import ModelSpec
from specs.training import TrainingSpec

if TYPE_CHECKING:  # scikit-learn costs a second to import: only fitting and learned layer models need it
    from predictor.layer_model import LayerCostModel

PREDICTOR_SCHEMA = "hetplan.predictor/3"  # 3: local runs on CPUs calibrate terms of their own (host:...)
PUBLISHED_RUNS = Path(__file__).parent / "data" / "published-runs.json"


def library_versions() -> dict[str, str]:
    import joblib
    import numpy
    import scipy
    import sklearn

    try:
        own = version("hetplan")
    except PackageNotFoundError:  # running from a source tree that was not installed
        own = "source"
    return {
        "hetplan": own,
        "scikit-learn": sklearn.__version__,
        "numpy": numpy.__version__,
        "scipy": scipy.__version__,
        "joblib": joblib.__version__,
        "python": platform.python_version(),
    }


@dataclass
class Predictor:
    layer_models: dict[str, LayerCostModel] = field(default_factory=dict)  # by device key
    # by device key: (hidden size of the profiled model, its host costs) per profile with a host section
    host_costs: dict[str, list[tuple[int, HostCosts]]] = field(default_factory=dict)
    links: dict[str, Link] = field(default_factory=dict)  # by "device key/link class"
    link_fit_errors: dict[str, float] = field(default_factory=dict)
    calibration: Calibration = field(default_factory=Calibration)
    metadata: dict[str, Any] = field(default_factory=dict)
    name: str = "default"
    # what a plan records of this predictor: {"kind": "shipped", "key"}, {"kind": "file", "path", "sha256"}, or
    # None (fitted in this process, never saved: {"kind": "unsaved", "name"})
    source: dict[str, str] | None = None

    def cost_source(self, profiles: Mapping[str, DeviceProfile] | None = None) -> dict[str, Any]:
        """Where the costs of a context made with `profiles` come from: this predictor and the profile files (path
        and SHA-256, by device), as a plan records it so that the commands reading the plan use the same."""
        predictor = self.source or {"kind": "unsaved", "name": self.name}
        files = []
        for key, profile in sorted((profiles or {}).items()):
            path = str(Path(profile.path).resolve()) if profile.path else ""
            files.append({"device": key, "path": path, "sha256": profile.sha256})
            for link in profile.link_files:  # link profiles beside it (profiler.profiles)
                files.append({"device": key, "path": str(Path(link.path).resolve()), "sha256": link.sha256})
        return {"predictor": dict(predictor), "profiles": files}

    def host_costs_for(self, model: ModelSpec) -> dict[str, HostCosts]:
        """By device key, the host costs profiled with the model closest in hidden size to `model` (on a log
        scale): the costs per parameter move with the model's size (the small one's buffers stay in cache, the large
        one's stream from memory), so the nearest profile speaks for it, not an average over sizes."""
        return {
            key: min(profiled, key=lambda pair: abs(math.log(pair[0] / model.hidden_size)))[1]
            for key, profiled in self.host_costs.items()
        }

    @property
    def identity(self) -> str:
        parts = []
        if self.layer_models:
            parts.append("layer models for " + ", ".join(sorted(self.layer_models)))
        if self.links:
            parts.append("fitted links " + ", ".join(sorted(self.links)))
        parts.append(f"calibrated on {len(self.calibration.runs)} runs")
        return f"predictor {self.name} ({'; '.join(parts)})"

    def base_context(
        self,
        cluster: ClusterSpec,
        model: ModelSpec,
        training: TrainingSpec,
        profiles: Mapping[str, DeviceProfile] | None = None,
    ) -> CostContext:
        """Uncalibrated costs: explicit profiles first, then learned layer models, then datasheet simulation."""
        ctx = replace(build_context(cluster, model, training, profiles), cost_source=self.cost_source(profiles))
        # the profiles' own host costs and links first (measured on the machine that runs), then the predictor's
        host = {key: costs for key, costs in self.host_costs_for(model).items() if key not in (profiles or {})}
        ctx = replace(ctx, host={**host, **ctx.host})
        if not self.layer_models and not self.links:
            return replace(ctx, identity=self.identity)
        from predictor.layer_model import PredictedLayerCosts

        sources = dict(ctx.sources)
        seq_length = ctx.seq_length
        for group in cluster.groups:
            key = group.device.key
            if key in self.layer_models and key not in (profiles or {}):
                learned = PredictedLayerCosts(self.layer_models[key], model, seq_length, training.dtype)
                sources[group.name] = emulated(group, learned)
        return replace(ctx, sources=sources, links={**self.links, **ctx.links}, identity=self.identity)

    def context(
        self,
        cluster: ClusterSpec,
        model: ModelSpec,
        training: TrainingSpec,
        profiles: Mapping[str, DeviceProfile] | None = None,
    ) -> CostContext:
        """Calibrated costs: what plan and predict use."""
        return apply(self.base_context(cluster, model, training, profiles), self.calibration.value_map())

    def interval(self, base: CostContext, strategy: Strategy) -> Interval:
        """90% interval of the iteration time of `strategy` on an uncalibrated `base_context`."""
        taken = "an uncalibrated CostContext: predictor.base_context(cluster, model, training)"
        expect_argument(base, CostContext, "Predictor.interval()", "base", taken)
        taken = "a Strategy (a loaded plan's or a Plan's .strategy)"
        expect_argument(strategy, Strategy, "Predictor.interval()", "strategy", taken)
        base.check_strategy(strategy, "strategy")
        learned = [
            self.layer_models[g.device.key].log_error_std ** 2
            for g in base.cluster.groups
            if base.source(g).identity.startswith("learned layer model")
        ]
        extra = max(learned, default=0.0)
        basis = (
            f"{len(self.calibration.runs)} calibration runs (run noise {self.calibration.run_noise:.1%}), "
            "priors for terms no run informed"
            + (f", cross-validated layer-model error {math.sqrt(extra):.1%}" if learned else "")
        )
        return prediction_interval(base, strategy, self.calibration, extra, basis)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "metadata": self.metadata,
            "layer_models": {
                key: {"cv_log_error_rms": round(m.log_error_std, 4), "trained_on": m.trained_on}
                for key, m in sorted(self.layer_models.items())
            },
            "links": {
                key: {
                    "busbw_bytes_per_s": link.bw_bytes_per_s,
                    "alpha_s": link.alpha_s,
                    "slowdown_per_doubling": link.slowdown_per_doubling,
                    "fit_median_rel_error": self.link_fit_errors.get(key),
                }
                for key, link in sorted(self.links.items())
            },
            "calibration": self.calibration.to_dict(),
        }


def _calibration_cases(
    predictor: Predictor, runs: Sequence[Run], profiles: Mapping[str, DeviceProfile] | None = None
) -> list[tuple[str, CostContext, Strategy, float]]:
    cases = []
    for run in runs:
        base = local_run_context(
            lambda cluster, run=run: predictor.base_context(cluster, run.model, run.training, profiles),
            run.cluster,
            run.cpu_share,
        )
        base.check_strategy(run.strategy, f"{run.path}: run {run.name!r}")
        cases.append((run.name, base, run.strategy, run.measured_iteration_time_s))
    return cases


def calibration_runs(run_paths: Sequence[Path] = (), published_runs: bool = True) -> list[Run]:
    """The runs calibration learns from: the given run records, then the bundled published runs."""
    paths = [*run_paths, *([PUBLISHED_RUNS] if published_runs else [])]
    runs = [run for path in paths for run in load_runs(path)]
    check_runs_once(runs, bundled=str(PUBLISHED_RUNS))
    return runs


def fit_predictor(
    profile_paths: Sequence[Path] = (),
    link_paths: Sequence[Path] = (),
    run_paths: Sequence[Path] = (),
    published_runs: bool = True,
    name: str = "fitted",
) -> Predictor:
    """Fit layer models per device type, links per class, then calibration on the runs (plus the bundled
    published run unless `published_runs` is False)."""
    from predictor.layer_model import fit_layer_cost_model, profile_model_spec
    from predictor.link_model import fit_link, load_link_points

    for argument, given in (("profile_paths", profile_paths), ("link_paths", link_paths), ("run_paths", run_paths)):
        # (a string is a sequence: it was read letter by letter)
        taken = "a list of files (a directory's profiles: profiler.profiles.checked_profile_files(DIR))"
        expect_list(given, "fit_predictor()", argument, taken)
    by_device: dict[str, list[DeviceProfile]] = {}
    for path in profile_paths:
        profile = load_profile(path)
        by_device.setdefault(str(profile.device.get("key", "")), []).append(profile)
    predictor = Predictor(name=name)
    for key, profiles in sorted(by_device.items()):
        predictor.layer_models[key] = fit_layer_cost_model(profiles)
        measured = [(profile_model_spec(p).hidden_size, p.host) for p in profiles if p.host is not None]
        if measured:
            predictor.host_costs[key] = measured
    read_from: dict[str, Path] = {}
    named: dict[Path, Path] = {}
    for given in link_paths:  # a file named twice (--links and inside --profiles) is read once
        named.setdefault(Path(given).resolve(), Path(given))
    for path in named.values():
        device, link_class, points = load_link_points(path)
        key = f"{device}/{link_class}"
        if key in predictor.links:
            raise SpecError(
                str(path),
                "link_class",
                f"a second links file for {link_class!r} links of {device!r} (the first: {read_from[key]}); give one",
            )
        read_from[key] = path
        predictor.links[key], predictor.link_fit_errors[key] = fit_link(link_class, points, str(path))
    all_run_paths = [*run_paths, *([PUBLISHED_RUNS] if published_runs else [])]
    runs = calibration_runs(run_paths, published_runs)
    predictor.calibration = fit_calibration(_calibration_cases(predictor, runs))
    inputs = [str(p) for p in [*profile_paths, *link_paths, *all_run_paths]]
    predictor.metadata = {
        "schema": PREDICTOR_SCHEMA,
        "versions": library_versions(),
        "fingerprint": fingerprint(inputs),
        "inputs": inputs,
    }
    return predictor


CACHE_DIR_ENV = "HETPLAN_CACHE_DIR"
# What the shipped predictor is computed from: a change to any of these (or to a library version) is a new cache key.
DEFAULT_INPUTS = ("predictor/*.py", "profiler/*.py", "specs/*.py", "specs/catalog/*.yaml")


def cache_dir() -> Path:
    """Where hetplan keeps what it can recompute (delete it at will): $HETPLAN_CACHE_DIR, else
    $XDG_CACHE_HOME/hetplan, else ~/.cache/hetplan."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hetplan"


def default_predictor_key() -> str:
    """SHA-256 over the code and data the shipped predictor is fitted from and the versions of the libraries that fit
    it (read from package metadata, without importing them): equal keys give equal predictors."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted({*(p for pattern in DEFAULT_INPUTS for p in root.glob(pattern)), PUBLISHED_RUNS}):
        label = path.relative_to(root) if path.is_relative_to(root) else path.name
        digest.update(str(label).encode() + b"\0" + path.read_bytes() + b"\0")
    for library in ("numpy", "scipy", "pydantic"):
        digest.update(f"{library}={version(library)};".encode())
    digest.update(platform.python_version().encode())
    return digest.hexdigest()[:32]


@functools.cache
def default_predictor() -> Predictor:
    """Datasheet simulation calibrated on the bundled published runs (deterministic): fitted once, then read from the
    cache (`cache_dir()`, keyed by default_predictor_key(), so never a stale answer); an unreadable or unwritable cache
    only costs the fit."""
    key = default_predictor_key()
    path = cache_dir() / f"default-predictor-{key}.pickle"
    try:
        cached = pickle.loads(path.read_bytes())
        if isinstance(cached, Predictor):
            cached.source = {"kind": "shipped", "key": key}
            return cached
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError, ValueError):
        pass
    predictor = fit_predictor(name="default")
    predictor.source = {"kind": "shipped", "key": key}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_bytes(pickle.dumps(predictor))
        os.replace(temporary, path)
    except OSError:
        pass
    return predictor


def save_predictor(predictor: Predictor, path: str | Path) -> None:
    """Write a predictor file (joblib: the header with its schema and library versions, the pickled predictor)."""
    import joblib

    expect_argument(predictor, Predictor, "save_predictor()", "predictor", "a Predictor: fit_predictor(...)")
    expect_argument(path, (str, os.PathLike), "save_predictor()", "path", "a path of the predictor file to write")

    header = {"schema": PREDICTOR_SCHEMA, "metadata": predictor.metadata}
    joblib.dump({**header, "payload": pickle.dumps(predictor)}, Path(path))


def load_predictor(path: str | Path) -> Predictor:
    """Read a predictor file; refuses files of another schema or scikit-learn version with a one-line reason."""
    import joblib

    taken = "a path of a predictor file (`hetplan fit --out`)"
    expect_argument(path, (str, os.PathLike), "load_predictor()", "path", taken)
    source = str(path)
    if not Path(path).is_file():
        raise SpecError(source, "", "predictor file not found (make one with `hetplan fit ... --out FILE`)")
    try:
        blob = joblib.load(Path(path))
    except Exception:  # any unreadable file gets the same one-line answer
        raise SpecError(source, "", "not a hetplan predictor file (expected the output of `hetplan fit`)") from None
    if not isinstance(blob, dict) or blob.get("schema") != PREDICTOR_SCHEMA:
        raise SpecError(source, "schema", f"expected {PREDICTOR_SCHEMA!r} (a file written by `hetplan fit`)")
    fitted = blob.get("metadata", {}).get("versions", {})
    here = library_versions()
    for library in ("scikit-learn", "hetplan"):
        if fitted.get(library) != here[library]:
            raise SpecError(
                source,
                f"metadata.versions.{library}",
                f"fitted with {library} {fitted.get(library)}, this environment has {here[library]}: "
                "refit it with `hetplan fit` (its inputs are listed in metadata.inputs)",
            )
    predictor = pickle.loads(blob["payload"])
    if not isinstance(predictor, Predictor):
        raise SpecError(source, "payload", "expected a hetplan predictor")
    predictor.name = Path(path).name
    predictor.source = {"kind": "file", "path": str(Path(path).resolve()), "sha256": file_sha256(path)}
    return predictor
