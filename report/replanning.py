"""What a re-plan changed: the old plan before, the old plan shrunk to the changed cluster (when it still runs) and
the new plan, with the throughput change. planner/replan.py does the planning; this says what came of it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from planner.plan import describe_strategy

if TYPE_CHECKING:
    from planner.replan import Replan
    from predictor.cost_model import Evaluation
    from specs.cluster import ClusterSpec


def _side(evaluation: Evaluation) -> dict[str, Any]:
    """One plan of the comparison: its strategy in a line, its time and throughput."""
    return {
        "summary": describe_strategy(evaluation.strategy),
        "iteration_time_s": evaluation.iteration_time_s,
        "tokens_per_s": evaluation.tokens_per_s,
    }


def replan_summary(before: ClusterSpec, after: ClusterSpec, old: Evaluation, result: Replan) -> dict[str, Any]:
    """The JSON body of `hetplan replan --json`: `old` is the old plan evaluated on the cluster `before` the change."""
    new = result.plan.evaluation
    return {
        "cluster_devices": {"before": before.num_devices, "after": after.num_devices},
        "old": _side(old),
        "old_adapted": _side(result.adapted) if result.adapted else None,
        "old_not_adapted": result.not_adapted if result.adapted is None else "",
        "old_adapted_engine_cannot_run": list(result.adapted_engine_lost),
        "new": _side(new),
        "throughput_change": new.tokens_per_s / old.tokens_per_s - 1,
        "replan_time_s": round(result.replan_time_s, 3),
        "warm_started": bool(result.plan.search_stats.get("warm_started")),
        "engine": result.plan.search_stats.get("engine"),
        "idle_note": result.plan.search_stats.get("idle_note"),
    }


def replan_lines(body: Mapping[str, Any], replan_time_s: float) -> list[str]:
    """The summary for the terminal (rich markup: plan summaries are escaped); the time unrounded."""
    old, adapted, new = body["old"], body["old_adapted"], body["new"]
    devices = body["cluster_devices"]
    lines = [
        f"cluster: {devices['before']} -> {devices['after']} devices",
        f"before:  {old['iteration_time_s']:.3f} s, {old['tokens_per_s']:,.0f} tokens/s",
        f"         {escape(old['summary'])}",
    ]
    if adapted is not None:
        lines.append(
            f"old plan shrunk to fit: {adapted['iteration_time_s']:.3f} s, {adapted['tokens_per_s']:,.0f} "
            f"tokens/s  {escape(adapted['summary'])}"
        )
        if body.get("old_adapted_engine_cannot_run"):
            cannot = "; ".join(body["old_adapted_engine_cannot_run"])
            lines.append(f"         which {body.get('engine')} cannot run as shrunk: {escape(cannot)}")
    else:
        why = body.get("old_not_adapted")
        lines.append(f"old plan shrunk to fit: cannot run on the changed cluster{': ' + escape(why) if why else ''}")
    lines += [
        f"after:   {new['iteration_time_s']:.3f} s, {new['tokens_per_s']:,.0f} tokens/s",
        f"         {escape(new['summary'])}",
        f"throughput {body['throughput_change']:+.1%}; re-planned in {replan_time_s:.2f} s"
        f"{' (warm-started from the old plan)' if body['warm_started'] else ''}",
    ]
    if body.get("engine"):
        engine = body["engine"]
        lines.append(f"kept to what {engine} runs as planned (the plan was made with --engine {engine})")
    if body.get("idle_note"):
        lines.append(f"idle: {body['idle_note']}")
    return lines
