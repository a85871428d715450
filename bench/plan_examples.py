"""Plan every bundled example and print search time and plan quality (table + bench/results/plan_examples.json).

Run: python bench/plan_examples.py [--families off|auto|search]   (make bench runs the default, auto)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner import plan  # noqa: E402
from planner.plan import describe_strategy  # noqa: E402
from specs import load_cluster, load_model, load_training  # noqa: E402

CASES = [
    # (cluster file, model, training overrides)
    ("hethub-768.yaml", "llama-140b", {"training_file": "training/hethub-140b.yaml"}),
    ("hethub-768.yaml", "llama2-70b", {"global_batch_size": 1024}),
    ("a100-v100-32.yaml", "gpt3-6.7b", {"dtype": "fp16", "global_batch_size": 256}),
    ("a100-v100-32.yaml", "llama2-13b", {"dtype": "fp16", "global_batch_size": 256}),
    ("four-vendor-256.yaml", "llama3-70b", {"global_batch_size": 512}),
    ("four-vendor-256.yaml", "gpt3-175b", {"global_batch_size": 1536}),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--families", choices=("off", "auto", "search"), default="auto", help="see TrainingSpec.families"
    )
    args = parser.parse_args()
    rows = []
    for cluster_file, model_key, options in CASES:
        options = {**options, "families": args.families}
        training_file = options.pop("training_file", None)
        training = load_training(ROOT / "examples" / training_file if training_file else None, options)
        cluster = load_cluster(ROOT / "examples" / cluster_file)
        started = time.perf_counter()
        result = plan(cluster, load_model(model_key), training)
        wall_s = time.perf_counter() - started
        body = result.to_dict()
        rows.append(
            {
                "cluster": cluster.name,
                "devices": cluster.num_devices,
                "model": model_key,
                "global_batch_size": training.global_batch_size,
                "search_time_s": body["search_time_s"],
                "plan_wall_time_s": round(wall_s, 3),
                "configurations": body["search"]["configurations"],
                "families": len(result.strategy.pipelines),
                "evaluated": body["search"]["evaluated"],
                "iteration_time_s": body["iteration_time_s"],
                "tokens_per_s": body["tokens_per_s"],
                "mfu": body["mfu"],
                "fraction_of_upper_bound": body["fraction_of_upper_bound"],
                "fraction_of_compute_bound": body["fraction_of_compute_bound"],
                "upper_bound_scaled_groups": body["upper_bound_scaled_groups"],
                "strategy": describe_strategy(result.strategy),
                "search_note": body["search"].get("note", ""),  # e.g. the candidate budget it stopped at
            }
        )
    header = (
        f"{'cluster':<16} {'dev':>5} {'model':<11} {'search s':>8} {'total s':>7} {'evald':>6} "
        f"{'iter s':>7} {'MFU':>6} {'of UB':>6} {'of CB':>6} {'fam':>3}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['cluster']:<16} {r['devices']:>5} {r['model']:<11} {r['search_time_s']:>8.2f} "
            f"{r['plan_wall_time_s']:>7.2f} {r['evaluated']:>6} {r['iteration_time_s']:>7.2f} {r['mfu']:>6.1%} "
            f"{r['fraction_of_upper_bound']:>6.1%} {r['fraction_of_compute_bound']:>6.1%} {r['families']:>3}"
        )
        if r["search_note"]:
            print(f"  search note: {r['search_note']}")
    for r in rows:
        print(
            f"  {r['cluster']} / {r['model']}: {r['strategy']}"
            + (
                f"  (upper bound scaled for: {', '.join(r['upper_bound_scaled_groups'])})"
                if r["upper_bound_scaled_groups"]
                else ""
            )
        )
    name = {"auto": "plan_examples", "search": "plan_examples_families", "off": "plan_examples_one_family"}
    out = ROOT / "bench" / "results" / f"{name[args.families]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"python": platform.python_version(), "machine": platform.machine(), "processor": platform.processor()}
    out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n", encoding="utf-8")
    print(f"written {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
