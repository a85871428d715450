"""What every hetplan command shares: its flags (typer annotations with the help users read), the costs a saved
plan is evaluated with, and how results are printed (tables or JSON on stdout, notes and progress on stderr). Heavy
imports stay inside the functions so `hetplan --help` stays fast."""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from report import said

if TYPE_CHECKING:
    from planner.cost_source import PlanCosts
    from planner.plan import LoadedPlan
    from predictor.predictor import Predictor
    from report.progress import Progress
    from specs.cluster import ClusterSpec
    from specs.training import TrainingSpec


# ---- flags ------------------------------------------------------------------------------------------------------
def finite(low: float = 0.0, inclusive: bool = False) -> Callable[..., float | None]:
    """A float flag's callback: finite and above `low` (typer's own `min` lets inf and nan through)."""

    def check(param: typer.CallbackParam, value: float | None) -> float | None:
        from specs.flags import finite

        return finite(value, param.opts[0] if param.opts else str(param.name), low, inclusive)

    return check


# whether typer formats help with rich (TYPER_USE_RICH=0 turns it off; older typer has no such switch)
RICH_HELP: bool = getattr(typer.core, "HAS_RICH", True)


def opt(*names: str, help: str, **kwargs: Any) -> Any:
    """typer.Option with the help text required (every flag says what it means in --help); its square brackets are
    text, not rich markup (typer's help took "[default: 1]" for a markup tag and printed nothing of it; without rich
    the escape would show)."""
    return typer.Option(*names, help=help.replace("[", "\\[") if RICH_HELP else help, **kwargs)


ClusterOpt = Annotated[Path, opt("--cluster", "-c", help="Cluster YAML/JSON file.")]
ModelOpt = Annotated[str, opt("--model", "-m", help="Catalog name, model YAML/JSON, or HF config.json.")]
TrainingOpt = Annotated[Optional[Path], opt("--training", help="Training YAML/JSON file (flags override).")]
GlobalBatchOpt = Annotated[Optional[int], opt("--global-batch", min=1, help="Sequences per iteration.")]
SeqLenOpt = Annotated[Optional[int], opt("--seq-len", min=1, help="Sequence length (default: the model's).")]
DtypeOpt = Annotated[Optional[str], opt("--dtype", help="bf16, fp16, fp32, or fp8 (where devices have it).")]
ENGINES = "megatron, flagscale, deepspeed, torchtitan, torchrun"  # specs/catalog/engines.yaml, listed in the help
ZERO = "0, 1 (distributed optimizer), 2 (gradients sharded too) or 3 (FSDP: weights too)."
ZeroOpt = Annotated[Optional[int], opt("--zero-stage", help=ZERO)]
JsonOpt = Annotated[bool, opt("--json", help="Print JSON instead of tables.")]
QuietOpt = Annotated[bool, opt("--quiet", "-q", help="No progress lines on stderr.")]
PredictorOpt = Annotated[
    Optional[Path], opt("--predictor", help="Predictor file from `hetplan fit` (default: shipped).")
]
ProfilesOpt = Annotated[Optional[Path], opt("--profiles", help="Directory of profile JSON files (by device).")]
PlanPredictorOpt = Annotated[
    Optional[Path], opt("--predictor", help="Predictor file from `hetplan fit` (default: the one the plan records).")
]
PlanProfilesOpt = Annotated[
    Optional[Path], opt("--profiles", help="Directory of profile JSON files (default: the ones the plan records).")
]
PlanArg = Annotated[Path, typer.Argument(help="Plan JSON (from `hetplan plan --out`).", metavar="PLAN")]
PlanClusterOpt = Annotated[Path, opt("--cluster", "-c", help="Cluster file the plan was made for.")]
MicroBatchesOpt = Annotated[str, opt("--micro-batches", help="Micro-batch sizes, e.g. 1,2,4,8.")]

TimeoutOpt = Annotated[float, opt("--timeout", callback=finite(), help="Seconds any one operation may take.")]
RepeatsOpt = Annotated[int, opt("--repeats", min=1, help="Timed runs per point.")]
PlanOutOpt = Annotated[Optional[Path], opt("--out", help="Write the plan JSON here.")]
ProfileOutOpt = Annotated[Path, opt("--out", help="Profile JSON to write.")]
PngOpt = Annotated[Optional[Path], opt("--png", help="Write the picture here (.png).")]
CHOICES = "Replica counts that do not divide the batch: off (default), refine, or exhaustive (slower)."
UnevenOpt = Annotated[Optional[str], opt("--uneven-batch", help=CHOICES)]
FAMILIES = "Pipeline families of different device mixes: auto (default: clusters of two groups), search or off."
FamiliesOpt = Annotated[Optional[str], opt("--families", help=FAMILIES)]
LOWER = "Also bound how fast any plan of the search space could be (the gap; about a second search)."
LowerBoundOpt = Annotated[bool, opt("--lower-bound", help=LOWER)]
# `predict`'s Megatron-style flags: the layout field each sets, the flag, and its value when not given (None:
# --group, the cluster's only group, else asked; --sequence-parallel, the training's)
MEGATRON_FLAGS: dict[str, tuple[str, object]] = {
    "group": ("--group", None),
    "tp": ("--tp", 1),
    "pp": ("--pp", 1),
    "dp": ("--dp", 1),
    "micro_batch_size": ("--micro-batch", 1),
    "recompute": ("--recompute", "none"),
    "virtual_stages": ("--virtual-stages", 1),
    "sequence_parallel": ("--sequence-parallel", None),
    "context_parallel": ("--cp", 1),
}


class OnceEachCommand(typer.core.TyperCommand):
    """A command that refuses an option of one value given more than once with different values: click keeps the
    last without a word (`plan --dtype fp16 --dtype bf16` planned bf16). Options meant to repeat (`multiple`, such as
    replan's --without) repeat, and the same value again loses nothing."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        helping = any(name in args for name in ctx.help_option_names)  # --help answers first, whatever else is given
        if not ctx.resilient_parsing and not helping:  # (shell completion parses half-typed lines)
            for name, values in repeated_options(self, ctx, args).items():
                times = "twice" if len(values) == 2 else f"{len(values)} times"
                listed = f"{', '.join(values[:-1])} and {values[-1]}"
                ctx.fail(f"{name}: given {times}, {listed}: expected one value (only the last would count)")
        try:
            return super().parse_args(ctx, args)
        except Exception as err:  # a value missing after an option: the parser's error knows no command
            if getattr(err, "ctx", False) is None:
                err.ctx = ctx  # so its line points at this command's --help, not hetplan's
            raise


def repeated_options(command: typer.core.TyperCommand, ctx: typer.Context, args: list[str]) -> dict[str, list[str]]:
    """The options of one value that `args` give different values, by long name, with the values as given (a
    switch's as the name used: --sequence-parallel, --no-sequence-parallel). `args` are parsed as the command parses
    them, but with each option of one value collecting its values; what cannot be parsed so is left to the
    command's own parsing, which says why."""
    single = [p for p in command.params if p.param_type_name == "option" and not p.multiple and not p.count]
    collecting = copy.copy(command)
    collecting.params = [_collecting(p) if p in single else p for p in command.params]
    try:
        given, _, _ = collecting.make_parser(ctx).parse_args(list(args))
    except Exception:  # an unknown option, a missing value: the command's own parsing names it
        return {}
    repeated = {}
    for option in single:
        values = given.get(option.name) or []
        if len({_meaning(option, ctx, value) for value in values}) > 1:  # --top-k 3 --top-k 03: one value
            name = next((n for n in option.opts if n.startswith("--")), option.opts[0])
            repeated[name] = [_as_given(option, value) for value in values]
    return repeated


def _meaning(option: Any, ctx: typer.Context, value: Any) -> str:
    """What a value given to an option means, converted as the command converts it (the commands' option callbacks
    only check values), or the value as given where it does not convert (the command's own parsing then names it)."""
    try:
        return repr(option.process_value(ctx, value))
    except Exception:  # a bad value: compared as given
        return _as_given(option, value)


def _collecting(option: Any) -> Any:
    """A copy of an option of one value that collects every value given (the parser appends instead of replacing)."""
    collecting = copy.copy(option)
    collecting.multiple = True
    return collecting


def _as_given(option: Any, value: Any) -> str:
    """An option's value as the command line gave it: a switch's name (--no-sequence-parallel), a value quoted."""
    if option.is_flag:
        return option.opts[0] if value or not option.secondary_opts else option.secondary_opts[0]
    return " ".join(repr(item) for item in value) if isinstance(value, (tuple, list)) else repr(value)


def predictor_from(path: Path | None) -> Predictor:
    """The predictor from `hetplan fit`, or the shipped one."""
    from predictor.predictor import default_predictor, load_predictor

    return load_predictor(path) if path is not None else default_predictor()


def profiles_said(directory: Path | None, model: Any, devices: list[str]) -> dict[str, Any]:
    """The profiles of `--profiles` (none without it); when it names a directory that leaves some of the cluster's
    devices without a profile, says on stderr that theirs are the datasheet's costs (an empty directory: all), under
    --quiet too (a note, not progress)."""
    from profiler.profiles import load_profiles

    profiles = load_profiles(directory, model, devices)
    missing = [device for device in dict.fromkeys(devices) if device not in profiles]
    if directory is not None and missing:
        whose = "its" if len(missing) == 1 else "their"
        said.say(f"note: --profiles {directory} has no profile of {', '.join(missing)}: {whose} costs are the "
                 "datasheet's (simulated)")  # fmt: skip
    return profiles


def plan_costs_said(
    loaded: LoadedPlan, predictor: Path | None, profiles: Path | None, *clusters: ClusterSpec, model: Any = None
) -> PlanCosts:
    """The costs to evaluate a saved plan on `clusters` with (the ones it records unless a flag names others; the
    profiles of a `profiles` directory for the clusters' devices), said on stderr in one line, plus a line per
    recorded file that changed since the plan was made."""
    from planner.cost_source import plan_costs

    devices = {group.device.key for cluster in clusters for group in cluster.groups}
    costs = plan_costs(loaded, predictor, profiles, model, devices=devices)
    for line in costs.lines:
        said.say(line)
    return costs


def on_cluster(training: TrainingSpec, cluster: ClusterSpec, used: Collection[str] | None = None) -> TrainingSpec:
    """The training on this cluster's groups (`used`: a strategy's, default every group): fp32 on CPU devices, fp16
    where some devices have no bf16, unless a dtype was chosen (a note on stderr says so); a note where FP8 would run
    bf16."""
    from specs.training import on_groups

    chosen, note = on_groups(training, [group for group in cluster.groups if used is None or group.name in used])
    if note:
        said.say(note)
    return chosen


def require_torch(command: str) -> None:
    """Commands that measure need torch: say so in one line when it is missing."""
    from specs.errors import TorchMissingError

    try:
        import torch  # noqa: F401
    except ImportError:
        raise TorchMissingError(f"`hetplan {command}`") from None


# ---- printing ---------------------------------------------------------------------------------------------------
PIPED_WIDTH_COLUMNS = 10_000  # tables take their natural width (none expands), lines are never wrapped


def show(as_json: bool, body: Any, *renderables: Any) -> None:
    """What a command found: its JSON body (indented, alone on stdout) with --json, else its tables and lines (rich
    markup): on a terminal at least 100 columns wide; piped or written to a file, each table at its own width and
    each line whole (rich's 80 columns would cut a table's cells and wrap lines that grep should find whole)."""
    from rich.console import Console

    said.flush()
    if as_json:
        sys.stdout.write(json.dumps(body, indent=2) + "\n")
        return
    terminal = Console()
    console = Console(width=max(100, terminal.width) if terminal.is_terminal else PIPED_WIDTH_COLUMNS)
    for renderable in renderables:
        console.print(renderable)


def written(what: str, path: Path | None) -> list[str]:
    """'<what> written to <path>' when a file was asked for."""
    return [] if path is None else [f"{what} written to {path}"]


def progress_on_stderr(task: str, quiet: bool, unit: str = "") -> Progress:
    """Progress of a long command on stderr (see report.progress)."""
    from report.progress import Progress

    return Progress(task, quiet=quiet, unit=unit)
