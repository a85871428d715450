"""When a node dies, what it costs: 4 local ranks of examples/cpu-hetero.yaml train with checkpoints, one rank is
killed (SIGKILL) as a step starts, the supervisor re-plans for the 3 devices left and resumes from the last
checkpoint. For a killed `fast` and a killed `slow` rank, saving synchronously and in the background: detection,
stopping the survivors, re-planning, reloading (and from respawn to loaded), steps lost, throughput before and
after, and the time a save holds a step; table + bench/results/elastic.json.

Run: python bench/elastic.py [--steps 8] [--every 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.plan import LoadedPlan, describe_strategy  # noqa: E402
from planner.planning import plan as make_plan  # noqa: E402
from runtime.elastic import run_elastic  # noqa: E402
from runtime.execute import RunSettings  # noqa: E402
from specs import load_cluster  # noqa: E402
from specs.model import ModelSpec  # noqa: E402
from specs.training import TrainingSpec  # noqa: E402

CLUSTER = ROOT / "examples" / "cpu-hetero.yaml"
# a 1M-parameter Llama shape: the steps take a tenth of a second here, so the costs of a failure stand out
MODEL = ModelSpec(name="bench-1m", num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
                  num_kv_heads=2, vocab_size=1024, seq_length=64, mlp="swiglu")  # fmt: skip
TRAINING = TrainingSpec(global_batch_size=8, seq_length=64, dtype="fp32", zero_stage=1, micro_batch_sizes=[1, 2])


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "elastic.json")
    args = parser.parse_args()
    cluster = load_cluster(CLUSTER)
    first = make_plan(cluster, MODEL, TRAINING)
    plan = LoadedPlan(first.strategy, MODEL, TRAINING, "bench plan")
    die_at = args.every + 1  # one step after a checkpoint: one completed step is lost
    rows = []
    for victim in (0, 3):
        for background in (False, True):
            with tempfile.TemporaryDirectory(prefix="hetplan-bench-elastic-") as scratch:
                settings = RunSettings(
                    steps=args.steps, seed=0, dtype="fp32", timeout_s=120, checkpoint_dir=str(Path(scratch, "ck")),
                    checkpoint_every=args.every, checkpoint_async=background, fail_at=(victim, die_at),
                )  # fmt: skip
                run = run_elastic(plan, cluster, settings, max_restarts=1)
            (event,) = run.interruptions
            saves = [c for r in run.results for c in r.get("checkpoints", []) if "save_s" in c]
            writes = [c["write_s"] for r in run.results for c in r.get("checkpoints", []) if "write_s" in c]
            row = {
                "killed_rank": victim,
                "save": "background" if background else "synchronous",
                **{key: event[key] for key in ("lost_devices", "detect_s", "stop_survivors_s", "replan_s", "reload_s",
                                               "respawn_to_loaded_s", "steps_lost", "resumed_from_step", "plan_after",
                                               "throughput_before_samples_per_s", "throughput_after_samples_per_s")},
                "step_held_by_save_s": max(c["save_s"] for c in saves),
                "background_write_s": max(writes) if writes else None,
                "losses_by_step": [run.losses[s] for s in sorted(run.losses)],
            }  # fmt: skip
            rows.append(row)
            print(
                f"killed rank {victim} ({', '.join(event['lost_devices'])}), {row['save']} saves: detect "
                f"{_num(row['detect_s'])} s, stop {_num(row['stop_survivors_s'])} s, re-plan {_num(row['replan_s'])} "
                f"s, reload {_num(row['reload_s'])} s (respawn to loaded {_num(row['respawn_to_loaded_s'], 1)} s; "
                f"from step {row['resumed_from_step']}), {row['steps_lost']} step(s) lost, "
                f"{_num(row['throughput_before_samples_per_s'], 1)} -> "
                f"{_num(row['throughput_after_samples_per_s'], 1)} samples/s, a save held the step "
                f"{_num(row['step_held_by_save_s'])} s"
            )
    body = {
        "cluster": cluster.name,
        "model": MODEL.model_dump(mode="json"),
        "training": TRAINING.model_dump(mode="json"),
        "plan": describe_strategy(plan.strategy),
        "steps": args.steps,
        "checkpoint_every": args.every,
        "dies_as_step_starts": die_at,
        "machine": f"{platform.node()} ({platform.machine()})",
        "note": "this machine's cores are shared with other work: respawn to loaded is mostly process start and "
        "`import torch` of the new ranks; throughput is noisy for the same reason. A background save still in flight "
        "when a rank dies is lost (the dead rank takes part in its collectives): the restart takes the previous "
        "complete checkpoint, or the seed's weights when there is none (resumed from step 0, reload '-')",
        "runs": rows,
    }
    args.out.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
