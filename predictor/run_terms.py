"""A run's step split into the cost model's terms, per stage: as predicted (here, from the prediction's context and
evaluation) and as measured (runtime/launch.py, from every rank's timers), side by side, so each disagreement between
a run and its prediction has an address (a stage and a term) rather than only a total.

Per stage and iteration, in seconds: `forward` and `backward` (the stage's layers over its replica's micro-batches,
speed emulation included, TP collectives not), `tp_comm` (the TP collectives: the runtime times its all-reduces),
`pipeline_wait` (bubble and point-to-point: the pipeline's
time the stage does not compute), `dp_sync` (the gradient reduction after the flush, across families too, with the
wait for a slower family), `optimizer` (with ZeRO 1/2's weight gather after it, which the runtime times with the
step), and `other` (predicted: the calibrated fixed cost per iteration and, on a
profiled host, making the step's batch (predictor/host.py); measured: the rest of the step, i.e. framework overhead
such as making and slicing the batch, gradient flattening, send completion). A profiled host's overhead of running a
stage's layers as one module is part of `forward` and `backward`, as the runtime's timers see it. Each stage's
terms add up to its `step`; the iteration is the slowest stage's step. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from predictor.cost_model import CostContext, Evaluation
from predictor.host import on_host, step_overhead_s

TERMS = ("forward", "backward", "tp_comm", "pipeline_wait", "dp_sync", "optimizer", "other")


def predicted_stage_terms(ctx: CostContext, evaluation: Evaluation) -> list[dict[str, Any]]:
    """The cost model's terms of every stage (family, stage index, group, terms, step), in evaluation order."""
    strategy = evaluation.strategy
    # the layer costs as evaluate used them: a CP rank's own, stretched on a shared host
    ctx = on_host(ctx.at_context_parallel(strategy.context_parallel), evaluation)
    per_step = ctx.terms.iteration_overhead_s + step_overhead_s(ctx, strategy)
    out = []
    for family, pipeline in enumerate(strategy.pipelines):
        members = [s for s in evaluation.stages if s.family == family]
        m, b, p = pipeline.num_microbatches, pipeline.micro_batch_size, len(pipeline.stages)
        family_s = evaluation.family_pipeline_s[family] if evaluation.family_pipeline_s else evaluation.pipeline_time_s
        for index, evaluated in enumerate(members):
            stage = evaluated.stage
            source = ctx.source(stage.group)
            decoder = source.layer_cost("decoder", b, stage.tp, strategy.stage_recompute(stage))
            forward, backward = stage.num_layers * decoder.forward_time_s, stage.num_layers * decoder.backward_time_s
            for layer, present in (("embedding", index == 0), ("lm_head", index == p - 1)):
                if present:
                    edge = source.layer_cost(layer, b, stage.tp, "none")
                    forward, backward = forward + edge.forward_time_s, backward + edge.backward_time_s
            if forward + backward > 0:  # the stage overhead, shared as the layers' time is
                share = forward / (forward + backward)
                forward += share * evaluated.overhead_time_s
                backward += (1 - share) * evaluated.overhead_time_s
            compute = evaluated.compute_time_s - evaluated.sharded_exposed_time_s
            terms = {
                "forward": m * forward,
                "backward": m * backward,
                "tp_comm": m * max(0.0, compute - forward - backward),
                "pipeline_wait": family_s - m * evaluated.compute_time_s,
                "dp_sync": evaluated.dp_exposed_time_s
                - evaluated.gather_exposed_time_s
                + m * evaluated.sharded_exposed_time_s
                + (evaluation.pipeline_time_s - family_s),
                "optimizer": evaluated.optimizer_time_s + evaluated.gather_exposed_time_s,
                "other": per_step,
            }
            out.append(
                {"family": family, "stage": index, "group": stage.group, "terms": terms, "step": sum(terms.values())}
            )
    return out


def side_by_side(
    measured: Sequence[Mapping[str, Any]],
    predicted: Sequence[Mapping[str, Any]],
    simulated: Mapping[str, Any] | None = None,
) -> list[dict]:
    """Per stage: each term measured and predicted (None where the runtime does not time it apart), and the step;
    the measured rank's CPU time beside the CPU time the step simulation gives a process of its replica (`simulated`:
    the run record's predicted timeline; None without one, or for records that did not say the rank's replica)."""
    by_stage = {(p["family"], p["stage"]): p for p in predicted}
    simulated_cpu = {
        (a["family"], a["stage"], a["replica"]): a.get("cpu_s") for a in (simulated or {}).get("actors", [])
    }
    rows = []
    for stage in measured:
        expected = by_stage.get((stage["family"], stage["stage"]))
        if expected is None:
            continue
        terms = {
            term: {"measured_s": stage["terms"].get(term), "predicted_s": expected["terms"][term]} for term in TERMS
        }
        rows.append(
            {
                "family": stage["family"],
                "stage": stage["stage"],
                "group": stage["group"],
                "rank": stage["rank"],
                "terms": terms,
                "step": {"measured_s": stage["step_s"], "predicted_s": expected["step"]},
                "cpu_s": stage.get("cpu_s"),  # measured CPU time of the step and of its waiting terms, if timed
                "predicted_cpu_s": simulated_cpu.get((stage["family"], stage["stage"], stage.get("replica"))),
            }
        )
    return rows
