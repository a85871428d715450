"""`traffic` and `traffic_calc`: what a plan sends over the network, by parallel dimension and link class, and
whether a rail-only fabric can carry it. predictor/traffic.py counts the bytes; this summarises and draws them."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from predictor.cost_model import build_context
from predictor.traffic import DIMENSIONS, DP_PARTS, Traffic, strategy_traffic, textbook_traffic_per_rank
from report.figures import traffic_heatmap
from specs.errors import SpecError

if TYPE_CHECKING:
    from planner.plan import LoadedPlan
    from specs.cluster import ClusterSpec
    from specs.model import ModelSpec


@dataclass(frozen=True)
class RailOnly:
    """Whether every cross-node byte stays on one rail (same local rank), and what breaks it when not."""

    spine_bytes: dict[str, float]  # by dimension, per iteration
    groups_breaking_it: list[str]
    relay_bytes_worst_device: float  # what one device relays over its in-node link on a rail-only fabric

    @property
    def ok(self) -> bool:
        """No byte needs the spine."""
        return not any(self.spine_bytes.values())

    def to_dict(self) -> dict[str, Any]:
        """The `rail_only` part of the `traffic --json` body (bytes rounded to whole bytes)."""
        return {
            "ok": self.ok,
            "spine_bytes_per_iteration": {d: round(v) for d, v in self.spine_bytes.items()},
            "groups_breaking_it": self.groups_breaking_it,
            "relay_bytes_per_iteration_worst_device": round(self.relay_bytes_worst_device),
        }

    def sentence(self) -> str:
        """The verdict in one sentence for the terminal."""
        if self.ok:
            return "rail-only: ok, every cross-node byte stays on one rail (same local rank)"
        return (
            f"rail-only: NO, {sum(self.spine_bytes.values()) / 1e9:,.1f} GB per iteration cross nodes off-rail "
            f"(groups {', '.join(self.groups_breaking_it)}); on a rail-only fabric they are relayed through the node "
            f"(worst device relays {self.relay_bytes_worst_device / 1e9:,.2f} GB per iteration over its in-node link)"
        )


def rail_only(traffic: Traffic) -> RailOnly:
    """Check a plan's traffic against a rail-only fabric: the off-rail (spine) bytes by dimension, the groups whose
    devices send them, and the most one device sends off-rail in one dimension (it would relay that in-node)."""
    breaking: set[str] = set()
    sent: dict[tuple[int, str], float] = defaultdict(float)
    for d in DIMENSIONS:
        for (src, dst), size in traffic.pairs[d].items():
            if traffic.link_class(src, dst) == "spine":
                breaking.add(traffic.group_of[src])
                sent[src, d] += size
    return RailOnly(traffic.spine_pairs(), sorted(breaking), max(sent.values(), default=0.0))


@dataclass(frozen=True)
class TrafficReport:
    """A plan's bytes per iteration by dimension and link class, over a training run when its tokens are given."""

    plan: str
    traffic: Traffic
    by_dimension_and_link: dict[str, dict[str, float]]  # bytes per iteration
    iterations: int | None
    rail: RailOnly
    png: Path | None = None

    def dp_parts_lines(self) -> list[str]:
        """What of the dp row is not the replicas' sync (a plan of one replica may still send it)."""
        from report.tables import bytes_text

        words = {"tied embedding": "the tied embedding's sum", "across families": "across pipeline families"}
        sizes = self.traffic.dp_parts
        parts = [f"{bytes_text(sizes[part])} of it {words[part]}" for part in DP_PARTS if sizes[part] > 0]
        return [f"dp is every gradient sync: {', '.join(parts)} per iteration"] if parts else []

    def to_dict(self) -> dict[str, Any]:
        """The JSON body of `hetplan traffic --json`."""
        table = self.by_dimension_and_link
        iterations = self.iterations
        body: dict[str, Any] = {
            "plan": self.plan,
            "bytes_per_iteration": {d: {k: round(v) for k, v in table[d].items()} for d in DIMENSIONS},
            "total_bytes_per_iteration": round(self.traffic.total_bytes()),
            "iterations": iterations,
            "bytes_total": (
                {d: {k: round(v * iterations) for k, v in table[d].items()} for d in DIMENSIONS} if iterations else None
            ),
            "rail_only": self.rail.to_dict(),
            "dp_bytes_per_iteration_of": {part: round(size) for part, size in self.traffic.dp_parts.items()},
        }
        if self.png is not None:
            body["png"] = str(self.png)
        return body


def traffic(
    plan: LoadedPlan,
    cluster: ClusterSpec,
    tokens: float | None = None,
    epochs: float = 1.0,
    png: Path | None = None,
) -> TrafficReport:
    """Count one iteration of `plan` on `cluster` (iterations over `epochs` of `tokens` when given), check it
    against a rail-only fabric and draw the per-pair heatmap to `png` when given."""
    ctx = build_context(cluster, plan.model, plan.training)
    counted = strategy_traffic(ctx, plan.strategy)
    tokens_per_iteration = ctx.training.global_batch_size * ctx.seq_length
    # training takes whole iterations: a part of one sends as much
    iterations = math.ceil(round(epochs * tokens / tokens_per_iteration, 9)) if tokens else None
    if png is not None:
        traffic_heatmap(counted, f"{plan.model.key} on {cluster.name}: bytes per iteration", png)
    table = counted.by_dimension_and_link()
    return TrafficReport(plan.source, counted, table, iterations, rail_only(counted), png)


def check_grad_bytes(grad_bytes: object, source: str = "traffic_calc()", field: str = "grad_bytes") -> None:
    """The bytes of a gradient value the DP all-reduce sends: an FP8, 16-bit or fp32 value (3 was taken)."""
    if grad_bytes not in (1, 2, 4) or isinstance(grad_bytes, bool):
        raise SpecError(source, field, f"expected 1 (FP8), 2 (bf16/fp16) or 4 (fp32), got {grad_bytes!r}")


def traffic_calc(
    model: ModelSpec,
    tokens: float,
    global_batch: int,
    gpus: int,
    seq_length: int | None = None,
    grad_bytes: int = 2,
) -> dict[str, Any]:
    """Textbook per-rank bytes of DP, FSDP, TP and PP over `tokens` of training with one parallel dimension of
    `gpus` ranks (standard ring volumes): the JSON body of `hetplan traffic-calc --json`."""
    check_grad_bytes(grad_bytes)
    seq = seq_length or model.seq_length
    steps = math.ceil(round(tokens / (global_batch * seq), 9))  # whole steps: a part of one syncs as much
    per_rank = textbook_traffic_per_rank(
        params=model.total_params(),
        layers=model.num_layers,
        hidden_size=model.hidden_size,
        tokens=steps * global_batch * seq,
        global_batch_tokens=global_batch * seq,
        ranks=gpus,
        grad_bytes=grad_bytes,
    )
    beyond = textbook_beyond_model(model, global_batch, gpus)
    return {
        "model": model.key,
        "params": model.total_params(),
        "tokens": tokens,
        "steps": steps,
        "ranks": gpus,
        "bytes_per_rank": {name: None if name in beyond else value for name, value in per_rank.items()},
        "not_applicable": beyond,
    }


def textbook_beyond_model(model: ModelSpec, global_batch: int, gpus: int) -> dict[str, str]:
    """Why a parallel style cannot have `gpus` ranks for this model and batch, by style: a rank of DP or FSDP needs a
    sequence of the batch, a TP degree must split the kv heads and the FFN, a pipeline stage needs a layer."""
    beyond = {}
    if gpus > global_batch:
        for style in ("dp", "fsdp"):
            beyond[style] = f"{gpus} ranks, a global batch of {global_batch} sequences: a rank would have none"
    if not model.splits_for_tp(gpus):
        beyond["tp"] = f"TP {gpus} does not split {model.unsplit_by_tp(gpus)} into equal parts"
    if gpus > model.num_layers:
        beyond["pp"] = f"{gpus} stages of {model.num_layers} layers: a stage would have none"
    return beyond
