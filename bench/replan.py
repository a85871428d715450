"""Re-planning the 768-device example after losing (or gaining) capacity: time to the new plan, warm-started from
the old one (its families shrunk), against a cold search; whether families are kept, and why the old plan could not
be shrunk where it could not; table + bench/results/replan.json.

Run: python bench/replan.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner import plan  # noqa: E402
from planner.replan import changed_cluster, replan  # noqa: E402
from planner.search import search  # noqa: E402
from predictor.predictor import default_predictor  # noqa: E402
from specs import load_cluster, load_model, load_training  # noqa: E402

CHANGES = (
    (["node:ascend/17"], []),
    (["node:amd/0"], []),
    (["group:ascend:8"], []),
    ([], ["group:ascend:2"]),
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cluster = load_cluster(ROOT / "examples" / "hethub-768.yaml")
    model = load_model("llama-140b")
    training = load_training(ROOT / "examples" / "training" / "hethub-140b.yaml")
    predictor = default_predictor()
    old = plan(cluster, model, training, predictor=predictor)
    uneven = training.model_copy(update={"uneven_batch": "exhaustive"})  # what replan searches
    rows = []
    header = f"{'change':<22} {'devices':>8} {'warm s':>8} {'cold s':>8} {'old shrunk tok/s':>17} "
    header += f"{'new tok/s':>10} {'change':>8} {'fam':>4}"
    print(f"hethub-768 / llama-140b: {old.evaluation.tokens_per_s:,.0f} tokens/s before")
    print(header)
    print("-" * len(header))
    for without, add in CHANGES:
        changed = changed_cluster(cluster, without, add)
        warm, cold = [], []
        for _ in range(args.repeats):
            result = replan(changed, model, training, old.strategy, predictor, old.context)
            warm.append(result.replan_time_s)
            started = time.perf_counter()
            search(predictor.context(changed, model, uneven))  # the same space, no warm start
            cold.append(time.perf_counter() - started)
        new = result.plan.evaluation
        row = {
            "change": " ".join([f"-{w}" for w in without] + [f"+{a}" for a in add]),
            "devices": changed.num_devices,
            "warm_replan_s": statistics.median(warm),
            "cold_search_s": statistics.median(cold),
            "old_plan_shrunk_tokens_per_s": result.adapted.tokens_per_s if result.adapted else None,
            "not_shrunk_because": result.not_adapted,
            "new_tokens_per_s": new.tokens_per_s,
            "throughput_change": new.tokens_per_s / old.evaluation.tokens_per_s - 1,
            "families_before": len(old.strategy.pipelines),
            "families_after": len(new.strategy.pipelines),
        }
        rows.append(row)
        shrunk = f"{row['old_plan_shrunk_tokens_per_s']:,.0f}" if result.adapted else "does not run"
        print(
            f"{row['change']:<22} {row['devices']:>8} {row['warm_replan_s']:>8.2f} {row['cold_search_s']:>8.2f} "
            f"{shrunk:>17} {row['new_tokens_per_s']:>10,.0f} {row['throughput_change']:>+8.1%} "
            f"{row['families_after']:>4}"
        )
        if result.not_adapted:
            print(f"  old plan not shrunk: {result.not_adapted}")
    out = ROOT / "bench" / "results" / "replan.json"
    out.write_text(json.dumps({"before_tokens_per_s": old.evaluation.tokens_per_s, "rows": rows}, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
