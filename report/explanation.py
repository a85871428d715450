"""`explain`: a plan's pipeline schedule, memory per stage and bottleneck in words, optionally as a PNG and a
self-contained HTML report. The schedule and the words come from predictor/schedule.py; this draws and assembles."""

from __future__ import annotations

import base64
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from predictor.schedule import Block, bottleneck_words, layout_words, pipeline_timeline, stage_label
from report.figures import explain_figure
from specs.outputs import write_text_atomic

if TYPE_CHECKING:
    from planner.plan import LoadedPlan
    from predictor.cost_model import CostContext, Evaluation
    from predictor.predictor import Predictor
    from profiler.profile import DeviceProfile
    from specs.cluster import ClusterSpec


@dataclass(frozen=True)
class Explanation:
    """What `explain` found: the evaluation, its timeline, a title, the bottleneck in words and the files written."""

    context: CostContext
    evaluation: Evaluation
    blocks: list[Block]
    title: str
    bottleneck: list[str]
    png: Path | None = None
    html: Path | None = None

    @property
    def flush_s(self) -> float:
        """When the last forward or backward of the drawn schedule ends (before DP sync and the optimizer)."""
        return max(b.end_s for b in self.blocks if b.kind in ("forward", "backward"))

    def to_dict(self) -> dict[str, Any]:
        """The JSON body of `hetplan explain --json`."""
        return {
            "iteration_time_s": self.evaluation.iteration_time_s,
            "flush_s": self.flush_s,
            "bottleneck": self.bottleneck,
            "png": str(self.png) if self.png else None,
            "html": str(self.html) if self.html else None,
            "cost_source": dict(self.context.cost_source) if self.context.cost_source else None,
        }


def explain(
    plan: LoadedPlan,
    cluster: ClusterSpec,
    predictor: Predictor | None = None,
    png: Path | None = None,
    html: Path | None = None,
    progress: Callable[[str, int], None] | None = None,
    profiles: Mapping[str, DeviceProfile] | None = None,
) -> Explanation:
    """Evaluate `plan` on `cluster` (the shipped predictor unless one is given), lay out its schedule and say what
    bounds it; write the picture to `png` and the HTML report (picture embedded) to `html` when given.
    `progress(what, steps)` hears each step as it starts; `profiles`: measured profiles by device key (the plan's,
    as it records them: planner.cost_source)."""
    from planner import predict  # here, not above: the planner loads OR-Tools (a second), `traffic` needs none of it
    from predictor.predictor import default_predictor

    steps = 2 + (png is not None) + (html is not None)
    step = progress or (lambda what, total: None)
    step("evaluating the plan", steps)
    ctx = (predictor or default_predictor()).context(cluster, plan.model, plan.training, profiles)
    evaluation = predict(ctx, plan.strategy, plan.source)
    step("laying out the schedule", steps)
    blocks = pipeline_timeline(ctx, evaluation)
    words = bottleneck_words(ctx, evaluation) + layout_words(ctx, evaluation)
    if evaluation.strategy.virtual_stages > 1:
        words.append(_interleaving_words(evaluation, blocks))
    title = f"{plan.model.key} on {cluster.name}: one iteration, {evaluation.iteration_time_s:.3f} s predicted"
    result = Explanation(ctx, evaluation, blocks, title, words, png, html)
    if png is not None:
        step("drawing the picture", steps)
        explain_figure(evaluation, blocks, title, png)
    if html is not None:
        step("writing the report", steps)
        write_html(result, html)
    return result


def _interleaving_words(evaluation: Evaluation, blocks: list[Block]) -> str:
    """How far the drawn interleaved schedule is from the cost model's closed form (they are computed apart)."""
    drawn = max(b.end_s for b in blocks if b.kind in ("forward", "backward"))
    return (
        f"Interleaved 1F1B (v={evaluation.strategy.virtual_stages}, Megatron's order) is drawn chunk by chunk: "
        f"its pipeline ends at {drawn:.3f} s, the cost model's closed form says {evaluation.pipeline_time_s:.3f} s "
        f"({drawn / evaluation.pipeline_time_s - 1:+.1%})."
    )


def write_html(explanation: Explanation, path: Path) -> None:
    """A self-contained HTML report: title, bottleneck words, the picture inline (base64) and the stage table.
    Reuses the PNG when one was written, else draws it into a temporary file."""
    if explanation.png is not None:
        picture = explanation.png.read_bytes()
    else:
        with tempfile.TemporaryDirectory() as scratch:
            drawn = Path(scratch) / "explain.png"
            explain_figure(explanation.evaluation, explanation.blocks, explanation.title, drawn)
            picture = drawn.read_bytes()
    write_text_atomic(path, html_report(explanation, base64.b64encode(picture).decode()))


def html_report(explanation: Explanation, png_base64: str) -> str:
    """The HTML text of the report around an already encoded PNG."""
    evaluation = explanation.evaluation
    rows = "".join(
        f"<tr><td>{stage_label(evaluation, i)}</td><td>{s.stage.group}</td>"
        f"<td>{s.stage.layer_start}-{s.stage.layer_end - 1}</td>"
        f"<td>{s.stage.tp}</td><td>{s.compute_time_s * 1e3:.1f}</td><td>{s.memory.total_bytes / 2**30:.1f}</td>"
        f"<td>{s.memory_usable_bytes / 2**30:.1f}</td></tr>"
        for i, s in enumerate(evaluation.stages)
    )
    words = "".join(f"<li>{w}</li>" for w in explanation.bottleneck)
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>hetplan explain</title></head><body>"
        f"<h1>{explanation.title}</h1><ul>{words}</ul>"
        f"<img alt='schedule and memory' src='data:image/png;base64,{png_base64}'>"
        "<table border='1'><tr><th>stage</th><th>group</th><th>layers</th><th>tp</th><th>fwd+bwd/mb ms</th>"
        f"<th>memory GiB</th><th>usable GiB</th></tr>{rows}</table></body></html>\n"
    )
