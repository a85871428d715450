"""What each parallel option buys (issue 19's table): Llama-3-70B on examples/h100-mi300x-a100.yaml (H100 and MI300X
with FP8, A100 without) at 8K and 32K tokens per sequence (4M tokens per iteration either way), planned with the
training's defaults without context parallelism (ZeRO-1, bf16, one family searched where the cluster has two
groups: here none), then with one
option added at a time and all together: the ZeRO stage searched (0-3), FP8 where devices have it, pipeline families
searched, context parallelism searched (CP 1, 2, 4, 8; by default the planner searches it from 16K tokens).
Table + bench/results/parallel_options.json.

Run: python bench/parallel_options.py
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner import plan  # noqa: E402
from planner.plan import describe_strategy  # noqa: E402
from specs import load_cluster, load_model, load_training  # noqa: E402
from specs.errors import DoesNotFitError  # noqa: E402

CLUSTER, MODEL = "h100-mi300x-a100.yaml", "llama3-70b"
TOKENS_PER_ITERATION = 4 * 1024 * 1024
SEQUENCES = (8192, 32768)
NO_CP: dict[str, Any] = {"context_parallel": [1]}
CP_SEARCHED: dict[str, Any] = {"context_parallel": [1, 2, 4, 8]}
OPTIONS: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {
    # name: (training overrides, ZeRO stages searched)
    "defaults (ZeRO-1, bf16, no CP)": (NO_CP, ()),
    "+ ZeRO stage searched": (NO_CP, (0, 1, 2, 3)),
    "+ FP8": (NO_CP | {"dtype": "fp8"}, ()),
    "+ families searched": (NO_CP | {"families": "search"}, ()),
    "+ context parallel searched": (CP_SEARCHED, ()),
    "all of them": (CP_SEARCHED | {"dtype": "fp8", "families": "search"}, (0, 1, 2, 3)),
}


def main() -> None:
    cluster, model = load_cluster(ROOT / "examples" / CLUSTER), load_model(MODEL)
    rows = []
    for seq in SEQUENCES:
        base: dict[str, Any] = {"seq_length": seq, "global_batch_size": TOKENS_PER_ITERATION // seq}
        baseline_s = None
        for name, (overrides, zero_stages) in OPTIONS.items():
            started = time.perf_counter()
            try:
                planned = plan(cluster, model, load_training(overrides=base | overrides), zero_stages=zero_stages)
            except DoesNotFitError as err:
                rows.append({"seq_length": seq, "option": name, "fits": False, "reason": str(err)})
                continue
            elapsed = time.perf_counter() - started
            time_s = planned.evaluation.iteration_time_s
            baseline_s = baseline_s or time_s
            rows.append(
                {
                    "seq_length": seq,
                    "option": name,
                    "fits": True,
                    "iteration_time_s": time_s,
                    "tokens_per_s": planned.evaluation.tokens_per_s,
                    "mfu": planned.evaluation.mfu,
                    "vs_defaults": baseline_s / time_s - 1,
                    "zero_stage": planned.strategy.zero_stage,
                    "zero": planned.strategy.zero_summary.removeprefix("ZeRO").replace("per family ", "").strip(" -"),
                    "zero_stages_s": planned.search_stats.get("zero_stages_s"),
                    "context_parallel": planned.strategy.context_parallel,
                    "context_parallel_s": planned.search_stats.get("context_parallel_s"),
                    "families": len(planned.strategy.pipelines),
                    "strategy": describe_strategy(planned.strategy),
                    "plan_time_s": elapsed,
                }
            )
    print(f"{'seq':>6} {'option':<30} {'iter s':>8} {'tokens/s':>10} {'MFU':>6} {'speedup':>8} {'ZeRO':>6} "
          f"{'CP':>3} {'fam':>3} {'plan s':>6}")  # fmt: skip
    for row in rows:
        if not row["fits"]:
            print(f"{row['seq_length']:>6} {row['option']:<30} does not fit: {row['reason']}")
            continue
        print(
            f"{row['seq_length']:>6} {row['option']:<30} {row['iteration_time_s']:>8.2f} {row['tokens_per_s']:>10,.0f} "
            f"{row['mfu']:>6.1%} {row['vs_defaults']:>+8.1%} {row['zero']:>6} {row['context_parallel']:>3} "
            f"{row['families']:>3} "
            f"{row['plan_time_s']:>6.1f}"
        )
    out = ROOT / "bench" / "results" / "parallel_options.json"
    body = {"machine": platform.node(), "cluster": CLUSTER, "model": MODEL, "rows": rows}
    out.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    print(f"\nwritten to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
