"""The cost of running a plan on an engine that cannot express all of it: for every bundled example's default plan and
every export format, the plan's predicted iteration time, the exported (closest runnable) plan's, and what was lost
(table + bench/results/export_cost.json). Also the engine x capability table of specs/catalog/engines.yaml.

Run: python bench/export_cost.py
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner import plan  # noqa: E402
from planner.export import export_plan  # noqa: E402
from predictor.predictor import default_predictor  # noqa: E402
from specs import engine_catalog, load_cluster, load_model, load_training  # noqa: E402

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
    "mixed_vendors": "mixed vendors",
    "tensor_parallel": "TP at all",
}


def capability_table() -> list[str]:
    """Markdown: one row per engine, a column per capability flag."""
    engines = engine_catalog()
    lines = ["| engine | " + " | ".join(CAPABILITIES.values()) + " |", "|---" * (len(CAPABILITIES) + 1) + "|"]
    for key, engine in engines.items():
        marks = ["yes" if getattr(engine, flag) else "no" for flag in CAPABILITIES]
        lines.append(f"| {key} | " + " | ".join(marks) + " |")
    return lines


def main() -> None:
    rows = []
    for cluster_file, model_key, options in CASES:
        options = dict(options)
        training_file = options.pop("training_file", None)
        training = load_training(ROOT / "examples" / training_file if training_file else None, options)
        cluster, model = load_cluster(ROOT / "examples" / cluster_file), load_model(model_key)
        planned = plan(cluster, model, training)
        ctx = default_predictor().context(cluster, model, training)
        for fmt in engine_catalog():
            started = time.perf_counter()
            exported = export_plan(ctx, planned.strategy, fmt)
            rows.append(
                {
                    "cluster": cluster.name,
                    "model": model.key,
                    "format": fmt,
                    "plan_iteration_time_s": exported.plan_iteration_time_s,
                    "exported_iteration_time_s": exported.predicted_iteration_time_s,
                    "slowdown": exported.summary()["slowdown"],
                    "lost": exported.lost,
                    "export_time_s": time.perf_counter() - started,
                }
            )
    header = f"{'cluster':<16} {'model':<11} {'format':<10} {'plan s':>8} {'export s':>9} {'cost':>8}  lost"
    print(header)
    for row in rows:
        lost = "; ".join(item.split(" -> ")[0] for item in row["lost"]) or "-"
        print(
            f"{row['cluster']:<16} {row['model']:<11} {row['format']:<10} {row['plan_iteration_time_s']:>8.3f} "
            f"{row['exported_iteration_time_s']:>9.3f} {row['slowdown']:>+8.1%}  {lost}"
        )
    print()
    print("\n".join(capability_table()))
    out = ROOT / "bench" / "results" / "export_cost.json"
    body = {"machine": platform.node(), "capabilities": capability_table(), "rows": rows}
    out.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    print(f"\nwritten to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
