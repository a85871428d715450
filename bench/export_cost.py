"""The cost of running a plan on an engine that cannot express all of it: for every bundled example's default plan and
every export format, the plan's predicted iteration time, the exported (closest runnable) plan's, what was lost, and
the plan searched for that engine (`plan --engine`: its time, its search time, and that its export loses nothing)
(table + bench/results/export_cost.json). Also the engine x capability table of specs/catalog/engines.yaml.
The engine's plan and the export are predicted with the training's own kernels (training.engine kept), so the columns
compare the layouts alone; `plan --engine` without a training engine, and `hetplan export` of a plan not made for the
engine, predict with the engine's kernels (DeepSpeed's run the h100-mi300x export 5% slower). An engine that trains in
another dtype (torchtitan: fp16 -> fp32) has the export chosen and predicted in that dtype, as `hetplan export` does.

Run: python bench/export_cost.py
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner import plan  # noqa: E402
from planner.export import export_plan  # noqa: E402
from predictor.context import CostContext  # noqa: E402
from predictor.predictor import default_predictor  # noqa: E402
from specs import engine_catalog, load_cluster, load_model, load_training  # noqa: E402
from specs.cluster import ClusterSpec  # noqa: E402
from specs.model import ModelSpec  # noqa: E402
from specs.training import TrainingSpec  # noqa: E402

KERNELS = "megatron"  # every plan's and export's, whatever the engine runs
CASES = [
    # (cluster file, model, training file or overrides)
    ("hethub-768.yaml", "llama-140b", {"training_file": "training/hethub-140b.yaml"}),
    ("h100-mi300x.yaml", "llama3-70b", {}),
    ("a100-v100-32.yaml", "gpt3-6.7b", {"dtype": "fp16", "global_batch_size": 256}),
    ("four-vendor-256.yaml", "llama3-70b", {"global_batch_size": 512}),
]
CAPABILITIES = {
    "uneven_layers": "uneven layers",
    "per_stage_tp": "per-stage TP",
    "pipeline_families": "families",
    "uneven_batch": "uneven batches",
    "interleaving": "interleaving",
    "per_stage_recompute": "per-stage recompute",
    "recompute_modes": "recompute",
    "mixed_vendors": "mixed vendors",
    "tensor_parallel": "TP at all",
    "zero_stages": "ZeRO stages",
    "fp8": "FP8",
    "fp16": "fp16",
    "context_parallel": "CP",
}


def _mark(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return ", ".join(str(v) for v in value)  # type: ignore[attr-defined]


def capability_table() -> list[str]:
    """Markdown: one row per engine, a column per capability flag."""
    engines = engine_catalog()
    lines = ["| engine | " + " | ".join(CAPABILITIES.values()) + " |", "|---" * (len(CAPABILITIES) + 1) + "|"]
    for key, engine in engines.items():
        marks = [_mark(getattr(engine, flag)) for flag in CAPABILITIES]
        lines.append(f"| {key} | " + " | ".join(marks) + " |")
    return lines


def costs_for(cluster: ClusterSpec, model: ModelSpec) -> Callable[[TrainingSpec], CostContext]:
    """The plan's costs for another training (an engine that trains in another dtype), as `hetplan export` has them,
    with the plan's kernels (the layouts alone are compared)."""
    return lambda training: default_predictor().context(cluster, model, training.model_copy(update={"engine": KERNELS}))


def main() -> None:
    rows = []
    for cluster_file, model_key, options in CASES:
        options = dict(options)
        training_file = options.pop("training_file", None)
        options["engine"] = KERNELS  # named, so `plan --engine` keeps the kernels (see the docstring)
        training = load_training(ROOT / "examples" / training_file if training_file else None, options)
        cluster, model = load_cluster(ROOT / "examples" / cluster_file), load_model(model_key)
        planned = plan(cluster, model, training)
        ctx = default_predictor().context(cluster, model, training)
        for fmt, engine in engine_catalog().items():
            started = time.perf_counter()
            exported = export_plan(ctx, planned.strategy, fmt, context_for=costs_for(cluster, model))
            export_time_s = time.perf_counter() - started
            for_engine = plan(cluster, model, training, engine=engine)
            its_export = export_plan(for_engine.context, for_engine.strategy, fmt)
            rows.append(
                {
                    "cluster": cluster.name,
                    "model": model.key,
                    "format": fmt,
                    "plan_iteration_time_s": exported.plan_iteration_time_s,
                    "exported_iteration_time_s": exported.predicted_iteration_time_s,
                    "slowdown": exported.summary()["slowdown"],
                    "lost": exported.lost,
                    "export_time_s": export_time_s,
                    "engine_plan_iteration_time_s": for_engine.evaluation.iteration_time_s,
                    "engine_plan_search_time_s": for_engine.search_time_s,
                    "engine_plan_export_lost": its_export.lost,
                }
            )
    header = (
        f"{'cluster':<16} {'model':<11} {'format':<10} {'plan s':>8} {'export s':>9} {'cost':>8} "
        f"{'--engine s':>10} {'cost':>7} {'search s':>8}  lost by the export"
    )
    print(header)
    for row in rows:
        lost = "; ".join(item.split(" -> ")[0] for item in row["lost"]) or "-"
        engine_cost = row["engine_plan_iteration_time_s"] / row["plan_iteration_time_s"] - 1
        assert not row["engine_plan_export_lost"], row  # a plan for the engine exports as planned
        print(
            f"{row['cluster']:<16} {row['model']:<11} {row['format']:<10} {row['plan_iteration_time_s']:>8.3f} "
            f"{row['exported_iteration_time_s']:>9.3f} {row['slowdown']:>+8.1%} "
            f"{row['engine_plan_iteration_time_s']:>10.3f} {engine_cost:>+7.1%} "
            f"{row['engine_plan_search_time_s']:>8.2f}  {lost}"
        )
    print()
    print("\n".join(capability_table()))
    out = ROOT / "bench" / "results" / "export_cost.json"
    body = {"machine": platform.node(), "capabilities": capability_table(), "rows": rows}
    out.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    print(f"\nwritten to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
